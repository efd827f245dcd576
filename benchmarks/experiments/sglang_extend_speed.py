"""SGLang 0.5.5's extend attention recovered by smemguard under an emulated RTX 5090, against SGLang 0.5.23's own sm_120
tiles at the same shapes, on one GPU: is the recovered release within 5% of the one whose tiles were written for it?

Answer (2026-12-07): yes. The tiles are the same: 0.5.5's 32x64 (106496 B) is recovered at 32x32 (71680 B), 0.5.23's
own sm_120 choice, for all six shapes (CPU harness, ``--dry-run``, Triton 3.9.0); and the time is: 0.987 to 1.009 of
0.5.23's at each shape (H100 under RTX5090, Triton 3.6.0, torch 2.11.0+cu130;
``results/2026-12-07-h100-session/sglang_extend_speed.json``).

SGLang 0.5.5 gives sm_120 Hopper's tiles (its table predates PR #14311): at Kimi K2's and DeepSeek's absorbed MLA (Lq
576, Lv 512) they need 106496 B, over the RTX 5090's 101376 B (ktransformers #1570), and smemguard's SGLang pack
halves them for that shape class. SGLang 0.5.23 has sm_120 tiles of its own. Each release's kernel module is imported
from its unpacked wheel (``benchmarks/experiments/prepare_sglang_releases.sh`` builds ``.field/sglang-0.5.5`` and
``.field/sglang-0.5.23`` here from PyPI; the kernel modules of 0.5.23 need msgspec; the GPU machine has neither SGLang
nor a network), one release after the other in this process, with the compute capability the module reads set to (12,
0) as on an RTX 5090 and smemguard installed under the same emulated limit (``SMEMGUARD_MAX_SHARED=RTX5090``, 101376
B) for both: 0.5.23's own tiles fit it and run unchanged. The package is entered at its kernels:
``sglang/__init__.py`` and ``sglang.srt.utils`` pull in SGLang's serving stack, so they are not imported, and the
device predicates the kernel modules take from ``sglang.srt.utils`` are answered here as SGLang computes them on CUDA.
Each shape calls the wrapper ``extend_attention_fwd`` as SGLang's Triton backend does (causal, no custom mask, the
prefix in the KV cache at scattered slots, bf16), once to let smemguard decide, then times it with
``triton.testing.do_bench`` (median).

    python benchmarks/experiments/sglang_extend_speed.py --json $OUT/sglang_extend_speed.json
    python benchmarks/experiments/sglang_extend_speed.py --dry-run   # no GPU: compiles for sm_120, runs nothing
    python benchmarks/experiments/sglang_extend_speed.py --files .field/sglang-0.5.5   # the files the import reads
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from smemguard.patches.contrib import sglang_extend_attention  # noqa: E402

GPU, CAPABILITY = "RTX5090", (12, 0)
RELEASES = {"0.5.5": ROOT / ".field" / "sglang-0.5.5", "0.5.23": ROOT / ".field" / "sglang-0.5.23"}


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    extend: int  # new tokens per sequence
    prefix: int  # tokens per sequence already in the KV cache
    heads: int
    kv_heads: int
    lq: int
    lv: int

    def __str__(self) -> str:
        return (f"Lq{self.lq}/Lv{self.lv} h{self.heads}/{self.kv_heads} b{self.batch} "
                f"e{self.extend} p{self.prefix}")


#: The absorbed MLA of Kimi K2 and DeepSeek-V3 (one KV head; 16 query heads per GPU at tensor parallel 8, 128 at 1),
#: where SGLang 0.5.5's sm_120 tiles do not fit an RTX 5090.
SHAPES = [Shape(batch, extend, prefix, heads, 1, 576, 512)
          for batch, extend, prefix, heads in ((1, 1024, 0, 16), (1, 4096, 0, 16), (4, 1024, 1024, 16),
                                               (1, 2048, 8192, 16), (8, 512, 4096, 16), (1, 2048, 0, 128))]


def _device_predicates():
    """What the kernel modules take from ``sglang.srt.utils``, computed as SGLang does on CUDA."""
    import torch

    utils = types.ModuleType("sglang.srt.utils")
    utils.is_cuda = lambda: torch.cuda.is_available() and torch.version.cuda is not None
    utils.is_hip = lambda: torch.version.hip is not None
    utils.is_gfx95_supported = utils.is_gfx1250_supported = lambda: False
    utils.get_device_core_count = lambda device_id=0: (
        torch.cuda.get_device_properties(device_id).multi_processor_count if torch.cuda.is_available() else 0)
    return utils


def load(root: Path):
    """The extend attention module of the SGLang release unpacked at ``root`` (any earlier one forgotten)."""
    for name in [name for name in sys.modules if name == "sglang" or name.startswith("sglang.")]:
        del sys.modules[name]
    version: dict = {}
    exec((root / "sglang" / "version.py").read_text(), version)
    package = types.ModuleType("sglang")
    package.__path__, package.__version__ = [str(root / "sglang")], version["__version__"]
    sys.modules["sglang"], sys.modules["sglang.srt.utils"] = package, _device_predicates()
    for home in sglang_extend_attention.HOMES:
        if (root / Path(*home.split("."))).with_suffix(".py").exists():
            return importlib.import_module(home)
    raise SystemExit(f"{root}: no SGLang extend attention at {' or '.join(sglang_extend_attention.HOMES)}; "
                     "run benchmarks/experiments/prepare_sglang_releases.sh")


def inputs(shape: Shape, device: str) -> dict:
    import torch

    generator = torch.Generator(device).manual_seed(0)
    tokens, slots = shape.batch * shape.extend, shape.batch * (shape.prefix + shape.extend)

    def values(*size):
        if device == "cpu":  # the harness runs nothing
            return torch.empty(*size, dtype=torch.bfloat16)
        return torch.randn(*size, generator=generator, device=device).to(torch.bfloat16)

    return {"q": values(tokens, shape.heads, shape.lq), "k": values(tokens, shape.kv_heads, shape.lq),
            "v": values(tokens, shape.kv_heads, shape.lv), "o": values(tokens, shape.heads, shape.lv),
            "k_buffer": values(slots, shape.kv_heads, shape.lq), "v_buffer": values(slots, shape.kv_heads, shape.lv),
            "qo_indptr": torch.arange(shape.batch + 1, dtype=torch.int32, device=device) * shape.extend,
            "kv_indptr": torch.arange(shape.batch + 1, dtype=torch.int32, device=device) * shape.prefix,
            "kv_indices": torch.randperm(slots, generator=generator, device=device)[:shape.batch * shape.prefix]}


def call(module, tensors: dict, shape: Shape) -> None:
    """``extend_attention_fwd`` as SGLang's Triton backend calls it: causal, no custom mask (the FP8 KV scales, 1.0,
    where the release takes them)."""
    import inspect

    scales = {"k_scale": 1.0, "v_scale": 1.0} if "k_scale" in inspect.signature(
        module.extend_attention_fwd).parameters else {}
    t = tensors
    module.extend_attention_fwd(t["q"], t["k"], t["v"], t["o"], t["k_buffer"], t["v_buffer"], t["qo_indptr"],
                                t["kv_indptr"], t["kv_indices"], None, True, None, shape.extend, **scales)


def measure(module, shape: Shape, dry_run: bool, log: Path) -> dict:
    """One release at one shape under the emulated RTX 5090: the tiles that ran, what smemguard did, the time."""
    import smemguard
    from smemguard.facts.settings import Settings, parse_max_shared

    module._is_cuda, module.CUDA_CAPABILITY = True, CAPABILITY  # as the module reads them on an RTX 5090
    own = module._get_block_sizes_for_extend_attention(shape.lq, shape.lv)[3:5]
    limit, label = parse_max_shared(GPU)
    tensors = inputs(shape, "cpu" if dry_run else "cuda")
    smemguard.install(Settings(max_shared=limit, max_shared_label=label, log_path=log,
                               cache_dir=log.with_suffix(".decisions")))  # each shape decides afresh, and records
    row = {"own tiles": f"BLOCK_M={own[0]} BLOCK_N={own[1]}", "ms": None, "error": None}
    try:
        if dry_run:
            from smemguard.testing import fake_gpu

            with fake_gpu(GPU) as gpu:
                call(module, tensors, shape)
                call(module, tensors, shape)
            row["shared"] = [launch.shared for launch in gpu.launches]
        else:
            import torch
            import triton

            call(module, tensors, shape)  # smemguard decides here, if anything does not fit
            torch.cuda.synchronize()
            row["ms"] = triton.testing.do_bench(lambda: call(module, tensors, shape), warmup=10, rep=50,
                                                return_mode="median")
    except Exception as error:  # a shape that fails is a row of the table, not the end of the run
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
    finally:
        smemguard.uninstall()
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    row["actions"] = [record["action"] for record in records]
    row["ran"] = next((record["final"] for record in records if record["action"] == "tiles_reduced"),
                      row["own tiles"])
    return row


def imported_files(root: Path) -> list[str]:
    """The files of the release at ``root`` that loading its extend attention reads, relative to ``root``."""
    load(root)
    root = root.resolve()
    found = {"sglang/version.py"}
    for module in list(sys.modules.values()):
        path = Path(getattr(module, "__file__", None) or "/").resolve()
        if path.is_relative_to(root):
            found.add(str(path.relative_to(root)))
    return sorted(found)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, default=RELEASES["0.5.5"], help="SGLang 0.5.5, unpacked")
    parser.add_argument("--new", type=Path, default=RELEASES["0.5.23"], help="SGLang 0.5.23, unpacked")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: compile on the CPU harness, time nothing")
    parser.add_argument("--shapes", type=int, default=len(SHAPES), help="only the first N shapes")
    parser.add_argument("--json", type=Path, help="write every measurement here")
    parser.add_argument("--files", type=Path, metavar="ROOT", help="print the files of the release at ROOT that the "
                        "import reads (prepare_sglang_releases.sh keeps only those), and stop")
    args = parser.parse_args()
    if args.files:
        print("\n".join(imported_files(args.files)))
        return 0
    started, rows = time.perf_counter(), {str(shape): {} for shape in SHAPES[:args.shapes]}
    with tempfile.TemporaryDirectory(prefix="sglang-extend-speed-") as scratch:
        for release, root in (("0.5.23", args.new), ("0.5.5", args.old)):
            module = load(root)
            for index, shape in enumerate(SHAPES[:args.shapes]):
                log = Path(scratch) / f"{release}-{index}.jsonl"
                rows[str(shape)][release] = measure(module, shape, args.dry_run, log)
                print(f"  {release} {shape}: {rows[str(shape)][release]} ({time.perf_counter() - started:.0f} s)",
                      file=sys.stderr, flush=True)
    import torch
    import triton

    meta = {"device": "CPU harness (sm_120 compiles, nothing runs)" if args.dry_run else torch.cuda.get_device_name(0),
            "emulated": GPU, "capability": CAPABILITY, "triton": triton.__version__, "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "seconds": round(time.perf_counter() - started, 1)}
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    print(f"# SGLang 0.5.5 recovered by smemguard vs SGLang 0.5.23's own sm_120 tiles, under {GPU}: {meta}")
    print(f"{'shape':36} {'0.5.23 own tiles':22} {'ms':>8}  {'0.5.5 recovered':22} {'ms':>8} {'ratio':>6}")
    for shape, result in rows.items():
        new, old = result["0.5.23"], result["0.5.5"]
        ratio = f"{old['ms'] / new['ms']:6.3f}" if old["ms"] and new["ms"] else f"{'-':>6}"
        cells = [f"{row['ms']:8.3f}" if row["ms"] else f"{(row['error'] or '-')[:8]:>8}" for row in (new, old)]
        recovered = old["ran"] if "tiles_reduced" in old["actions"] else f"{old['ran']} (own)"
        print(f"{shape:36} {new['ran']:22} {cells[0]}  {recovered:22} {cells[1]} {ratio}")
    failed = [f"{release} {shape}: {row['error']}" for shape, result in rows.items() for release, row in result.items()
              if row["error"]]
    for line in failed:
        print(f"failed: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
