"""What a max-autotune training compile on an emulated small GPU writes: records by phase and action, per tree.

A small Llama (transformers, 2 layers, hidden 1024, bf16) trained two steps with
``torch.compile(mode="max-autotune-no-cudagraphs")`` under ``smemguard run`` with ``SMEMGUARD_MAX_SHARED`` (T4 by
default), each tree in a fresh process with a cold Inductor cache. Answers: does the step succeed, how many
records does one compile write, and how many of them are ``reraised`` (the series an operator is paged on)?
A choice max-autotune times and discards is not a failed request: on a tree that knows it, ``reraised`` is 0.

Answer: before, 168 ``stages_reduced`` and 59 ``reraised`` records under T4 (H100, torch 2.11, Triton 3.6,
2026-12-06); after, the step succeeds with 98 records, 87 ``stages_reduced`` and 10 ``autotune_skipped`` while
autotuning and 1 ``stages_reduced`` at a compile, 0 ``reraised`` (the same machine and versions, 2026-12-07, 392 s;
``results/2026-12-07-h100-session/max_autotune_records.json``). tests/test_autotune_records.py is the CPU acceptance.

    python benchmarks/experiments/max_autotune_records.py --tree before=.field/smemguard-base --tree after=. --limit T4

Needs a CUDA GPU, torch with Inductor, and transformers.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRAIN = """
import torch, transformers
torch.manual_seed(0)
config = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
                                  num_attention_heads=16, num_key_value_heads=16, vocab_size=4096,
                                  max_position_embeddings=512)
model = transformers.LlamaForCausalLM(config).cuda().to(torch.bfloat16)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
loss_of = torch.compile(lambda ids: model(input_ids=ids, labels=ids).loss, mode="max-autotune-no-cudagraphs")
ids = torch.randint(0, 4096, (4, 256), device="cuda")
for _ in range(2):
    loss = loss_of(ids)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
torch.cuda.synchronize()
print("STEP OK", float(loss))
"""


def run_tree(name: str, tree: Path, limit: str, timeout: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"max-autotune-{name}-") as scratch:
        log = Path(scratch) / "incidents.jsonl"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SMEMGUARD")}
        env.update(PYTHONPATH=os.pathsep.join([str(tree.resolve()), env.get("PYTHONPATH", "")]),
                   SMEMGUARD_MAX_SHARED=limit, SMEMGUARD_LOG=str(log), SMEMGUARD_CACHE_DIR=str(Path(scratch) / "c"),
                   TORCHINDUCTOR_CACHE_DIR=str(Path(scratch) / "inductor"), TORCHINDUCTOR_FX_GRAPH_CACHE="0",
                   TRITON_CACHE_DIR=str(Path(scratch) / "triton"))
        started = time.perf_counter()
        try:
            result = subprocess.run([sys.executable, "-m", "smemguard.cli", "run", "--", sys.executable, "-c", TRAIN],
                                    env=env, capture_output=True, text=True, timeout=timeout)
            status, stepped = result.returncode, "STEP OK" in result.stdout
            tail = (result.stdout + result.stderr)[-600:]
        except subprocess.TimeoutExpired:
            status, tail, stepped = "timeout", "", False
        seconds = round(time.perf_counter() - started, 1)
        records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    by = collections.Counter(f"{r.get('phase')}/{r.get('action')}" for r in records)
    return {"tree": name, "step_ok": status == 0 and stepped, "status": status, "seconds": seconds,
            "records": len(records), "reraised": sum(r.get("action") == "reraised" for r in records),
            "by_phase_action": dict(by), "tail": tail if status != 0 else ""}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", required=True, help="NAME=PATH of a smemguard tree (repeatable)")
    parser.add_argument("--limit", default="T4")
    parser.add_argument("--timeout", type=int, default=420)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch
    import triton

    rows = [run_tree(name, Path(path), args.limit, args.timeout)
            for name, _, path in (tree.partition("=") for tree in args.tree)]
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
              "limit": args.limit, "date": time.strftime("%Y-%m-%d"), "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(f"{result['gpu']}, torch {result['torch']}, Triton {result['triton']}, SMEMGUARD_MAX_SHARED={args.limit}")
    print(f"{'tree':8} {'step':5} {'s':>6} {'records':>8} {'reraised':>9}  by phase/action")
    for row in rows:
        print(f"{row['tree']:8} {'ok' if row['step_ok'] else 'FAIL':5} {row['seconds']:>6} {row['records']:>8} "
              f"{row['reraised']:>9}  {json.dumps(row['by_phase_action'], sort_keys=True)}")
        if row["tail"]:
            print("   ", row["tail"].replace("\n", "\n    ")[-400:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
