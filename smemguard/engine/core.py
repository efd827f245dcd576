"""The engine one ``install()`` builds: the settings it was installed with, the decisions it takes, and the
entry points the patches call (:class:`smemguard.patches.Port` says which; patches receive the engine and never
import this module).

Every entry point hands back what its caller would have had without smemguard when the engine has no answer:
the launch's own error, the kernel as compiled, Inductor's own error. An error of smemguard's own is recorded
(``internal_errors``) and never replaces the user's. ``uninstall()`` closes the engine: from then on every entry
point passes through (a layer another tool kept alive still holds it), and the decisions it took and the kernels
it put into Triton's JIT caches are forgotten, so the next launch compiles what its caller asked for.
"""

from __future__ import annotations

import logging

from ..facts import process
from ..facts.install import Memory, Notes
from ..facts.settings import Settings
from .steps import Steps

log = logging.getLogger(__name__)


class Engine:
    """The deciding engine of one install (see the module's docstring)."""

    def __init__(self, settings: Settings):
        from .recovery import Decided

        self.settings = settings
        self.decided = Decided()
        self.memory = Memory()
        self.notes = Notes()
        self.compiling = process.engine_compiling
        self.closed = False

    @staticmethod
    def steps(subject: str) -> Steps:
        """The guard around smemguard's own steps in handling one failure of ``subject`` (a kernel's name)."""
        return Steps(subject)

    def __repr__(self) -> str:
        return f"<smemguard engine mode={self.settings.mode}{' closed' if self.closed else ''}>"

    def on_out_of_resources(self, kernel, grid, args, kwargs, error, again):
        """What the failed launch ``kernel[grid](*args, **kwargs)`` returns once recovered, or ``error`` raised."""
        from . import recovery

        if self.closed:
            raise error
        return recovery.handle(self, kernel, grid, args, kwargs, error, again)

    def remembered_compile(self, jit, source, device, options, *, launching: bool):
        """Option overrides remembered for the variant Triton is about to compile, or its stored refusal."""
        from . import recall

        if self.closed:
            return None
        return recall.remembered_compile(jit, source, device, options, self.settings.cache_dir,
                                              launching=launching)

    def on_warmup(self, kernel, grid, args, kwargs, compiled):
        """The kernel a warm-up hands back: a replacement decided now when ``compiled`` does not fit."""
        from . import recovery

        if self.closed:
            return compiled
        with process.engine_compiling.scope():
            return recovery.handle_warmup(self, kernel, grid, args, kwargs, compiled)

    def pinned_compile(self, compile_fn, args, kwargs):
        """The kernel compiled with the options pinned for it on this GPU (:mod:`.pins`), or None: compile as
        asked (no pin applies, or it was refused)."""
        from . import pins

        if self.closed:
            return None
        try:
            return pins.pinned_compile(self, compile_fn, args, kwargs)
        except Exception:
            process.warn_once(log, ("pins", "internal"), "smemguard: internal error while applying a pin; the kernel "
                              "is compiled as asked (smemguard's bug: please report it)", exc_info=True)
            return None

    def on_compiled(self, compile_fn, args, kwargs, kernel):
        """The kernel Triton compiled, or a fewer-stage compile of it that fits (:mod:`.compile_fit`)."""
        from . import compile_fit

        return kernel if self.closed else compile_fit.fit(self, compile_fn, args, kwargs, kernel)

    def on_inductor_overflow(self, autotuner, error, configs) -> bool | None:
        """True when variants that fit were loaded; False when none fits (or ``error`` is not an overflow);
        None when smemguard has no answer (closed, or its own error)."""
        from . import inductor

        if self.closed:
            return None
        try:
            with process.engine_compiling.scope():
                return inductor.overflow_of(error) is not None and inductor.recover(self, autotuner, error, configs)
        except Exception:
            process.warn_once(log, ("inductor", "internal"), "smemguard: internal error while recovering a "
                              "torch.compile kernel; Inductor's own error is raised (smemguard's bug: please report "
                              "it)", exc_info=True)
            return None

    def on_inductor_load(self, autotuner) -> None:
        """Replace the compile results of ``autotuner`` that the decision cache holds a fitting variant of."""
        from . import inductor

        if self.closed:
            return
        try:
            with process.engine_compiling.scope():
                inductor.load_remembered(autotuner, self.settings)
        except Exception:
            process.warn_once(log, ("inductor", "internal"), "smemguard: internal error while applying a stored "
                              "decision to a torch.compile kernel; Inductor loads it as compiled (smemguard's bug: "
                              "please report it)", exc_info=True)

    def on_flex_configs(self, kind: str, configs: list, head_dim: int, dtype, started: float, steps) -> list:
        """FlexAttention's ``configs`` for ``kind`` (forward, backward) with each that cannot fit at any stage count
        replaced by the largest halving of its tiles that can (:mod:`.flex`); ``configs`` as given when closed or
        when a step of smemguard's own fails (``steps`` logs it)."""
        from . import flex

        if self.closed:
            return configs
        with steps.skippable("offer tiles that can fit"):
            return flex.offer_fitting(self, kind, configs, head_dim, dtype, started, steps)
        return configs

    def deepgemm_remembered(self, call_of):
        """DeepGEMM's paged-MQA schedule computed in torch when DeepGEMM refused this case before with a batch no
        larger (:mod:`.deepgemm`); None: call DeepGEMM (closed, nothing refused, or smemguard's own error)."""
        from . import deepgemm

        if self.closed:
            return None
        try:
            return deepgemm.remembered(self, call_of)
        except Exception:  # bookkeeping only: DeepGEMM gets the call
            log.debug("smemguard: could not reuse the DeepGEMM schedule decision", exc_info=True)
            return None

    def on_deepgemm_refusal(self, call_of, deep_gemm_of, error):
        """The schedule in torch when DeepGEMM's ``error`` is a refusal of the batch for shared memory; None: the
        error stands (not such a refusal, no schedule smemguard reproduces exactly, or smemguard's own error)."""
        from . import deepgemm

        if self.closed:
            return None
        try:
            return deepgemm.on_refusal(self, call_of, deep_gemm_of, error)
        except Exception:  # our own failure must not replace DeepGEMM's error
            log.debug("smemguard: no DeepGEMM schedule fallback", exc_info=True)
            return None

    def close(self) -> None:
        """Pass everything through from now on; forget the decisions taken, what the patches and declared wrappers
        learnt (:attr:`memory`), and the kernels put into Triton's JIT caches."""
        self.closed = True
        self.decided.clear()
        self.memory.clear()
        self.notes.drop_replacements()
