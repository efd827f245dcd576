"""The vLLM kernel pack's recoveries, checked against torch on a CUDA GPU without vLLM installed.

    python benchmarks/vllm_pack_numerics.py VLLM_SOURCE [--limit T4] [--vllm-version 0.33.0]

VLLM_SOURCE is a folder holding these files of a vLLM release, at their paths in the wheel
(copied there at run time; nothing of vLLM is part of this repository):

    vllm/v1/attention/ops/triton_unified_attention.py
    vllm/v1/attention/ops/triton_attention_helpers.py
    vllm/v1/attention/ops/prefix_prefill.py
    vllm/v1/attention/ops/triton_prefill_attention.py
    vllm/model_executor/layers/fused_moe/fused_moe.py

The attention files are imported as the modules vLLM names them, over a few stand-ins for
the vLLM modules they import (its platform, logger, environment, ``triton_utils`` and
``KVQuantMode``), so smemguard's patches apply to them as in vLLM; only the ``@triton.jit``
functions of ``fused_moe.py`` are loaded. Every case runs with smemguard installed under
``SMEMGUARD_MAX_SHARED=--limit`` (default T4, 65536 B), once with the emulated limit, and its
output is compared with a torch reference in float32. A case whose kernel fits the emulated
limit on this GPU's arch (shared memory depends on the arch) says so: lower ``--limit`` to make
it overflow. The last lines printed are the table.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import sys
import tempfile
import types
from pathlib import Path

import harness

FILES = {
    "vllm.v1.attention.ops.triton_attention_helpers": "vllm/v1/attention/ops/triton_attention_helpers.py",
    "vllm.v1.attention.ops.triton_unified_attention": "vllm/v1/attention/ops/triton_unified_attention.py",
    "vllm.v1.attention.ops.prefix_prefill": "vllm/v1/attention/ops/prefix_prefill.py",
    "vllm.v1.attention.ops.triton_prefill_attention": "vllm/v1/attention/ops/triton_prefill_attention.py",
    "fused_moe": "vllm/model_executor/layers/fused_moe/fused_moe.py",
}


def parse_args(argv):
    parser = harness.parser(__doc__)
    parser.add_argument("source", type=Path, help="folder with vLLM's files at their wheel paths (see below)")
    parser.add_argument("--limit", default="T4", help="SMEMGUARD_MAX_SHARED for every case (default: T4)")
    parser.add_argument("--vllm-version", default="0.33.0", help="the release the files come from (default: 0.33.0)")
    return parser.parse_args(argv)


def missing_files(source: Path) -> list[str]:
    return [relative for relative in FILES.values() if not (source / relative).is_file()]


# -- stand-ins for the vLLM modules the attention files import ----------------------------------


def install_stand_ins(version: str) -> None:
    import enum
    import logging

    import torch
    import triton
    import triton.language as tl

    def module(name: str, package: bool = False, **attributes):
        made = types.ModuleType(name)
        if package:
            made.__path__ = []
        made.__dict__.update(attributes)
        sys.modules[name] = made
        return made

    class Platform:
        """What the attention files ask vLLM's current_platform, answered from torch."""

        @staticmethod
        def get_device_capability():
            return torch.cuda.get_device_capability()

        def has_device_capability(self, capability: int) -> bool:
            major, minor = self.get_device_capability()
            return major * 10 + minor >= capability

        def is_device_capability_family(self, family: int) -> bool:
            return self.get_device_capability()[0] * 10 == family

        @staticmethod
        def is_rocm() -> bool:
            return torch.version.hip is not None

        @staticmethod
        def is_cuda_alike() -> bool:
            return True

        @staticmethod
        def fp8_dtype():
            return torch.float8_e4m3fn

    class KVQuantMode(enum.IntEnum):  # the values the attention wrapper compares against
        NONE = 0
        FP8_PER_TENSOR = 1
        INT8_PER_TOKEN_HEAD = 2
        FP8_PER_TOKEN_HEAD = 3
        INT4_PER_TOKEN_HEAD = 4

    class Logger(logging.LoggerAdapter):
        def debug_once(self, message, *args):
            self.debug(message, *args)

        warning_once = info_once = debug_once

    module("vllm", package=True, __version__=version)
    module("vllm.envs", VLLM_BATCH_INVARIANT=False)
    module("vllm.logger", init_logger=lambda name: Logger(logging.getLogger(name), {}))
    module("vllm.platforms", current_platform=Platform())
    module("vllm.triton_utils", tl=tl, triton=triton)
    for package in ("vllm.v1", "vllm.v1.attention", "vllm.v1.attention.ops"):
        module(package, package=True)
    module("vllm.v1.kv_cache_interface", KVQuantMode=KVQuantMode)
    module("vllm.utils", package=True)
    module("vllm.utils.math_utils", RCP_LN2=1 / math.log(2))


def import_file(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[name] = loaded
    spec.loader.exec_module(loaded)
    return loaded


def jit_functions_of(path: Path, folder: Path):
    """A module with only the ``@triton.jit`` functions of ``path`` (written to ``folder``: Triton reads sources)."""
    tree = ast.parse(path.read_text())
    kept = [node for node in tree.body if isinstance(node, ast.FunctionDef)
            and any("jit" in ast.unparse(decorator) for decorator in node.decorator_list)]
    text = "import torch\nimport triton\nimport triton.language as tl\n\n" + "\n\n".join(
        ast.unparse(node) for node in kept)
    target = folder / "vllm_fused_moe_kernels.py"
    target.write_text(text)
    return import_file("vllm_fused_moe_kernels", target)


# -- the cases -----------------------------------------------------------------------------------


def reference_attention(q, k, v, causal_offset, window=0):
    """softmax(q k^T / sqrt(d)) v per head in float32, causal with the query block at the end of the keys."""
    import torch

    d = q.shape[-1]
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) / d ** 0.5
    rows = torch.arange(q.shape[0], device=q.device)[:, None] + causal_offset
    cols = torch.arange(k.shape[0], device=q.device)[None, :]
    masked = cols > rows
    if window:
        masked |= rows - cols >= window
    scores = scores.masked_fill(masked, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float())


def case_unified_attention(module, head_size, dtype, decode=False, window=-1):
    """vLLM's unified_attention on one sequence; returns (max abs error vs torch, output scale)."""
    import torch

    query_len, context, block, heads = (1 if decode else 64), 192, 16, 4
    seq_len = context + query_len
    blocks = -(-seq_len // block)
    q = torch.randn(query_len, heads, head_size, dtype=dtype, device="cuda")
    keys = torch.randn(blocks * block, 1, head_size, dtype=dtype, device="cuda")
    values = torch.randn_like(keys)
    k_cache, v_cache = keys.view(blocks, block, 1, head_size), values.view(blocks, block, 1, head_size)
    out = torch.empty_like(q)
    split = {}
    if decode:
        segments, padded = 16, 1 << (head_size - 1).bit_length()
        split = dict(seq_threshold_3D=1 << 20, num_par_softmax_segments=segments,
                     softmax_segm_output=torch.empty(query_len, heads, segments, padded, device="cuda"),
                     softmax_segm_max=torch.empty(query_len, heads, segments, device="cuda"),
                     softmax_segm_expsum=torch.empty(query_len, heads, segments, device="cuda"))
    module.unified_attention(q, k_cache, v_cache, out, torch.tensor([0, query_len], dtype=torch.int32, device="cuda"),
                             query_len, torch.tensor([seq_len], dtype=torch.int32, device="cuda"), seq_len,
                             head_size ** -0.5, True, (window, -1),
                             torch.arange(blocks, dtype=torch.int32, device="cuda")[None], 0, None, None, None, **split)
    torch.cuda.synchronize()
    expected = reference_attention(q, keys[:seq_len].expand(-1, heads, -1), values[:seq_len].expand(-1, heads, -1),
                                   context, window + 1 if window >= 0 else 0)
    return (out.float() - expected).abs().max().item(), expected.abs().max().item()


def case_prefix_prefill(module, head_size, dtype):
    """vLLM's context_attention_fwd on one sequence: a cached context, then new tokens."""
    import torch

    query_len, context, block, heads = 200, 64, 16, 4
    x = 16 // torch.empty((), dtype=dtype).element_size()
    blocks = -(-(context + query_len) // block)
    keys = torch.randn(blocks * block, heads, head_size, dtype=dtype, device="cuda")
    values = torch.randn_like(keys)
    k_cache = keys.view(blocks, block, heads, head_size // x, x).permute(0, 2, 3, 1, 4).contiguous()
    v_cache = values.view(blocks, block, heads, head_size).permute(0, 2, 3, 1).contiguous()
    q = torch.randn(query_len, heads, head_size, dtype=dtype, device="cuda")
    new_keys, new_values = keys[context:context + query_len], values[context:context + query_len]
    out = torch.empty_like(q)
    one = torch.ones(1, device="cuda")
    module.context_attention_fwd(q, new_keys.contiguous(), new_values.contiguous(), out, "auto", k_cache, v_cache,
                                 torch.arange(blocks, dtype=torch.int32, device="cuda")[None],
                                 torch.tensor([0, query_len], dtype=torch.int32, device="cuda"),
                                 torch.tensor([context + query_len], dtype=torch.int32, device="cuda"),
                                 context + query_len, query_len, one, one)
    torch.cuda.synchronize()
    expected = reference_attention(q, keys[:context + query_len], values[:context + query_len], context)
    return (out.float() - expected).abs().max().item(), expected.abs().max().item()


def case_encoder_attention(module, head_size, dtype, seq_len=300):
    """vLLM's Triton prefill attention as the Triton backend runs an encoder-only layer: bidirectional."""
    import torch

    heads = 4
    q, k, v = (torch.randn(seq_len, heads, head_size, dtype=dtype, device="cuda") for _ in range(3))
    out = torch.empty_like(q)
    module.context_attention_fwd(q, k, v, out, torch.tensor([0], dtype=torch.int32, device="cuda"),
                                 torch.tensor([seq_len], dtype=torch.int32, device="cuda"), seq_len, is_causal=False)
    torch.cuda.synchronize()
    expected = reference_attention(q, k, v, causal_offset=seq_len)  # every key at or before every query: no mask
    return (out.float() - expected).abs().max().item(), expected.abs().max().item()


def case_fused_moe(kernels, config, tokens=128, experts=8, n=1024, k=1024, top_k=2):
    """fused_moe_kernel on tokens sorted by expert and padded to BLOCK_SIZE_M, as moe_align_block_size does."""
    import torch
    import triton
    import triton.language as tl

    block_m = config["BLOCK_SIZE_M"]
    a = torch.randn(tokens, k, dtype=torch.float16, device="cuda") / k ** 0.5
    b = torch.randn(experts, n, k, dtype=torch.float16, device="cuda")
    chosen = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)])
    slots = chosen.flatten()
    sorted_ids, expert_ids = [], []
    for expert in range(experts):
        mine = (slots == expert).nonzero().flatten().tolist()
        mine += [tokens * top_k] * (-len(mine) % block_m)  # padding: never a valid token
        sorted_ids += mine
        expert_ids += [expert] * (len(mine) // block_m)
    sorted_ids = torch.tensor(sorted_ids, dtype=torch.int32, device="cuda")
    expert_ids = torch.tensor(expert_ids, dtype=torch.int32, device="cuda")
    c = torch.zeros(tokens, top_k, n, dtype=torch.float16, device="cuda")
    em = sorted_ids.numel()
    grid = lambda meta: (triton.cdiv(em, meta["BLOCK_SIZE_M"]) * triton.cdiv(n, meta["BLOCK_SIZE_N"]),)  # noqa: E731
    options = {key: value for key, value in config.items() if key != "BLOCK_SIZE_M"}
    kernels.fused_moe_kernel[grid](
        a, b, c, None, None, None, None, sorted_ids, expert_ids, torch.tensor([em], dtype=torch.int32, device="cuda"),
        n, k, em, tokens * top_k, a.stride(0), a.stride(1), b.stride(0), b.stride(2), b.stride(1), c.stride(1),
        c.stride(2), 0, 0, 0, 0, 0, 0, 0, 0, 0, naive_block_assignment=False, BLOCK_SIZE_M=block_m, SPLIT_K=1,
        MUL_ROUTED_WEIGHT=False, top_k=top_k, compute_type=tl.float16, use_fp8_w8a8=False, use_int8_w8a8=False,
        use_int8_w8a16=False, per_channel_quant=False, HAS_BIAS=False, SWAP_AB=False, **options)
    torch.cuda.synchronize()
    expected = torch.einsum("tk,tjnk->tjn", a.float(), b[chosen].float())
    return (c.float() - expected).abs().max().item(), expected.abs().max().item()


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def main(argv=None) -> int:
    args = parse_args(argv)
    missing = missing_files(args.source)
    if missing:
        print(f"vllm_pack_numerics: {args.source} lacks {', '.join(missing)}; copy those files of vLLM "
              f"{args.vllm_version} there at their wheel paths", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("vllm_pack_numerics: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    if importlib.util.find_spec("vllm") is not None:
        print("vllm_pack_numerics: vLLM is installed here; run it where it is not, so the files given are the ones "
              "that run", file=sys.stderr)
        return 2
    log = Path(tempfile.mkdtemp(prefix="vllm-pack-")) / "incidents.jsonl"
    os.environ.update(SMEMGUARD="on", SMEMGUARD_MAX_SHARED=args.limit, SMEMGUARD_LOG=str(log))
    import smemguard

    install_stand_ins(args.vllm_version)
    modules = {name: import_file(name, args.source / relative)
               for name, relative in FILES.items() if name != "fused_moe"}
    kernels = jit_functions_of(args.source / FILES["fused_moe"], log.parent)
    # After the imports: a module loaded from a file path passes no import hook, and install()
    # patches the modules already imported at once.
    if not smemguard.install():
        print("vllm_pack_numerics: smemguard did not install (see the log line above)", file=sys.stderr)
        return 2
    attention = modules["vllm.v1.attention.ops.triton_unified_attention"]
    prefill = modules["vllm.v1.attention.ops.prefix_prefill"]
    encoder = modules["vllm.v1.attention.ops.triton_prefill_attention"]
    moe_config = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 32, "num_warps": 8,
                  "num_stages": 4}
    cases = [
        ("unified_attention head 512 fp16 prefill", lambda: case_unified_attention(attention, 512, torch.float16)),
        ("unified_attention head 256 fp32 prefill", lambda: case_unified_attention(attention, 256, torch.float32)),
        ("unified_attention head 256 fp32 decode, window 1024 (3D)",
         lambda: case_unified_attention(attention, 256, torch.float32, decode=True, window=1023)),
        ("prefix_prefill head 128 fp16", lambda: case_prefix_prefill(prefill, 128, torch.float16)),
        ("prefix_prefill head 256 fp16", lambda: case_prefix_prefill(prefill, 256, torch.float16)),
        ("prefix_prefill head 128 fp32", lambda: case_prefix_prefill(prefill, 128, torch.float32)),
        ("encoder attention head 256 fp16 (triton_prefill_attention)",
         lambda: case_encoder_attention(encoder, 256, torch.float16)),
        ("encoder attention head 256 bf16 (triton_prefill_attention)",
         lambda: case_encoder_attention(encoder, 256, torch.bfloat16)),
        ("fused_moe A100 table on the limit", lambda: case_fused_moe(kernels, moe_config)),
    ]
    rows = []
    for label, run in cases:
        seen = len(records(log))
        torch.manual_seed(0)
        print(f"-- {label}", flush=True)
        try:
            error, scale = run()
            outcome = f"max |err| {error:.2e} (output up to {scale:.2f})"
            ok = error <= 2e-2 * max(scale, 1.0)
        except Exception as failure:  # one case's failure must not hide the others'
            outcome, ok = f"{type(failure).__name__}: {str(failure).splitlines()[0][:80]}", False
        actions = ", ".join(f"{r['action']} {r.get('final') or ''}".strip() for r in records(log)[seen:])
        rows.append((label, actions or "fits without recovery", outcome, "ok" if ok else "FAILED"))
    document = harness.write(args.json, [dict(zip(("case", "smemguard", "vs torch", "verdict"), row)) for row in rows],
                             limit=args.limit, vllm_files=args.vllm_version)
    print(f"\n{harness.headline(document)}, vLLM files {args.vllm_version}, SMEMGUARD_MAX_SHARED={args.limit}, "
          f"incident records: {log}")
    widths = [max(len(row[i]) for row in rows + [("case", "smemguard", "vs torch", "")]) for i in range(4)]
    for row in [("case", "smemguard", "vs torch", ""), *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)))
    return 0 if all(row[3] == "ok" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
