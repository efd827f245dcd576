"""A failed launch, as the engine sees it: the layers it went through, its arguments, and how to
compile, check and relaunch it.

:func:`resolve` follows a ``kernel[grid](...)`` launch through entry, heuristics and tuner
layers (:mod:`smemguard.kernels.tuners`) down to the JIT function, as their ``run`` methods would, and
gives a :class:`Launch`. Everything here compiles at most; nothing launches except
:meth:`Launch.relaunch`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..facts import process
from ..facts.install import Notes
from . import introspect, parameters, registry, tuners

#: Exceptions that mean smemguard built a candidate wrongly (a bad argument binding, a missing
#: attribute), not that the candidate does not compile: counted as ``internal_error``.
INTERNAL_ERRORS = (TypeError, KeyError, AttributeError, NameError, IndexError)


@dataclass(frozen=True)
class Attempt:
    """One configuration compiled to see whether it fits."""

    config: str
    required: int | None
    limit: int | None
    fits: bool
    error: str | None = None
    internal_error: bool = False  # the error was smemguard's own (see INTERNAL_ERRORS), not the compiler's
    compile_ms: float | None = None  # how long compiling and checking it took (None: not compiled here)

    def summary(self, label: str | None = None) -> str:
        """``num_stages=3: 98304 B (fits)``; ``label`` replaces the full configuration."""
        label = label or self.config
        if self.error:
            return f"{label}: {self.error}"
        verdict = "fits" if self.fits else "too big"
        return f"{label}: {self.required} B ({verdict})"


@dataclass
class Launch:
    """A failed launch, resolved down to the JIT function it reached."""

    launched: Any  # what the user indexed: JIT function, autotuner, heuristics, a library's entry
    grid: Any
    args: tuple
    kwargs: dict
    jit: Any
    jit_kwargs: dict  # the kwargs ``jit.run`` received
    tuner: Any = None  # the tuning layer it went through (Triton's Autotuner or a library's), if any
    tuning_key: tuple | None = None
    config: Any = None  # the tuner's config in force
    tuner_kwargs: dict = field(default_factory=dict)  # the kwargs the tuning layer received
    tuner_kind: tuners.Tuner | None = None  # how to read and update ``tuner``

    def named_args(self) -> dict:
        """Every kernel parameter by name, as the kernel sees it."""
        named = {param.name: param.default for param in self.jit.params if param.has_default}
        named.update(zip(self.jit.arg_names, self.args))
        named.update((name, value) for name, value in self.jit_kwargs.items() if name in self.jit.arg_names)
        return named

    def constexpr_names(self) -> set[str]:
        return {param.name for param in self.jit.params if param.is_constexpr}

    def run_config_pre_hook(self) -> None:
        if self.config is not None and self.config.pre_hook is not None:
            self.config.pre_hook({**self.named_args(), **self.config.all_kwargs()})

    def compile(self, **options):
        """Compile (never launch) with other launch ``options``.

        A parameter that follows the option (:mod:`smemguard.kernels.parameters`: a pipeline depth the kernel
        gives its loops' ``num_stages=``, a warp count it passes on as ``num_warps=``) is lowered
        with it, so that the count asked for is the count compiled. Some kernels take a launch
        option's name as a parameter of their own (Liger-Kernel passes ``num_stages`` and
        ``num_warps`` positionally); Triton then binds a keyword of that name to the parameter as
        well as reading it as the option. Changing such an option is allowed only when the kernel
        leaves the parameter unused or uses it only as that option: :class:`~.parameters.OptionIsAParameter`
        otherwise.

        The config's pre-hook runs first: a TMA pre-hook sets descriptor block shapes, which are part
        of the compiled signature (and so, under concurrent compiles, bound in turn).
        """
        self.run_config_pre_hook()
        named = self.named_args()
        following = self.following(options)
        shared_names = [name for name in options if name in self.jit.arg_names]
        if not shared_names and not following:
            return self.jit.run(*self.args, grid=self.grid, warmup=True, **{**self.jit_kwargs, **options})
        # Every parameter by name: a constexpr passed positionally cannot also be passed by keyword.
        non_parameters = {k: v for k, v in self.jit_kwargs.items() if k not in self.jit.arg_names}
        kwargs = {**named, **non_parameters, **options, **following}
        kernel = self.jit.run(grid=self.grid, warmup=True, **kwargs)
        if all(getattr(kernel.metadata, name, value) == value for name, value in options.items()):
            return kernel
        # Triton keys its JIT cache on the parameter, not on the option read from the same keyword: when
        # the parameter already had that value, the cache hands back the variant compiled with the default
        # option. Compile past it, then put the cached kernel back (a decision replaces it later).
        kernel_cache = self.jit.device_caches[process.current_device()][0]
        stale = {key: cached for key, cached in list(kernel_cache.items()) if cached is kernel}
        for key in stale:
            del kernel_cache[key]
        try:
            return self.jit.run(grid=self.grid, warmup=True, **kwargs)
        finally:
            kernel_cache.update(stale)

    def following(self, options: dict) -> dict:
        """The parameters lowered with launch ``options`` (:meth:`smemguard.kernels.parameters.Knobs.lowered_with`)."""
        return parameters.knobs_of(self.jit).lowered_with(options, self.named_args())

    def relaunch(self):
        self.run_config_pre_hook()
        return self.jit.run(*self.args, grid=self.grid, warmup=False, **self.jit_kwargs)

    def alternatives(self) -> list:
        """The alternatives registered for the kernel (:func:`smemguard.register_alternatives`) that this launch may
        switch to: none through a tuner (its configs are its own), else those whose parameters its grid function
        reads (:meth:`grid_reads`), every one they change that the kernel's program ids step over among them
        (:meth:`grid_misses`), so that the grid follows the tile that runs. A grid computed from the tiles the caller
        launched would leave most of the output unwritten with a smaller one."""
        if self.tuner is not None:
            return []
        reads = self.grid_reads()
        return [config for config in registry.alternatives_for(self.jit)
                if reads & config.kwargs.keys() and not self.grid_misses(config)]

    def grid_misses(self, config) -> frozenset:
        """The parameters ``config`` changes that the kernel's program ids step over
        (:func:`smemguard.kernels.parameters.program_tiles`) and its grid function does not read: a grid that reads
        ``meta["BLOCK_M"]`` but holds the caller's ``BLOCK_N`` in a closure."""
        stepped = parameters.program_tiles(self.jit) or frozenset()
        named = self.named_args()
        changed = {name for name, value in config.kwargs.items() if named.get(name) != value}
        return frozenset(changed & stepped) - self.grid_reads()

    def grid_reads(self) -> frozenset:
        """The parameters the launch's grid function reads from the meta-parameters Triton gives it (all of them
        where it takes them whole): none for a tuple grid, nor for a function that ignores its argument (its
        result was computed from the tiles the caller chose, as a tuple's), nor for one that fails on them."""
        if not callable(self.grid):
            return frozenset()
        meta = _ReadMeta(self.named_args())
        try:
            self.grid(meta)
        except Exception:  # Triton's own call succeeded: a grid that fails on a copy is no grid to rely on
            return frozenset()
        return frozenset(meta.read)


class _ReadMeta(dict):
    """The meta-parameters as a grid function gets them (a dict), noting which ones it reads."""

    def __init__(self, named: dict):
        super().__init__(named)
        self.read: set[str] = set()

    def __getitem__(self, name):
        self.read.add(name)
        return super().__getitem__(name)

    def get(self, name, default=None):
        self.read.add(name)
        return super().get(name, default)

    def __contains__(self, name) -> bool:
        self.read.add(name)
        return super().__contains__(name)

    def __iter__(self):  # taken whole (``**meta``, ``dict(meta)``, a loop): every parameter read
        self.read.update(super().keys())
        return super().__iter__()

    def keys(self):
        self.read.update(super().keys())
        return super().keys()

    def values(self):
        self.read.update(super().keys())
        return super().values()

    def items(self):
        self.read.update(super().keys())
        return super().items()


def resolve(launched, grid, args, kwargs, config=None) -> Launch | None:
    """Follow entry, heuristics and tuner layers down to the JIT function, as their ``run`` would.

    ``config`` replaces the tuner's choice. None when a layer is not understood
    (:mod:`smemguard.kernels.tuners`).
    """
    from triton.runtime.autotuner import Heuristics
    from triton.runtime.jit import JITFunction

    kw = dict(kwargs)
    tuner = key = chosen = tuner_kind = None
    tuner_kwargs: dict = {}
    for layer in introspect.chain(launched):
        if isinstance(layer, JITFunction):
            return Launch(launched, grid, args, kwargs, layer, kw, tuner, key, chosen, tuner_kwargs, tuner_kind)
        if tuners.runs_as(layer, Heuristics):
            for name, heuristic in layer.values.items():
                kw[name] = heuristic({**dict(zip(layer.arg_names, args)), **kw})
        elif tuner is None and (tuner_kind := tuners.tuner_for(layer)) is not None:
            tuner, tuner_kwargs = layer, dict(kw)
            key = tuner_kind.key(layer, args, kw)
            chosen = config if config is not None else tuner_kind.config_in_force(layer, key)
            kw = {**kw, **chosen.all_kwargs()}
        elif not tuners.is_entry(layer):  # an entry passes the call on unchanged
            return None
    return None


def unknown_layer(launched):
    """The first layer of ``launched`` that :func:`resolve` does not understand (what stops a retry)."""
    from triton.runtime.autotuner import Heuristics
    from triton.runtime.jit import JITFunction

    for layer in introspect.chain(launched):
        if isinstance(layer, JITFunction):
            return None
        if not (tuners.runs_as(layer, Heuristics) or tuners.tuner_for(layer) or tuners.is_entry(layer)):
            return layer
    return launched


def with_config(launch: Launch, config) -> Launch:
    """``launch`` with ``config`` in force: through the tuner, or by keyword on a plain JIT function."""
    if launch.tuner is not None:
        return resolve(launch.launched, launch.grid, launch.args, launch.kwargs, config=config)
    # Every parameter by name: a constexpr passed positionally cannot also be passed by keyword.
    options = {k: v for k, v in launch.jit_kwargs.items() if k not in launch.jit.arg_names}
    kwargs = {**launch.named_args(), **options, **config.all_kwargs()}
    return Launch(launch.launched, launch.grid, (), kwargs, launch.jit, kwargs, config=config)


def overflow(kernel):
    """The ``OutOfResources`` Triton would raise when loading ``kernel`` now (its own
    ``_init_handles`` checks, no launch), or None when it fits."""
    from triton.runtime.errors import OutOfResources

    try:
        kernel._init_handles()
    except OutOfResources as error:
        return error
    # A kernel that failed the "threads" check stays loaded, so _init_handles returns early on it.
    threads = kernel.metadata.num_warps * getattr(kernel.metadata, "warp_size", 32)
    if threads > kernel.n_max_threads:
        return OutOfResources(threads, kernel.n_max_threads, "threads")
    return None


def check(kernel) -> tuple[bool, int, int]:
    """(fits, bytes or threads required, limit) for ``kernel`` on this device now."""
    error = overflow(kernel)
    if error is not None:
        return False, error.required, error.limit
    return True, kernel.metadata.shared, process.effective_limit(process.current_device())


def describe(launch: Launch, kernel=None, lowered: dict | None = None) -> str:
    """``BLOCK_M=128 BLOCK_N=64 num_warps=4 num_stages=3``: the constexprs (with the parameters
    ``lowered`` with the options) and the options in force."""
    constexprs = {**launch.named_args(), **(lowered or {})}
    # A parameter named like a launch option (Liger-Kernel's num_stages) is shown as the option it becomes.
    parts = [f"{p.name}={constexprs.get(p.name)}" for p in launch.jit.params
             if p.is_constexpr and isinstance(constexprs.get(p.name), (int, str, bool))
             and (kernel is None or p.name not in introspect.CONFIG_OPTIONS)]
    if kernel is not None:
        parts += [f"num_warps={kernel.metadata.num_warps}", f"num_stages={kernel.metadata.num_stages}"]
    return " ".join(parts)


def try_compile(launch: Launch, label: str, **options) -> tuple[Any, Attempt]:
    """Compile ``launch`` with ``options`` and check it: (kernel or None, what was found).

    A candidate that does not compile (CompilationError, PTXASError, an option the kernel uses
    itself) is not a fit; one that smemguard could not even build is an internal error, named
    as such in the attempt. Neither stops the other candidates.
    """
    started = time.perf_counter()
    try:
        kernel = launch.compile(**options)
    except Exception as error:
        return None, _not_compiled(label, error, started)
    return _checked(launch, kernel, started, launch.following(options))


def try_compile_all(candidates: list[tuple[Launch, str]]) -> list[tuple[Any, Attempt]]:
    """:func:`try_compile` for each (launch, label), in order, the compiles running concurrently
    where Triton allows it: its ``AsyncCompileMode`` (Triton 3.5 and later) binds and specializes
    the arguments in this thread, so pre-hooks and argument checks run in order, and runs the
    compiler in worker threads (ptxas and much of MLIR's work release the GIL). Checking a compiled
    kernel against the limit stays in this thread, which holds the device context."""
    try:
        from triton.runtime import _async_compile
    except ImportError:  # Triton 3.4
        _async_compile = None
    if len(candidates) < 2 or _async_compile is None or _async_compile.active_mode.get() is not None:
        return [try_compile(launch, label) for launch, label in candidates]
    from concurrent.futures import ThreadPoolExecutor

    started = time.perf_counter()
    results: list[tuple[Any, Attempt] | None] = []
    with ThreadPoolExecutor(len(candidates), thread_name_prefix="smemguard-compile") as pool, \
            _async_compile.AsyncCompileMode(pool, ignore_errors=True):
        pending = []
        for launch, _label in candidates:
            try:
                pending.append(launch.compile())
            except Exception as error:  # binding failed: nothing was submitted
                pending.append(error)
        for (launch, label), kernel in zip(candidates, pending):
            try:
                if isinstance(kernel, Exception):
                    raise kernel
                if isinstance(kernel, _async_compile.FutureKernel):
                    kernel = kernel.result()
            except Exception as error:
                results.append(None if _interpreter_fault(error) else (None, _not_compiled(label, error, started)))
                continue
            results.append(_checked(launch, kernel, started))
    # Compiled again in turn: the thread, not the candidate, failed.
    return [result if result is not None else try_compile(launch, label)
            for (launch, label), result in zip(candidates, results)]


def _interpreter_fault(error: BaseException) -> bool:
    """Whether a compile in a worker thread failed for the interpreter's sake, not the kernel's: CPython
    3.11's ``ast.parse`` (Triton parses each called function's source) can raise ``SystemError: AST
    constructor recursion depth mismatch`` while another thread parses too (cpython gh-106905)."""
    seen = 0
    while error is not None and seen < 16:
        if isinstance(error, SystemError):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _not_compiled(label: str, error: Exception, started: float) -> Attempt:
    return Attempt(label, None, None, False, introspect.error_summary(error, width=200),
                   internal_error=isinstance(error, INTERNAL_ERRORS), compile_ms=_ms_since(started))


def _checked(launch: Launch, kernel, started: float, lowered: dict | None = None) -> tuple[Any, Attempt]:
    fits, required, limit = check(kernel)
    return kernel, Attempt(describe(launch, kernel, lowered), required, limit, fits, compile_ms=_ms_since(started))


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 3)


def jit_keys_of(launch: Launch, failing):
    """The JIT cache keys whose kernel is a compile of ``failing``.

    Matching by compile hash, not identity: threads that missed the JIT cache together each
    compiled (and stored) their own copy of the failing kernel.
    """
    kernel_cache = launch.jit.device_caches[process.current_device()][0]
    return (key for key, entry in list(kernel_cache.items())
            if (kernel := _compiled(entry)) is not None and kernel.hash == failing.hash)


def _compiled(entry):
    """The kernel a JIT cache entry holds. Under Triton's async compile mode an entry is a
    ``FutureKernel`` until its compile is finalized: its kernel once it is, None before (a compile
    still running, or failed, is not waited for here)."""
    import triton

    future_kernel = getattr(triton, "FutureKernel", None)  # Triton >= 3.5
    return entry.kernel if future_kernel is not None and isinstance(entry, future_kernel) else entry


def replace_in_jit_cache(launch: Launch, failing, replacement, notes: Notes) -> None:
    """Put ``replacement`` under every key whose kernel is a compile of ``failing``, each noted in ``notes`` (the
    install's: its uninstall takes them out again)."""
    device = process.current_device()
    kernel_cache = launch.jit.device_caches[device][0]
    for key in list(jit_keys_of(launch, failing)):
        kernel_cache[key] = replacement
        notes.note_replacement(launch.jit, device, key, replacement)
