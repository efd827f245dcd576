"""Load-time recovery of torch.compile kernels: wraps Inductor's ``CachingAutotuner._make_launchers``.

Why: every Triton kernel Inductor generates for ``torch.compile`` (templates such as FlexAttention's
``triton_tem_fused_flex_attention_0``, pointwise ``triton_poi_*``, reductions ``triton_red_*`` and
``triton_per_*``, user kernels captured by Dynamo) is a ``CachingAutotuner``. Inductor compiles it
with ``triton.compile`` and launches it with ``kernel.run(...)``, so neither the launch guard nor the
JIT cache ever sees it. Shared memory is checked once, when the compiled graph is loaded (first call;
first ``.backward()``; load from Inductor's caches): ``_make_launchers`` loads every compile result,
drops those that do not fit, and raises ``RuntimeError("No valid triton configs. ...")`` when none is
left, which torch.compile turns into an ``InductorError``: the model does not run at all (an RTX 4090,
L4 or A10G given FlexAttention's A100 configs; pytorch #133254, #180278, #175250).

What: before Inductor loads, a config the decision cache holds a fitting variant of (decided by an
earlier process) is replaced by that variant, compiled through Inductor (``engine.on_inductor_load``,
:func:`smemguard.engine.inductor.load_remembered`), so nothing fails to load. When ``_make_launchers`` raises
for a resource that does not fit (shared memory, threads), the
engine (``engine.on_inductor_overflow``, :func:`smemguard.engine.inductor.recover`) compiles fewer-stage
variants of the configs Inductor had compiled (smaller blocks for pointwise and reduction kernels),
through Inductor's own ``_precompile_config`` and ``make_launcher``, and leaves the ones that load as
the kernel's compile results and launchers: ``_make_launchers`` then returns as if they had been
Inductor's own. Any other error, and a kernel nothing fits, raise what Inductor raised. torch 2.13's
own retry (the last config at one stage, ``dynamic_disable_pipelining``) is held back while Inductor
loads, so that the most stages that fit win rather than one. In observe mode the overflow is recorded,
Inductor's own retry runs, and Inductor's error is raised. A kernel that loads is never touched: the
wrapper adds one ``try`` to a call made once per kernel, never per launch.

In every release checked: ``CachingAutotuner._make_launchers(self)``, whose compile results carry ``config``,
``kernel`` and ``make_launcher()``, and ``_precompile_config(self, cfg)`` (releases: docs/MEASURED.md,
smemguard/patches/inductor_launchers.py).
"""

from __future__ import annotations

from ...facts.versions import Supported
from .. import Layer, Patch, wrapt_layer

_OWN_RETRY = "dynamic_disable_pipelining"
_ABSENT = object()


def _load_or_recover(wrapped, instance, args, kwargs):
    configs = [result.config for result in instance.compile_results or ()]
    engine = PATCH.engine
    # Not in observe mode, where Inductor's own retry stays Inductor's.
    recovering = engine is not None and not engine.settings.observe_only
    if recovering and configs:
        engine.on_inductor_load(instance)
    meta = instance.inductor_meta
    # torch 2.13's own retry (the last config at one stage) would answer first, with fewer stages than fit.
    before = meta.get(_OWN_RETRY, _ABSENT)
    held_back = recovering and before is not False
    if held_back:
        meta[_OWN_RETRY] = False
    try:
        return wrapped(*args, **kwargs)
    except Exception as error:
        failure = error
    finally:
        if held_back and before is _ABSENT:
            del meta[_OWN_RETRY]
        elif held_back:
            meta[_OWN_RETRY] = before
    # Outside the except block: Inductor's error reaches the caller as Inductor raised it, unchained.
    recovered = engine.on_inductor_overflow(instance, failure, configs) if engine is not None and configs else None
    if recovered:
        return None
    if recovered is None and held_back:  # no answer from our side: Inductor's own retry still gets its turn
        return wrapped(*args, **kwargs)
    raise failure


PATCH = Patch(__name__, target="torch._inductor.runtime.triton_heuristics.CachingAutotuner._make_launchers",
              modules=("torch._inductor.runtime.triton_heuristics",),
              supported=Supported("torch", (2, 8), (2, 15), label="PyTorch"),
              checked=("2.11.0", "2.13.0", "2.14.0", "2.15.0"),
              observe_safe=True,  # the engine records and re-raises in observe mode
              layers={Layer("torch._inductor.runtime.triton_heuristics", "CachingAutotuner._make_launchers"):
                      wrapt_layer(_load_or_recover)})
