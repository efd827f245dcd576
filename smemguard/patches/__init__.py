"""One module per patched target, all with one contract, listed once in :data:`MODULES`.

The modules sit in a folder per kind of target (``triton_seams``, ``torch_seams``, ``contrib``: different risk,
different release cadence). Each defines ``PATCH``, a :class:`Patch` (or a class built on it:
:class:`~.contrib._declared_wrappers.DeclaredWrappers`): the
contract as data (what it patches, the modules whose import applies it, the releases it was checked against, whether
it is safe in observe mode, which settings want it, its layers) and one implementation of ``patch(engine)``,
``unpatch()`` and ``is_patched()`` for all of them. ``engine`` is the installed engine (:class:`Port` says what a
patch may use of it; no patch imports it): a patch keeps it in ``PATCH.engine`` and its layers read it there at each
call, so a layer another tool kept alive after ``uninstall()`` does nothing, and serves the next install.

The Triton patches (``supported.package == "triton"``) are applied at install, each on its own; the others
each when one of their ``modules`` is imported. A library pack names its kernels as :class:`Kernels`: every module a
release of the library kept them in, and what the pack's safety argument reads of them; it applies wherever an
imported release's kernels have all of it, and nowhere else.
"""

from __future__ import annotations

import importlib
import logging
import sys
from types import ModuleType
from typing import Any, Callable, ContextManager, Iterable, Protocol

from .. import _moved
from ..facts.install import Memory, Notes
from ..facts.process import ProcessFlag
from ..facts.settings import Settings
from ..facts.versions import Supported
# The layer mechanism, which every patch module imports from here.
from .layers import Layer, bound, rebind, wrapt_layer  # noqa: F401

log = logging.getLogger(__name__)

_moved.add_finder(__path__)  # the patch modules' paths before they moved into folders (smemguard._moved.MOVED)

#: The Triton releases smemguard was read and tested against as a whole; a Triton patch may
#: declare a narrower ``supported`` (it is then skipped outside it, the rest still applies).
TRITON = Supported("triton", (3, 4), (3, 9), label="Triton")
#: The Triton releases every Triton patch was read against, unless it says otherwise.
TRITON_CHECKED = ("3.4.0", "3.5.1", "3.6.0", "3.7.1", "3.8.0", "3.9.0")

#: Every patch module, in the order they are applied (and removed in reverse), in the folder of its kind:
#: ``triton_seams`` (Triton's own functions, on every launch's path), ``torch_seams`` (torch's and Inductor's),
#: ``contrib`` (a library's pack). A patch is named by its module's own name (``SMEMGUARD_DISABLE``, records).
MODULES = (
    "triton_seams.max_shared_mem",
    "torch_seams.torch_device_properties",
    "triton_seams.autotuner_bench",
    "triton_seams.jit_compile",
    "triton_seams.triton_compile",
    "triton_seams.kernel_interface",
    "triton_seams.kernel_warmup",
    "contrib.vllm_batch_invariant",
    "contrib.deepgemm_metadata",
    "contrib.flaggems",
    "contrib.vllm_unified_attention",
    "contrib.vllm_prefill_attention",
    "contrib.vllm_prefix_prefill",
    "contrib.vllm_shared_memory",
    "contrib.sglang_extend_attention",
    "contrib.sglang_prefill_attention",
    "contrib.lmdeploy_flash_attention",
    "torch_seams.inductor_static_launcher",
    "torch_seams.inductor_launchers",
    "torch_seams.inductor_autotune",
    "torch_seams.inductor_flex_configs",
    "torch_seams.inductor_cache_key",
)
#: The patches' names, as ``SMEMGUARD_DISABLE`` and ``smemguard versions`` spell them.
NAMES = tuple(module.rpartition(".")[2] for module in MODULES)


class StepGuard(Protocol):
    """The guard around a patch's own steps in handling one failure (:class:`smemguard.engine.steps.Steps`): an
    error inside ``with guard.skippable(name):`` is logged once and skipped (the record names it in ``failed``)."""

    failed: list[str]

    def skippable(self, step: str) -> ContextManager[None]:
        """A step whose failure the handling survives."""


class Port(Protocol):
    """What a patch may use of the installed engine (:class:`smemguard.engine.core.Engine`). None of its entry
    points raises an error of smemguard's own."""

    #: the settings the guard was installed with
    settings: Settings
    #: what the patches of this install decided, a table per patch (``memory.table(name)``, changed under
    #: ``memory.lock``), forgotten when the engine closes
    memory: Memory
    #: what the seams of this install noted for the engine: the emulated limit, autotuner timings, failed launches,
    #: kernels put into Triton's JIT caches
    notes: Notes
    #: true while the engine compiles variants of its own (the ladder's candidates on its pool of threads, warm-up
    #: and torch.compile recoveries, the core's fewer-stage compiles), which it measures as they are: the compile
    #: seams then hand Triton's result on without asking the engine (a process-wide flag: test it, never call it)
    compiling: ProcessFlag

    def steps(self, subject: str) -> StepGuard:
        """The guard around a patch's own steps in handling one failure of ``subject``."""

    def on_out_of_resources(self, kernel, grid, args: tuple, kwargs: dict, error, again: Callable[[], Any]) -> Any:
        """What the failed launch ``kernel[grid](*args, **kwargs)`` returns once recovered, or raises ``error``;
        ``again()`` runs the launch once more as it was asked."""

    def remembered_compile(self, jit, source, device: int, options, *, launching: bool) -> dict | None:
        """Option overrides remembered for the variant Triton is about to compile (``{"num_stages": 3}``), or
        None; raises the OutOfResources of a variant stored as overflowing where compiling it gains nothing."""

    def on_warmup(self, kernel, grid, args: tuple, kwargs: dict, compiled) -> Any:
        """The compiled kernel that will run for a warm-up (a replacement when ``compiled`` does not fit)."""

    def pinned_compile(self, compile_fn, args: tuple, kwargs: dict) -> Any:
        """What ``compile_fn(*args, **kwargs)`` compiles with the options an operator pinned for the kernel on this
        GPU, or None: compile as asked."""

    def on_compiled(self, compile_fn, args: tuple, kwargs: dict, kernel) -> Any:
        """``kernel`` as Triton's compile returned it, or a fewer-stage compile of it that fits the device."""

    def deepgemm_remembered(self, call_of: Callable[[], Any]) -> Any:
        """DeepGEMM's paged-MQA schedule computed in torch where DeepGEMM refused this case before with a batch no
        larger, or None; ``call_of()`` describes the call (asked only when something was refused)."""

    def on_deepgemm_refusal(self, call_of: Callable[[], Any], deep_gemm_of: Callable[[], Any], error) -> Any:
        """The schedule computed in torch when ``error`` is DeepGEMM refusing the batch for shared memory (recorded
        and remembered), or None: the error stands."""

    def on_inductor_load(self, autotuner) -> None:
        """Before Inductor's ``CachingAutotuner`` loads its compile results: replace those the decision cache
        holds a fitting variant of."""

    def on_inductor_overflow(self, autotuner, error, configs: list) -> bool | None:
        """True when variants that fit were loaded in place of ``configs``, False when none fits, None when
        smemguard has no answer."""

    def on_flex_configs(self, kind: str, configs: list, head_dim: int, dtype, started: float, steps) -> list:
        """FlexAttention's ``configs`` of ``kind`` with each that cannot fit at any stage count replaced by the
        largest halving of its tiles that can, before Inductor renders them."""


#: What :meth:`Kernels.verdict` says of a module that is not this release's home of the kernels (none of them there,
#: or a build without a usable Triton that defines them as plain functions): nothing to patch, nothing to say.
NOT_HERE = "not here"


class Kernels:
    """A library's Triton kernels as a pack's safety argument reads them, found wherever a release keeps them.

    ``homes``: every module that held them in the releases read, newest first (a process imports one release, and
    its home is where the kernels are). ``kernels``: each kernel's name and the parameters the argument reads.
    ``tiles``: the parameters the pack changes; each must size a block of every kernel that takes it
    (:attr:`smemguard.kernels.parameters.Knobs.shapes`). ``masked``: those of them whose every load and store the
    argument needs masked (:func:`smemguard.kernels.tails.unmasked`). ``reads``: what else the argument reads of the
    home, each ``(what, test)``, ``test(module)`` true where it holds (the wrapper that chooses the tile, the grid
    computed from it).

    :meth:`found` gives each imported home whose kernels have all of it; one that misses something gets one line
    saying what, and is left as the library wrote it. A pack so applies to every release whose kernels qualify,
    wherever that release keeps them, and to no other.
    """

    def __init__(self, homes: tuple[str, ...], kernels: dict[str, Iterable[str]], *, tiles: tuple[str, ...] = (),
                 masked: tuple[str, ...] = (), reads: tuple[tuple[str, Callable[[ModuleType], bool]], ...] = ()):
        self.homes, self.tiles, self.masked, self.reads = homes, tiles, masked, reads
        self.kernels = {name: frozenset(params) for name, params in kernels.items()}
        self._verdicts: dict[int, tuple[ModuleType, str | None]] = {}  # module id -> (module, verdict): read once

    def found(self, patch: str) -> list[tuple[str, ModuleType]]:
        """(name, module) of each imported home whose kernels qualify; one line (once) for each that does not."""
        from ..facts import process

        qualified = []
        for name in self.homes:
            module = sys.modules.get(name)
            if module is None:
                continue
            verdict = self.verdict(module)
            if verdict is None:
                qualified.append((name, module))
            elif verdict is not NOT_HERE:
                process.warn_once(log, ("does not qualify", patch, name), "smemguard: %s is not applied to %s: %s, "
                                  "which its safety argument reads; it runs as the library wrote it", patch, name,
                                  verdict)
        return qualified

    def verdict(self, module: ModuleType) -> str | None:
        """None when ``module``'s kernels have all the argument reads; else what they miss (:data:`NOT_HERE`:
        they are not there). Read once per module."""
        known = self._verdicts.get(id(module))
        if known is None or known[0] is not module:
            known = self._verdicts[id(module)] = (module, self._read(module))
        return known[1]

    def _read(self, module: ModuleType) -> str | None:
        from ..kernels import introspect

        present = {name: getattr(module, name) for name in self.kernels if getattr(module, name, None) is not None}
        jits = {name: introspect.jit_function(kernel) for name, kernel in present.items()}
        if not present or not all(hasattr(jit, "arg_names") for jit in jits.values()):
            return NOT_HERE
        missing = [name for name in self.kernels if name not in present]
        if missing:
            return f"it has no kernel {', '.join(missing)}"
        for name, jit in jits.items():
            why = self._kernel_verdict(name, jit)
            if why is not None:
                return why
        lacking = [what for what, test in self.reads if not _holds(test, module)]
        return f"it does not have {'; '.join(lacking)}" if lacking else None

    def _kernel_verdict(self, name: str, jit) -> str | None:
        from ..kernels import parameters, tails

        lacking = sorted(self.kernels[name] - set(jit.arg_names))
        if lacking:
            return f"{name} has no parameter {', '.join(lacking)}"
        tiles = [tile for tile in self.tiles if tile in jit.arg_names]
        sizing = parameters.knobs_of(jit).shapes
        unsized = [tile for tile in tiles if tile not in sizing]
        if unsized:
            return f"{name} sizes no block with {', '.join(unsized)}"
        masked = {tile for tile in self.masked if tile in tiles}
        if not masked:
            return None
        accesses = tails.unmasked(jit)
        if accesses is None:
            return f"the source of {name} cannot be read"
        unmasked = [access.text() for access in accesses if access.tiles & masked]
        return f"{name} loads or stores without a mask at {'; '.join(unmasked)}" if unmasked else None


def _holds(test: Callable[[ModuleType], bool], module: ModuleType) -> bool:
    try:
        return bool(test(module))
    except Exception:  # a module laid out otherwise than the test expects: it does not hold
        log.debug("smemguard: %r raised on %s", test, getattr(module, "__name__", module), exc_info=True)
        return False


class Patch:
    """One patch's contract as data, and ``patch``/``unpatch``/``is_patched`` for it.

    ``name``: the patch module (``__name__``); ``target``: what it patches, dotted; ``modules``: the modules
    whose import (re)applies it; ``kernels``: a library pack's :class:`Kernels`, whose homes are then its
    ``modules`` and ``target`` the attribute within them (``targets``: one per home); ``supported``: the releases
    admitted (:class:`~smemguard.facts.versions.Supported`); ``checked``: the releases its target was read against,
    newest last; ``observe_safe``: whether it applies in ``SMEMGUARD=observe`` (it only enforces the emulated limit,
    records, or describes kernels to the engine); ``wanted(settings)``: whether these settings want it at all (no
    emulated limit: no ``max_shared_mem``); ``layers``: ``{Layer: build}``, each added by ``Layer.add(build)``;
    ``apply(engine)`` runs before they are added (it may add layers of its own), ``remove()`` after they are taken
    out; ``present()`` replaces "every layer is there" as the answer of :meth:`is_patched`.

    :meth:`patch` is idempotent and runs again on each import of one of ``modules`` (a library patch may find
    more kernels); :meth:`unpatch` removes only smemguard's own layers and tolerates partial state;
    :meth:`is_patched` is read from the targets themselves.
    """

    engine: Port | None = None

    def __init__(self, name: str, *, target: str, modules: tuple[str, ...] = (), supported: Supported,
                 checked: tuple[str, ...], observe_safe: bool, kernels: Kernels | None = None,
                 wanted: Callable[[Any], bool] | None = None, layers: dict | None = None,
                 apply: Callable[[Port], None] | None = None, remove: Callable[[], None] | None = None,
                 present: Callable[[], bool] | None = None):
        self.name = name.rsplit(".", 1)[-1]
        self.kernels = kernels
        if kernels is not None:
            modules = kernels.homes
            self.targets = tuple(f"{home}.{target}" for home in kernels.homes)
        else:
            self.targets = (target,)
        self.target, self.modules, self.supported, self.checked = self.targets[0], modules, supported, checked
        self.observe_safe = observe_safe
        self._wanted, self._layers = wanted, dict(layers or {})
        self._apply, self._remove, self._present = apply, remove, present

    def __repr__(self) -> str:
        return f"<smemguard patch {self.name}: {self.target}>"

    def applies(self, settings) -> bool:
        return self._wanted is None or bool(self._wanted(settings))

    def patch(self, engine: Port) -> None:
        self.engine = engine
        if self._apply is not None:
            self._apply(engine)
        for layer, build in self._layers.items():
            layer.add(build)

    def unpatch(self) -> None:
        for layer in reversed(self._layers):
            layer.remove()
        if self._remove is not None:
            self._remove()
        self.engine = None

    def is_patched(self) -> bool:
        if self._present is not None:
            return bool(self._present())
        return bool(self._layers) and all(layer.present() for layer in self._layers)

    def homes(self) -> list[tuple[str, ModuleType]]:
        """(name, module) of each imported home of the pack's kernels that has what its argument reads."""
        return self.kernels.found(self.name) if self.kernels is not None else []

    def records_path(self):
        """Where this install's incident records go (None: to the log only, as while uninstalled)."""
        engine = self.engine
        return engine.settings.log_path if engine is not None else None

    def memory(self) -> dict:
        """This patch's table in the engine's memory (``Port.memory``: changed under its lock); while
        uninstalled, an empty one kept nowhere."""
        engine = self.engine
        return engine.memory.table(self.name) if engine is not None else {}


class Registration:
    """What a library patch files in :mod:`smemguard.kernels.registry` for the library's Triton kernels (a fallback, a
    list of alternatives), for the kernels its :class:`Kernels` found: each kernel once, all taken back by
    :meth:`clear`. ``register(kernel, value)``, ``unregister(kernel)`` and ``registered(kernel)`` are the
    registry's; ``memory()`` is the patch's table in the install's memory (:meth:`Patch.memory`), where the kernels
    filed are kept until :meth:`clear`."""

    def __init__(self, register: Callable[[Any, Any], None], unregister: Callable[[Any], None],
                 registered: Callable[[Any], Any], memory: Callable[[], dict]):
        self._register, self._unregister, self._registered, self._memory = register, unregister, registered, memory

    @property
    def _kernels(self) -> list:
        return self._memory().setdefault("registered kernels", [])

    def add(self, kernel, value) -> None:
        """File ``value`` for ``kernel``."""
        kernels = self._kernels
        if any(kernel is known for known in kernels):
            return
        self._register(kernel, value)
        kernels.append(kernel)

    def holds(self, kernel, value) -> bool:
        """Whether ``kernel`` carries ``value`` in the registry now."""
        return self._registered(kernel) is value

    def clear(self) -> None:
        kernels = self._kernels
        while kernels:
            self._unregister(kernels.pop())


def patch_of(module: str) -> Patch:
    """The ``PATCH`` of ``module`` (as :data:`MODULES` lists it: ``"triton_seams.kernel_interface"``)."""
    return importlib.import_module(f"{__name__}.{module}").PATCH


def all_patches() -> tuple[Patch, ...]:
    return tuple(patch_of(name) for name in MODULES)


def triton_patches() -> tuple[Patch, ...]:
    return tuple(patch for patch in all_patches() if patch.supported.package == "triton")


def library_patches() -> tuple[Patch, ...]:
    return tuple(patch for patch in all_patches() if patch.supported.package != "triton")
