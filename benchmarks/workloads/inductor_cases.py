"""One case of ``benchmarks/inductor_matrix.py`` in a fresh process: ``python inductor_cases.py CASE RESULT_JSON``.

The parent gives this process its environment (fresh Inductor and Triton caches, the ``SMEMGUARD*`` settings);
``case["smemguard"]`` says whether to ``import smemguard; smemguard.install()`` before anything compiles.
Workloads, each ``torch.compile``d, forward then backward:

- ``flex``: ``flex_attention(q, k, v)`` against SDPA;
- ``rmsnorm`` / ``layernorm`` over the last dimension: rows >= 2 x columns, so Inductor fuses the backward's
  row and column reductions into one persistent "mix-order" reduction (``triton_per_*`` with ``RSPLIT_SIZE``
  and ``NUM_STAGES``), the kind of kernel of pytorch #175250;
- ``mlp``: a healthy MLP + layer norm + softmax (no numerics checked).

Correctness is FlexAttention's own test rule (test/inductor/test_flex_attention.py, ``_check_out_and_grad``):
the compiled result's mean absolute error against an fp64 eager ("golden") result may be at most ``fudge``
times the error of the same eager computation in the case's dtype; fudge 1.1 for fp16/bf16, 10 for fp32.

Writes one JSON object: phases (seconds), the first exception (type, first line, Required/limit parsed),
numerics, the FlexAttention configs Inductor's heuristic returned, and every Inductor kernel this process
loaded or failed to load with its shared memory.
"""

from __future__ import annotations

import gc
import json
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
OUT_OF_RESOURCE = re.compile(r"Required: ?(\d+),? Hardware limit: ?(\d+)")
ERROR_CHARS = 400
WARMUP_STEPS = 5  # untimed steady steps before the timed ones (allocator, clocks); they size the blocks
BLOCK_S = 0.2  # a timed block runs back-to-back steps for about this long, synchronized at its ends only


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(device: str, step) -> tuple[float, object]:
    _sync(device)
    started = time.perf_counter()
    value = step()
    _sync(device)
    return time.perf_counter() - started, value


def _describe(error: BaseException, phase: str) -> dict:
    text = f"{type(error).__name__}: {error}"
    lines = [line for line in text.splitlines() if line.strip()]
    described = {"phase": phase, "type": type(error).__name__, "line": (lines[0] if lines else text)[:ERROR_CHARS],
                 "traceback_tail": "".join(traceback.format_exception(error))[-2000:]}
    if (match := OUT_OF_RESOURCE.search(text)) is not None:
        described["required"], described["hardware_limit"] = int(match[1]), int(match[2])
    return described


def _close_enough(golden: torch.Tensor, ref: torch.Tensor, compiled: torch.Tensor, fudge: float) -> dict:
    compiled_error = (golden - compiled.double()).abs().mean().item()
    ref_error = (golden - ref.double()).abs().mean().item()
    ok = compiled_error == compiled_error and compiled_error <= ref_error * fudge  # NaN fails
    return {"ok": ok, "compiled_error": compiled_error, "ref_error": ref_error}


def _fudge(dtype: torch.dtype) -> float:
    return 10.0 if dtype == torch.float32 else 1.1


def _leaves(case: dict, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    return [torch.randn(shape, dtype=DTYPES[case["dtype"]], device=case["device"], requires_grad=case["backward"])
            for shape in shapes]


def _eager(fn, inputs: list[torch.Tensor], dtype, cotangent: torch.Tensor, backward: bool) -> list[torch.Tensor]:
    """``fn``'s output, then the gradients of ``(output * cotangent).sum()`` with ``backward``, computed in
    ``dtype``."""
    inputs = [t.detach().to(dtype).requires_grad_(backward) for t in inputs]
    out = fn(*inputs)
    if backward:
        (out * cotangent.to(out.dtype)).sum().backward()
    return [out.detach()] + [t.grad for t in inputs if backward]


def _steady_ms(device: str, step, blocks: int) -> float:
    """Milliseconds per step, the median over ``blocks`` blocks of back-to-back steps (a training loop's
    throughput; a step of about a millisecond is mostly host work, which a per-step sync would distort)."""
    warmup_s, _ = _timed(device, lambda: [step() for _ in range(WARMUP_STEPS)])
    steps = max(1, round(BLOCK_S * WARMUP_STEPS / warmup_s))
    return statistics.median(_timed(device, lambda: [step() for _ in range(steps)])[0] * 1000 / steps
                             for _ in range(blocks))


def _run(case: dict, fn, inputs: list[torch.Tensor], cotangent: torch.Tensor, result: dict, reference=None) -> None:
    """Compile and run ``fn`` forward (then backward, unless the case says not), time it, and check it against
    ``reference`` (eager; default ``fn``) unless the workload is the unchecked MLP."""
    device, blocks, backward = case["device"], case["blocks"], case["backward"]
    compiled = torch.compile(fn)

    def step():
        for t in inputs:
            t.grad = None
        out = compiled(*inputs)
        if backward:
            (out * cotangent).sum().backward()

    phase = "forward"
    try:
        result["forward_s"], out = _timed(device, lambda: compiled(*inputs))
        if backward:
            phase = "backward"
            result["backward_s"], _ = _timed(device, lambda: (out * cotangent).sum().backward())
        first = [out.detach()] + [t.grad.clone() for t in inputs if backward]
        phase = "steady"
        result["run_ms"] = _steady_ms(device, step, blocks)
        phase = "numerics"
        if case["workload"] != "mlp":
            dtype = inputs[0].dtype
            golden = _eager(reference or fn, inputs, torch.float64, cotangent, backward)
            ref = _eager(reference or fn, inputs, dtype, cotangent, backward)
            names = ["out"] + [f"grad{i}" for i in range(len(inputs))]
            checks = {name: _close_enough(g, r, c, _fudge(dtype)) for name, g, r, c in zip(names, golden, ref, first)}
            result["numerics"] = checks
            result["outcome"] = "ok" if all(check["ok"] for check in checks.values()) else "wrong"
        else:
            result["outcome"] = "ok"
    except Exception as error:  # the case's answer: the user's program would have died here
        result["outcome"], result["error"] = "fail", _describe(error, phase)


def _flex(case: dict, result: dict) -> None:
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = _leaves(case, [case["shape"]] * 3)
    cotangent = torch.randn_like(q)
    # No mask and no score_mod: the same attention as SDPA, which is the reference.
    _run(case, flex_attention, [q, k, v], cotangent, result, reference=F.scaled_dot_product_attention)


def _norm(case: dict, result: dict) -> None:
    from torch._inductor import config

    # Pipelined mix-order reductions (NUM_STAGES > 1), torch 2.13's default. torch 2.11 keeps them at one stage
    # unless asked, where they need 32 B (fp32) to 8192 B (bf16) on the H200 and overflow nothing.
    result["mix_order_multi_stages"] = hasattr(config.triton, "mix_order_reduction_allow_multi_stages")
    if result["mix_order_multi_stages"]:
        config.triton.mix_order_reduction_allow_multi_stages = True
    rows, cols = case["shape"]
    x, weight, bias = _leaves(case, [(rows, cols), (cols,), (cols,)])
    cotangent = torch.randn_like(x)
    if case["workload"] == "rmsnorm":
        _run(case, lambda x, w: F.rms_norm(x, (cols,), w, 1e-6), [x, weight], cotangent, result)
    else:
        _run(case, lambda x, w, b: F.layer_norm(x, (cols,), w, b, 1e-5), [x, weight, bias], cotangent, result)


def _mlp(case: dict, result: dict) -> None:
    rows, width = case["shape"]
    x, w1, w2, gamma = _leaves(case, [(rows, width), (4 * width, width), (width, 4 * width), (width,)])
    cotangent = torch.randn_like(x)

    def mlp(x, w1, w2, gamma):
        hidden = F.linear(F.gelu(F.linear(x, w1)), w2)
        return torch.softmax(F.layer_norm(hidden, (width,), gamma), dim=-1)

    _run(case, mlp, [x, w1, w2, gamma], cotangent, result)


WORKLOADS = {"flex": _flex, "rmsnorm": _norm, "layernorm": _norm, "mlp": _mlp}


def _flex_configs_recorded(capability: tuple[int, int] | None) -> dict:
    """Record what Inductor's FlexAttention heuristic returns; with ``capability``, make only that heuristic
    see it (Triton still compiles for the real GPU). Applied before smemguard installs, so that anything
    smemguard puts around the same methods sits outside and sees the real device."""
    try:
        from torch._inductor.template_heuristics import triton as heuristics
    except ImportError:  # torch 2.8: one module
        from torch._inductor import template_heuristics as heuristics
    seen: dict[str, list[str]] = {}
    for name in ("get_flex_attn_fwd_configs", "get_flex_attn_bwd_configs"):
        original = getattr(heuristics.CUDAConfigHeuristic, name)

        def recorded(self, *args, _original=original, _name=name, **kwargs):
            real = torch.cuda.get_device_capability
            if capability is not None:
                torch.cuda.get_device_capability = lambda device=None: capability
            try:
                configs = _original(self, *args, **kwargs)
            finally:
                torch.cuda.get_device_capability = real
            seen.setdefault(_name, []).extend(str(config) for config in configs)
            return configs

        setattr(heuristics.CUDAConfigHeuristic, name, recorded)
    return seen


def _shared_of(result) -> int | None:
    kernel = getattr(result, "kernel", None)
    metadata = getattr(kernel, "metadata", None)
    return getattr(metadata, "shared", None) if metadata is not None else getattr(kernel, "shared", None)


def _config_text(config) -> str:
    options = " ".join(f"{key}={getattr(config, key)}" for key in ("num_warps", "num_stages") if hasattr(config, key))
    return " ".join([*(f"{key}={value}" for key, value in getattr(config, "kwargs", {}).items()), options])


def _inductor_kernels() -> list[dict]:
    """Every Inductor kernel alive in this process (a CachingAutotuner; the same kernel may have several), once:
    the configs it loaded with their shared memory, or, when none loaded, each config it compiled."""
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except ImportError:
        return []
    loaded, compiled = {}, {}
    # type(), not isinstance(): a dead weakref.proxy among the objects raises on __class__.
    for tuner in [obj for obj in gc.get_objects() if issubclass(type(obj), CachingAutotuner)]:
        name = tuner.inductor_meta.get("kernel_name") or getattr(tuner.fn, "__name__", "?")
        kernel = name, getattr(tuner.fn, "src", None)  # the forward and backward graphs may reuse a name
        for launcher in tuner.launchers:
            loaded[kernel, _config_text(launcher.config)] = getattr(launcher, "shared", None)
        for result in tuner.compile_results:
            compiled[kernel, _config_text(result.config)] = _shared_of(result)
    kernels_loaded = {kernel for kernel, _ in loaded}
    kernels = [{"kernel": kernel[0], "config": config, "loaded": True, "shared": shared}
               for (kernel, config), shared in loaded.items()]
    kernels += [{"kernel": kernel[0], "config": config, "loaded": False, "shared": shared}
                for (kernel, config), shared in compiled.items() if kernel not in kernels_loaded]
    return sorted(kernels, key=lambda kernel: -(kernel["shared"] or 0))


def _versions(case: dict) -> dict:
    versions = {"torch": torch.__version__, "python": sys.version.split()[0]}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = None
    if case["device"] == "cuda":
        versions["gpu"] = torch.cuda.get_device_name(0)
        versions["capability"] = list(torch.cuda.get_device_capability(0))
    return versions


def run_case(case: dict) -> dict:
    result: dict = {"versions": _versions(case)}
    if case["workload"] == "flex" and case["device"] == "cuda":
        result["flex_configs"] = _flex_configs_recorded((8, 0) if case.get("choice") == "sm8x" else None)
    if case["smemguard"]:
        import smemguard
        from smemguard.facts import settings

        smemguard.install()
        result["smemguard"] = {"version": smemguard.__version__, "installed": smemguard.is_installed(),
                               "mode": settings.current().mode, "limit_bytes": settings.current().max_shared}
    torch.manual_seed(0)
    WORKLOADS[case["workload"]](case, result)
    result["kernels"] = _inductor_kernels()
    return result


def main(argv: list[str]) -> int:
    case, out = json.loads(argv[1]), Path(argv[2])
    out.write_text(json.dumps(run_case(case), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
