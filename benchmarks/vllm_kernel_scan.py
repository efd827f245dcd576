"""Which of vLLM 0.33's Triton kernels overflow a T4, an L4 or an RTX 5090, and what smemguard does then.

    CUDA_VISIBLE_DEVICES="" python benchmarks/vllm_kernel_scan.py [--gpu T4,L4,RTX5090] [--case NAME ...]
                                                                [--json out.json] [--timeout 1500]

Needs the CUDA vLLM wheel (imported without a GPU) and runs on the CPU harness
(``smemguard.testing.fake_gpu``): each case calls vLLM's own wrapper function, as its attention
backend or layer calls it, with a realistic model shape, and Triton compiles vLLM's real kernel for
the GPU's arch and checks it against the GPU's per-block limit. vLLM's platform object (there is none
on this machine) is made to report the GPU's compute capability and name, which the wrappers read to
choose their tiles. Every case runs in a fresh process, one at a time: first without smemguard (what
the launch needs), then, if it overflowed, with smemguard installed (``SMEMGUARD=on``). The last
lines printed are a Markdown table: kernel, GPU, config, bytes, outcome. For autotuned kernels the
outcome says how many of the autotuner's configs overflowed while Triton's autotuner timed them
(it drops those, so the launch overflows only when every config does).

The autotuned families (``mamba2``, ``gdn_prefill``) compile every config: several minutes each on a
small machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

GPUS = ("T4", "L4", "RTX5090")
DEVICE_NAMES = {"T4": "Tesla T4", "L4": "NVIDIA L4", "RTX5090": "NVIDIA GeForce RTX 5090"}


def half(gpu: str):
    """The 16-bit dtype vLLM runs in on this GPU (Turing has no bf16)."""
    import torch

    return torch.float16 if gpu == "T4" else torch.bfloat16


#: every vLLM module a case calls into, imported before the harness and before the platform pretends to be a
#: CUDA GPU: some decide at import what the driver or the platform has (FLA asks torch.cuda for the device name)
VLLM_MODULES = (
    "vllm.v1.attention.ops.triton_decode_attention", "vllm.v1.attention.ops.triton_prefill_attention",
    "vllm.v1.attention.ops.triton_unified_attention_diffkv", "vllm.v1.attention.ops.triton_turboquant_decode",
    "vllm.v1.attention.ops.triton_turboquant_store", "vllm.model_executor.layers.quantization.turboquant.config",
    "vllm.model_executor.layers.fused_moe.fused_moe", "vllm.model_executor.layers.quantization.utils.fp8_utils",
    "vllm.model_executor.layers.mamba.ops.ssd_combined", "vllm.third_party.flash_linear_attention.ops",
)


def as_cuda_gpu(gpu: str) -> None:
    """vLLM's platform (none here) reporting the GPU's capability and name, as the wrappers ask it when called."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    from smemguard.facts import gpus

    major, minor = divmod(gpus.lookup(gpu).target_arch, 10)
    platform = type(current_platform)
    platform.get_device_capability = classmethod(lambda cls, device_id=0: DeviceCapability(major, minor))
    platform.get_device_name = classmethod(lambda cls, device_id=0: DEVICE_NAMES[gpu])
    platform.is_cuda_alike = lambda self: True
    platform.is_cuda = lambda self: True


# -- the cases: vLLM's wrappers with model shapes -------------------------------------------------


def mla_decode(gpu, heads=16, lk=576, lv=512, batch=2, page=16, seq=256, splits=4):
    """TritonMLA's decode_attention_fwd (the only MLA backend before Hopper)."""
    import torch
    from vllm.v1.attention.ops import triton_decode_attention as module

    dtype, blocks = half(gpu), -(-seq // page)
    q = torch.randn(batch, heads, lk, dtype=dtype)
    cache = torch.randn(batch * blocks, page, 1, lk, dtype=dtype)
    module.decode_attention_fwd(q, cache, cache[..., :lv], torch.empty(batch, heads, lv, dtype=dtype),
                                torch.empty(batch, heads, dtype=dtype),
                                torch.arange(batch * blocks, dtype=torch.int32).reshape(batch, blocks),
                                torch.full((batch,), seq, dtype=torch.int32),
                                torch.empty(batch, heads, splits, lv + 1), splits, lk ** -0.5, page, is_mla=True)


def encoder_attention(gpu, head, dtype_name=None, heads=16, seqs=2, seq_len=256):
    """context_attention_fwd as TRITON_ATTN calls it for encoder-only layers (and the Triton ViT attention)."""
    import torch
    from vllm.v1.attention.ops import triton_prefill_attention as module

    q = torch.randn(seqs * seq_len, heads, head, dtype=getattr(torch, dtype_name) if dtype_name else half(gpu))
    module.context_attention_fwd(q, torch.randn_like(q), torch.randn_like(q), torch.empty_like(q),
                                 torch.arange(0, seqs * seq_len, seq_len, dtype=torch.int32),
                                 torch.full((seqs,), seq_len, dtype=torch.int32), seq_len, is_causal=False)


def diffkv_attention(gpu, query_len, qk=192, vd=128, q_heads=16, kv_heads=1, seqs=2, context=128, block=16,
                     segments=16):
    """unified_attention_diffkv (TRITON_ATTN_DIFFKV, MiMo-V2's K/V head sizes); query_len 1: the 3D decode
    path, 2 to 16: the 3D spec-decode verify path, else the 2D prefill path."""
    import torch
    from vllm.v1.attention.ops import triton_unified_attention_diffkv as module

    dtype, tokens, seq_len = half(gpu), seqs * query_len, context + query_len
    blocks = -(-seq_len // block)
    cache = torch.randn(seqs * blocks, block, kv_heads, qk + vd, dtype=dtype)
    split = {}
    if query_len <= 16:
        split = dict(seq_threshold_3D=1 << 20, num_par_softmax_segments=segments,
                     softmax_segm_output=torch.empty(tokens, q_heads, segments, vd),
                     softmax_segm_max=torch.empty(tokens, q_heads, segments),
                     softmax_segm_expsum=torch.empty(tokens, q_heads, segments))
    module.unified_attention_diffkv(
        torch.randn(tokens, q_heads, qk, dtype=dtype), cache[..., :qk], cache[..., qk:],
        torch.empty(tokens, q_heads, vd, dtype=dtype), torch.arange(0, tokens + 1, query_len, dtype=torch.int32),
        torch.full((seqs,), seq_len, dtype=torch.int32), qk ** -0.5, True, (-1, -1),
        torch.arange(seqs * blocks, dtype=torch.int32).reshape(seqs, blocks), 0.0, max_seqlen_q=query_len, **split)


TQ_PRESETS = ("turboquant_4bit_nc", "turboquant_k8v4")


def turboquant(gpu, what, preset, head=128, batch=2, q_heads=32, kv_heads=8, block=16, seq=128):
    """The TurboQuant KV-cache kernels vLLM runs on NVIDIA (decode stage 1 and 2, store, full dequant)."""
    import torch
    import triton
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
    from vllm.v1.attention.ops import triton_turboquant_decode as decode, triton_turboquant_store as store

    from smemguard.facts import gpus

    e4b15 = int(gpus.lookup(gpu).target_arch < 89)
    decode._FP8_E4B15[0] = e4b15  # vLLM asks torch.cuda for the capability here
    config = TurboQuantConfig.from_cache_dtype(preset, head)
    blocks = -(-seq // block)
    cache = torch.zeros(batch * blocks, block, kv_heads, config.slot_size_aligned, dtype=torch.uint8)
    table = torch.arange(batch * blocks, dtype=torch.int32).reshape(batch, blocks)
    centroids = torch.linspace(-1, 1, 2 ** config.key_mse_bits)
    bits, values = config.key_mse_bits, config.effective_value_quant_bits
    if what == "decode":
        decode.triton_turboquant_decode_attention(
            torch.randn(batch, q_heads, head, dtype=half(gpu)), cache, table,
            torch.full((batch,), seq, dtype=torch.int32),
            torch.eye(head), centroids, head ** -0.5, bits, config.key_packed_size, values, key_fp8=config.key_fp8,
            norm_correction=config.norm_correction)
    elif what == "store":
        tokens = 64
        key = torch.randn(tokens, kv_heads, head, dtype=half(gpu))
        store.triton_turboquant_store(key, torch.randn_like(key), cache, torch.arange(tokens, dtype=torch.int32),
                                      torch.eye(head), (centroids[1:] + centroids[:-1]) / 2, bits,
                                      config.key_packed_size, values, key_fp8=config.key_fp8)
    else:  # the prefill path's full dequant, launched as the TurboQuant backend does
        k = torch.empty(1, kv_heads, seq, head, dtype=torch.float16)
        decode._tq_full_dequant_kv[(seq, kv_heads)](
            cache, table[:1], centroids, k, torch.empty_like(k), *k.stride()[:3], *k.stride()[:3],
            *cache.stride()[:3], table.stride(0), HEAD_DIM=head, BLOCK_SIZE=block, NUM_KV_HEADS=kv_heads,
            MSE_BYTES=math.ceil(head * bits / 8), KPS=config.key_packed_size, VQB=values,
            VAL_DATA_BYTES=math.ceil(head * values / 8), MSE_BITS=bits, KEY_FP8=int(config.key_fp8),
            BLOCK_D=triton.next_power_of_2(head), NORM_CORRECTION=int(config.norm_correction), FP8_E4B15=e4b15,
            num_warps=4)


def moe_wna16(gpu, tokens, n=1536, k=2048, experts=128, top_k=8, group=128):
    """The Triton GPTQ/AWQ MoE kernel (moe_wna16) with vLLM's default config (no tuned file for these GPUs):
    Qwen3-30B-A3B-GPTQ-Int4's gate-up (n=1536, k=2048) or down (n=2048, k=768) projection."""
    import torch
    import triton.language as tl
    from vllm.model_executor.layers.fused_moe import fused_moe as module

    dtype = half(gpu)
    config = module.get_default_config(tokens, experts, n, k, top_k, "int4_w4a16", [0, group])
    block_m = config["BLOCK_SIZE_M"]
    padded = -(-(tokens * top_k + experts * (block_m - 1)) // block_m) * block_m
    module.invoke_fused_moe_wna16_triton_kernel(
        torch.randn(tokens, k, dtype=dtype), torch.zeros(experts, n, k // 2, dtype=torch.uint8),
        torch.empty(tokens, top_k, n, dtype=dtype), torch.ones(experts, n, k // group, dtype=dtype), None,
        torch.rand(tokens, top_k), torch.zeros(padded, dtype=torch.int32),
        torch.zeros(padded // block_m, dtype=torch.int32), torch.tensor([padded], dtype=torch.int32), False, top_k,
        config, tl.float16 if dtype == torch.float16 else tl.bfloat16, False, True, [0, group])


def block_fp8(gpu, m, n, k):
    """w8a8_triton_block_scaled_mm with 128x128 weight blocks (Qwen3-8B-FP8's layers); no tuned file for these GPUs."""
    import torch
    from vllm.model_executor.layers.quantization.utils import fp8_utils

    fp8_utils.w8a8_triton_block_scaled_mm(torch.empty(m, k, dtype=torch.float8_e4m3fn),
                                          torch.empty(n, k, dtype=torch.float8_e4m3fn), torch.ones(m, k // 128),
                                          torch.ones(n // 128, k // 128), [128, 128], torch.bfloat16)


def mamba2(gpu, seqlen=512, heads=8, head_dim=64, state=128, groups=1, chunk=256):
    """mamba_chunk_scan_combined_varlen (Mamba2 / Nemotron-H / Granite-4.0-H prefill): five autotuned kernels."""
    import torch
    from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen

    dtype, chunks = half(gpu), seqlen // chunk
    x = torch.randn(seqlen, heads, head_dim, dtype=dtype)
    b = torch.randn(seqlen, groups, state, dtype=dtype)
    mamba_chunk_scan_combined_varlen(
        x, torch.rand(seqlen, heads, dtype=dtype), -torch.rand(heads), b, torch.randn_like(b), chunk,
        torch.tensor([0, seqlen], dtype=torch.int32), torch.arange(0, seqlen + 1, chunk, dtype=torch.int32),
        torch.tensor([chunks - 1], dtype=torch.int32), torch.zeros(chunks, dtype=torch.int32), torch.empty_like(x),
        D=torch.ones(heads), z=torch.randn_like(x), dt_bias=torch.zeros(heads), dt_softplus=True,
        state_dtype=torch.float32)


def gdn(gpu, what, tokens=256, k_heads=16, v_heads=32, head=128):
    """vLLM's bundled FLA gated-delta-rule ops (Qwen3.5 / Qwen3-Next linear attention): the chunked prefill
    (autotuned), the recurrent and sigmoid-gating decode kernels, and the post-conv prep."""
    import torch
    from vllm.third_party.flash_linear_attention.ops import chunk, fused_gdn_prefill_post_conv, fused_recurrent
    from vllm.third_party.flash_linear_attention.ops import fused_sigmoid_gating

    dtype = half(gpu)
    if what == "prefill":  # q/k heads repeated to the value heads, as vLLM's layer does before the call
        q = torch.randn(1, tokens, v_heads, head, dtype=dtype)
        chunks = tokens // 64
        chunk.chunk_gated_delta_rule(
            q, torch.randn_like(q), torch.randn_like(q), -torch.rand(1, tokens, v_heads),
            torch.rand(1, tokens, v_heads),
            initial_state=torch.zeros(1, v_heads, head, head), output_final_state=True,
            cu_seqlens=torch.tensor([0, tokens], dtype=torch.int32), use_qk_l2norm_in_kernel=True,
            chunk_indices=torch.stack([torch.zeros(chunks, dtype=torch.int32),
                                       torch.arange(chunks, dtype=torch.int32)], 1),
            chunk_offsets=torch.tensor([0, chunks], dtype=torch.int32))
        return
    if what == "post_conv":
        fused_gdn_prefill_post_conv.fused_post_conv_prep(
            torch.randn(tokens, 2 * k_heads * head + v_heads * head, dtype=dtype),
            torch.randn(tokens, v_heads, dtype=dtype),
            torch.randn(tokens, v_heads, dtype=dtype), -torch.rand(v_heads), torch.zeros(v_heads), k_heads, head, head)
        return
    batch = 8
    q = torch.randn(1, batch, k_heads, head, dtype=dtype)
    v = torch.randn(1, batch, v_heads, head, dtype=dtype)
    common = dict(initial_state=torch.zeros(batch, v_heads, head, head, dtype=dtype),
                  cu_seqlens=torch.arange(batch + 1, dtype=torch.int32),
                  ssm_state_indices=torch.arange(batch, dtype=torch.int32), use_qk_l2norm_in_kernel=True)
    if what == "recurrent":
        fused_recurrent.fused_recurrent_gated_delta_rule(q, torch.randn_like(q), v, -torch.rand(1, batch, v_heads),
                                                         torch.rand(1, batch, v_heads), **common)
    else:
        fused_sigmoid_gating.fused_sigmoid_gating_delta_rule_update(
            -torch.rand(v_heads), torch.randn(batch, v_heads, dtype=dtype), torch.randn(batch, v_heads, dtype=dtype),
            torch.zeros(v_heads), q, torch.randn_like(q), v, **common)


#: name -> (kernel, config, GPUs, call)
CASES = {
    "mla_576": ("triton_decode_attention `_fwd_grouped_kernel_stage1`",
                "TritonMLA decode, DeepSeek-V2-Lite / Moonlight (16 heads, Lk 576, Lv 512)", GPUS,
                lambda gpu: mla_decode(gpu)),
    "mla_576_tp2": ("triton_decode_attention `_fwd_grouped_kernel_stage1`", "the same at TP=2 (8 heads)", ("T4",),
                    lambda gpu: mla_decode(gpu, heads=8)),
    "mla_288": ("triton_decode_attention `_fwd_grouped_kernel_stage1`",
                "TritonMLA decode, MiniCPM3-4B (40 heads, Lk 288, Lv 256)", GPUS,
                lambda gpu: mla_decode(gpu, heads=40, lk=288, lv=256)),
    "encoder_64": ("triton_prefill_attention `_fwd_kernel`", "encoder / ViT attention, head 64 (BERT, Whisper)",
                   GPUS, lambda gpu: encoder_attention(gpu, 64)),
    "encoder_80": ("triton_prefill_attention `_fwd_kernel`", "ViT attention, head 80 (Qwen2.5-VL)", GPUS,
                   lambda gpu: encoder_attention(gpu, 80)),
    "encoder_128": ("triton_prefill_attention `_fwd_kernel`", "encoder attention, head 128", GPUS,
                    lambda gpu: encoder_attention(gpu, 128)),
    "encoder_256": ("triton_prefill_attention `_fwd_kernel`", "encoder-only attention, head 256 (EmbeddingGemma)",
                    GPUS, lambda gpu: encoder_attention(gpu, 256)),
    "encoder_256_fp32": ("triton_prefill_attention `_fwd_kernel`", "the same in fp32 (Gemma on Turing)", ("T4",),
                         lambda gpu: encoder_attention(gpu, 256, "float32")),
    "diffkv_prefill": ("triton_unified_attention_diffkv `kernel_unified_attention_diffkv`",
                       "MiMo-V2 (qk 192, v 128, GQA 16) prefill", GPUS, lambda gpu: diffkv_attention(gpu, 64)),
    "diffkv_decode": ("triton_unified_attention_diffkv `kernel_unified_attention_diffkv`",
                      "the same, 3D decode", GPUS, lambda gpu: diffkv_attention(gpu, 1)),
    "diffkv_verify": ("triton_unified_attention_diffkv `kernel_unified_attention_diffkv`",
                      "the same, 3D spec-decode verify of 8 tokens (BLOCK_M 128)", GPUS,
                      lambda gpu: diffkv_attention(gpu, 8)),
    "turboquant_decode": ("triton_turboquant_decode `_tq_decode_stage1` + `_fwd_kernel_stage2`",
                          "Llama-3.1-8B (32/8 heads, D 128), turboquant_4bit_nc and k8v4", GPUS,
                          lambda gpu: [turboquant(gpu, "decode", p) for p in TQ_PRESETS]),
    "turboquant_store": ("triton_turboquant_store `_tq_fused_store_mse` / `_fp8`", "the same", GPUS,
                         lambda gpu: [turboquant(gpu, "store", p) for p in TQ_PRESETS]),
    "turboquant_dequant": ("triton_turboquant_decode `_tq_full_dequant_kv`", "the same", GPUS,
                           lambda gpu: [turboquant(gpu, "dequant", p) for p in TQ_PRESETS]),
    "moe_wna16": ("fused_moe `fused_moe_kernel_gptq_awq`",
                  "Qwen3-30B-A3B-GPTQ-Int4, default config, 256 and 4096 tokens, gate-up and down", GPUS,
                  lambda gpu: [moe_wna16(gpu, m, n, k) for m in (256, 4096) for n, k in ((1536, 2048), (2048, 768))]),
    "block_fp8": ("fp8_utils `_w8a8_triton_block_scaled_mm`",
                  "Qwen3-8B-FP8 qkv (M 256) and down (M 4096) projections, default config", ("L4", "RTX5090"),
                  lambda gpu: [block_fp8(gpu, 256, 6144, 4096), block_fp8(gpu, 4096, 4096, 12288)]),
    "gdn_recurrent": ("FLA `fused_recurrent_gated_delta_rule_fwd_kernel`", "Qwen3.5 GDN decode (16/32 heads, 128)",
                      GPUS, lambda gpu: gdn(gpu, "recurrent")),
    "gdn_sigmoid": ("FLA `fused_sigmoid_gating_delta_rule_update_kernel`", "the same", GPUS,
                    lambda gpu: gdn(gpu, "sigmoid")),
    "gdn_post_conv": ("FLA `_fused_post_conv_kernel`", "Qwen3.5 GDN prefill prep, 256 tokens", GPUS,
                      lambda gpu: gdn(gpu, "post_conv")),
    "gdn_prefill": ("FLA `chunk_gated_delta_rule` (6 autotuned kernels)", "Qwen3.5 GDN prefill, 256 tokens", GPUS,
                    lambda gpu: gdn(gpu, "prefill")),
    "mamba2": ("mamba `ssd_combined` (5 autotuned kernels)", "Mamba2 prefill (head dim 64, state 128, chunk 256)",
               GPUS, lambda gpu: mamba2(gpu)),
}


# -- one case in this process ------------------------------------------------------------------


def autotuned() -> list[str]:
    """For each autotuner that timed its configs: how many overflowed (Triton times those as infinite)."""
    import gc

    from triton.runtime.autotuner import Autotuner

    found = []
    for tuner in gc.get_objects():
        timings = getattr(tuner, "configs_timings", None) if isinstance(tuner, Autotuner) else None
        if timings:
            overflowing = sum(not math.isfinite(t[0] if isinstance(t, (list, tuple)) else t) for t in timings.values())
            found.append(f"{tuner.base_fn.__name__} {overflowing}/{len(timings)}")
    return sorted(found)


def run_case(name: str, gpu: str, mode: str) -> dict:
    from triton.runtime.errors import OutOfResources

    import smemguard
    from smemguard.facts.settings import Settings
    from smemguard.testing import fake_gpu

    import importlib

    for module in VLLM_MODULES:
        importlib.import_module(module)
    as_cuda_gpu(gpu)
    call = CASES[name][3]
    with tempfile.TemporaryDirectory(prefix="smemguard-scan-") as scratch:
        log = Path(scratch) / "incidents.jsonl"
        if mode == "on":
            smemguard.install(Settings(mode="on", log_path=log, cache_dir=Path(scratch)))
        result = {"case": name, "gpu": gpu, "mode": mode}
        started = time.perf_counter()
        with fake_gpu(gpu, cache_dir=os.environ.get("SCAN_TRITON_CACHE")) as device:
            try:
                call(gpu)
                result["fits"] = True
            except OutOfResources as error:
                result.update(fits=False, required=error.required, limit=error.limit)
            result["launches"] = [[launch.kernel, launch.shared, launch.num_stages] for launch in device.launches]
            result["limit"] = device.max_shared
        result["seconds"] = round(time.perf_counter() - started, 1)
        result["autotuned"] = autotuned()
        result["records"] = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return result


# -- the driver --------------------------------------------------------------------------------


def in_a_fresh_process(name: str, gpu: str, mode: str, timeout: int) -> dict:
    command = [sys.executable, __file__, "--one", name, gpu, mode]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"case": name, "gpu": gpu, "mode": mode, "error": f"timed out after {timeout} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"case": name, "gpu": gpu, "mode": mode, "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(lines[-1])


def outcome(plain: dict, on: dict | None) -> tuple[str, str]:
    """(bytes, outcome) for the table."""
    if "error" in plain:
        return "", f"not run: {plain['error']}"
    tuned = "; autotuned, configs overflowing: " + ", ".join(plain["autotuned"]) if plain["autotuned"] else ""
    if plain["fits"]:
        return f"{max(shared for _, shared, _ in plain['launches'])}", "fits" + tuned
    required = f"{plain['required']} > {plain['limit']}"
    if on is None or "error" in on:
        return required, f"overflows; with smemguard: not run ({(on or {}).get('error')})"
    actions = [(record["action"], record.get("final")) for record in on["records"]]
    if on["fits"]:
        final = next((f"{action} to {final}" for action, final in reversed(actions) if final), "recovered")
        shared = max((shared for _, shared, _ in on["launches"]), default=0)
        return required, f"recovered by smemguard: {final} ({shared} B)"
    reasons = [record.get("reason", "") for record in on["records"] if record["action"] == "reraised"]
    return required, "re-raised by smemguard" + (f": {reasons[-1].split(';')[0]}" if reasons else "")


def main(argv=None) -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--gpu", default=",".join(GPUS), help="GPUs from 'smemguard gpus' (default: T4,L4,RTX5090)")
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="only these cases (repeatable)")
    parser.add_argument("--timeout", type=int, default=1500, help="seconds per case and mode (default: 1500)")
    parser.add_argument("--one", nargs=3, metavar=("CASE", "GPU", "MODE"), help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.one:
        print(json.dumps(run_case(*options.one), default=str))
        return 0

    wanted = options.gpu.split(",")
    rows, results = [], []
    cache = tempfile.TemporaryDirectory(prefix="smemguard-scan-triton-")  # shared by a case's two runs
    os.environ["SCAN_TRITON_CACHE"] = cache.name
    for name in options.case or CASES:
        kernel, config, gpus, _ = CASES[name]
        for gpu in (g for g in wanted if g in gpus):
            print(f"{name} on {gpu} ...", file=sys.stderr, flush=True)
            plain = in_a_fresh_process(name, gpu, "plain", options.timeout)
            on = in_a_fresh_process(name, gpu, "on", options.timeout) if plain.get("fits") is False else None
            results += [result for result in (plain, on) if result]
            rows.append((kernel, gpu, config, *outcome(plain, on)))
    print(harness.headline(harness.write(options.json, results, "vllm")))
    print("| kernel | GPU | config | bytes | outcome |\n|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
