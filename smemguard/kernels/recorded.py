"""What an incident record says of the launch behind it: the arguments by shape, stride, dtype and alignment, the
constexprs, the specialization, the grid and the config, so that ``smemguard replay`` can rebuild it and an
operator sees the shapes that failed (docs/INCIDENTS.md, "Fields by phase").

Every writer takes them from here, whichever path decided: the launch guard from the launch it resolved
(:func:`launch_fields`), the compile-time core from the launch that caused the compile (:func:`in_progress`: the
launch seam notes the launch in progress on its thread, ``facts.process.launching``, and an autotuner's benchmark
the config it times), a wrapper that chose its tiles again from the launch that failed (the launch guard's note).
A compile no launch caused (a warm-up, Inductor's precompile, ``smemguard check``) records what it was given
(:func:`compile_fields`: Triton's signature, the specialization, the constexprs), from which replay compiles the
same variant.
"""

from __future__ import annotations

from typing import Any

from ..facts import process
from ..facts.install import Notes
from . import introspect
from .launch import Launch, describe, resolve


def describe_arg(value) -> Any:
    """A kernel argument as the record keeps it: tensors by shape, stride, dtype and alignment; a warm-up's
    placeholder (a dtype, Triton's ``MockTensor``) as text, since it has no shape to rebuild."""
    if type(value).__name__ == "MockTensor":
        return f"a placeholder for a {value.dtype} tensor"
    if hasattr(value, "data_ptr") and hasattr(value, "shape"):
        return {"shape": list(value.shape), "stride": list(value.stride()), "dtype": str(value.dtype),
                "ptr_mod_16": value.data_ptr() % 16}
    if hasattr(value, "base") and hasattr(value, "block_shape"):  # TMA tensor descriptor
        return {"descriptor": True, "base": describe_arg(value.base), "shape": [int(s) for s in value.shape],
                "strides": [int(s) for s in value.strides], "block_shape": list(value.block_shape)}
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return str(value)


def specialization(jit, named: dict) -> dict:
    """What Triton specializes on, per int or pointer argument: ``"==1"``, ``"div16"`` or ``""``."""
    spec = {}
    for param in jit.params:
        value = named.get(param.name)
        if param.is_constexpr or getattr(param, "do_not_specialize", False) or isinstance(value, bool):
            continue
        if isinstance(value, int):
            spec[param.name] = "==1" if value == 1 else ("div16" if value % 16 == 0 else "")
        elif hasattr(value, "data_ptr"):
            spec[param.name] = "div16" if value.data_ptr() % 16 == 0 else ""
    return spec


def evaluate_grid(grid, named: dict):
    """The launch grid as a list, evaluated the way Triton does for a grid function."""
    try:
        return list(grid(named) if callable(grid) else grid)
    except Exception:
        return str(grid)


def described_args(launch: Launch) -> dict:
    """The kernel's non-constexpr arguments as the record keeps them."""
    constexprs = launch.constexpr_names()
    return {k: describe_arg(v) for k, v in launch.named_args().items() if k not in constexprs}


def launch_fields(launch: Launch, failing, described: dict | None = None) -> dict:
    """The record's fields of ``launch`` whose compiled kernel ``failing`` did not fit; ``described``: the
    arguments as :func:`described_args` saw them at the failure, if taken then (a tuner's pre-hook may rewrite
    them since)."""
    code = launch.jit.fn.__code__
    named = launch.named_args()
    constexprs = launch.constexpr_names()
    return {
        "source": f"{code.co_filename}:{code.co_firstlineno}",
        "source_hash": introspect.source_hash(launch.jit),
        "constexprs": {k: describe_arg(v) for k, v in named.items() if k in constexprs},
        "num_warps": failing.metadata.num_warps,
        "num_stages": failing.metadata.num_stages,
        "config": describe(launch, failing),
        "grid": evaluate_grid(launch.grid, named),
        "args": described if described is not None else described_args(launch),
        "specialization": specialization(launch.jit, named),
        "autotune_key": list(launch.tuning_key) if launch.tuning_key is not None else None,
    }


def attempt_records(attempts) -> list[dict]:
    """The attempts as records keep them: the failing configuration in full, then for each
    candidate only what it changed (``changes``), so a kernel with 40 constexprs stays readable."""
    if not attempts:
        return []
    failing = attempts[0].config
    return [vars(attempts[0])] + [{**{k: v for k, v in vars(a).items() if k != "config"},
                                   "changes": introspect.changes(failing, a.config)} for a in attempts[1:]]


def in_progress(jit) -> tuple[Launch | None, bool]:
    """(the launch running on this thread that compiles ``jit``, whether it is a warm-up), resolved with the config
    an autotuner is timing in force; (None, False) when no launch of ``jit`` caused the compile. Never raises: a
    launch that cannot be resolved leaves the record with what the compile was given."""
    current = process.launch_in_progress()
    if current is None:
        return None, False
    launched, grid, args, kwargs, warmup = current
    try:
        if not any(layer is jit for layer in introspect.chain(launched)):
            return None, False
        timed = process.benchmarking.value  # a triton.Config inside Autotuner._bench
        return resolve(launched, grid, args, kwargs, config=timed if hasattr(timed, "all_kwargs") else None), warmup
    except Exception:
        return None, False


def failed_launch_fields(error, notes: Notes) -> dict:
    """The record's fields of the launch that raised ``error``, as the launch guard noted it in ``notes`` (the
    install's :class:`~smemguard.facts.install.Notes`), for a wrapper that chose its tiles again; {} for an error no
    guarded launch raised. The failing kernel is the one in the JIT cache (looked up, not compiled again)."""
    noted = notes.failed_launch(error)
    if noted is None:
        return {}
    launched, grid, args, kwargs = noted
    launch = resolve(launched, grid, args, kwargs)
    if launch is None:
        return {}
    failing = notes.failing_kernel(error)  # as the engine compiled it when the launch failed
    if failing is None:
        with process.engine_compiling.scope():  # the variant that failed, from the JIT cache: never fitted here
            failing = launch.compile()
    return launch_fields(launch, failing)


def compile_fields(source, num_warps: int, num_stages: int) -> dict:
    """The record's fields of a compile of ``source`` (Triton's ``ASTSource``) with ``num_warps`` and ``num_stages``
    that did not fit, from what the compile was given: Triton's signature (a type per parameter), the constexprs,
    the specialization (``"div16"``, ``"==1"`` or ``""`` per int or pointer parameter) and the config."""
    jit = source.fn
    names = jit.arg_names
    constants = {names[path[0]]: value for path, value in source.constants.items()
                 if len(path) == 1 and path[0] < len(names)}
    is_constexpr = {param.name: param.is_constexpr for param in jit.params}
    spec = {}
    for index, name in enumerate(names):
        kind = source.signature.get(name)
        if is_constexpr.get(name):
            continue
        if name in constants:  # Triton folded it into the kernel (an int equal to 1)
            if constants[name] == 1 and not isinstance(constants[name], bool):
                spec[name] = "==1"
        elif isinstance(kind, str) and (kind.startswith("*") or kind[:1] in ("i", "u")):
            spec[name] = "div16" if _divisible_by_16(source.attrs.get((index,))) else ""
    code = jit.fn.__code__
    constexprs = {name: describe_arg(value) for name, value in constants.items() if is_constexpr.get(name)}
    config = [f"{name}={value}" for name, value in constexprs.items()
              if isinstance(value, (int, str, bool)) and name not in introspect.CONFIG_OPTIONS]
    return {
        "source": f"{code.co_filename}:{code.co_firstlineno}",
        "source_hash": introspect.source_hash(jit),
        "signature": {name: kind if isinstance(kind, str) else str(kind) for name, kind in source.signature.items()},
        "constexprs": constexprs,
        "specialization": spec,
        "num_warps": num_warps,
        "num_stages": num_stages,
        "config": " ".join([*config, f"num_warps={num_warps}", f"num_stages={num_stages}"]),
    }


def _divisible_by_16(attributes) -> bool:
    """Whether Triton's attributes of one parameter (``[["tt.divisibility", 16]]``) say it is a multiple of 16."""
    return any(isinstance(pair, (list, tuple)) and len(pair) == 2 and pair[0] == "tt.divisibility" and pair[1] == 16
               for pair in attributes or ())
