"""torch.compile kernels under an emulated small GPU, without and with smemguard.

Every case runs ``benchmarks/workloads/inductor_cases.py`` in a fresh process with fresh ``TORCHINDUCTOR_CACHE_DIR``
and ``TRITON_CACHE_DIR`` (no compiled kernel, FX graph or autotune result carried from one case to another),
``--jobs`` at a time, and its own ``SMEMGUARD_LOG`` and ``SMEMGUARD_CACHE_DIR``. Cases:

- ``flex``: ``torch.compile(flex_attention)``, forward then backward, B=2 H=4 S=1024, head dim 64/128/256,
  fp16/bf16/fp32, against SDPA. Choice ``h200``: Inductor as it is on this GPU; ``sm8x``: Inductor's
  FlexAttention heuristic sees capability (8, 0) and picks the A100 table, as on every 8.x GPU (Triton still
  compiles for this GPU). Limits ``RTX4090`` (101376 B) and ``T4`` (65536 B) through
  ``SMEMGUARD_MAX_SHARED``;
- ``rmsnorm`` / ``layernorm`` (16384 x 8192): the backward's mix-order persistent reduction (``triton_per_*``
  with ``NUM_STAGES``, pipelined as torch 2.13 does by default), the kind of pytorch #175250, at the H200's own
  limit, RTX4090 and T4;
- two modes each: ``plain`` (``SMEMGUARD=observe``: the emulated limit is enforced, nothing changes what
  runs) and ``smemguard`` (``SMEMGUARD=on``);
- ``healthy``: an MLP + layer norm + softmax in bf16 and flex attention D=64 fp16, each ``off`` (smemguard not
  imported) and ``on`` (installed, no emulated limit), one process at a time before the matrix, alternating
  (``--healthy-repeats`` times): compile time and steady run time side by side, and their ratio.

Outcome per case: ``ok`` (compiled, ran, and within FlexAttention's own test tolerance, see workloads/inductor_cases),
``wrong``, ``fail`` (the exception: type, first line, Required/limit), ``timeout`` or ``crash``. Also: forward
and backward compile seconds (first call each), median steady step time, the incident records and their
actions, recovery compiles and seconds from the records, the FlexAttention configs Inductor's heuristic
returned, and every Inductor kernel the case loaded with its shared memory: a loaded kernel over the emulated
limit means the emulation did not reach it (``LEAK`` in the table).

    python benchmarks/inductor_matrix.py --out DIR [--jobs 12] [--only SUBSTRING[,SUBSTRING]] [--limit T4,...]
                                         [--healthy-repeats N]
    python benchmarks/inductor_matrix.py --dry-run          # the case list
    python benchmarks/inductor_matrix.py --device cpu --out DIR   # a tiny smoke run of the plumbing, no GPU
    python benchmarks/inductor_matrix.py --report DIR/inductor_matrix.json

Writes ``DIR/inductor_matrix.json`` after every case, each case's incident file as
``DIR/incidents/<case>.jsonl``, and prints the table last.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import harness

from smemguard.facts import settings as smemguard_settings  # imports neither torch nor Triton

REPO = harness.ROOT
WORKER = Path(__file__).resolve().parent / "workloads" / "inductor_cases.py"
RESULTS_NAME = "inductor_matrix.json"
MATRIX_MODES = {"plain": "observe", "smemguard": "on"}  # mode -> SMEMGUARD
HEALTHY_MODES = {"off": "off", "on": "on"}
FLEX_LIMITS = ("RTX4090", "T4")
REDUCTION_LIMITS = ("H200", "RTX4090", "T4")
HEAD_DIMS = (64, 128, 256)
DTYPES = ("fp16", "bf16", "fp32")
CHOICES = ("h200", "sm8x")
# (workload, dtype): rows >= 2 x columns and >= 4096 rows, so that Inductor fuses the backward's reductions.
REDUCTIONS = (("rmsnorm", "fp32"), ("layernorm", "fp32"), ("rmsnorm", "bf16"))
SHAPES = {  # workload -> (GPU shape, CPU smoke shape)
    "flex": ((2, 4, 1024), (1, 2, 128)), "rmsnorm": ((16384, 8192), (256, 64)),
    "layernorm": ((16384, 8192), (256, 64)), "mlp": ((8192, 1024), (64, 64)),
}
OUTPUT_TAIL_CHARS = 3000


@dataclass(frozen=True)
class Case:
    pair: str  # the case without its mode: plain and smemguard (or off and on) share it
    group: str  # flex, reduction, healthy
    mode: str
    limit: str | None  # SMEMGUARD_MAX_SHARED; None: the device's own
    spec: dict = field(hash=False)  # what inductor_cases.py runs

    @property
    def id(self) -> str:
        return f"{self.pair}-{self.mode}"


def _spec(workload: str, dtype: str, device: str, blocks: int, smemguard: bool, head_dim: int | None = None,
          choice: str | None = None) -> dict:
    shape = SHAPES[workload][device == "cpu"]
    return {"workload": workload, "dtype": dtype, "shape": [*shape, head_dim] if head_dim else list(shape),
            "choice": choice, "device": device, "blocks": blocks, "smemguard": smemguard,
            "backward": not (workload == "flex" and device == "cpu")}  # FlexAttention has no CPU backward


def build_cases(device: str, blocks: int, limits: list[str] | None, healthy_repeats: int = 1) -> list[Case]:
    """The full matrix on a GPU; on the CPU one case of each group (tiny shapes), to exercise the plumbing."""
    cases = []
    flex_limits, reduction_limits = (limits, limits) if limits else (FLEX_LIMITS, REDUCTION_LIMITS)
    smoke = device == "cpu"
    for limit in flex_limits[:1] if smoke else flex_limits:
        for choice in CHOICES[:1] if smoke else CHOICES:
            for head_dim in HEAD_DIMS[:1] if smoke else HEAD_DIMS:
                for dtype in ("fp32",) if smoke else DTYPES:
                    for mode in MATRIX_MODES:
                        cases.append(Case(f"flex-D{head_dim}-{dtype}-{choice}-{limit}", "flex", mode, limit,
                                          _spec("flex", dtype, device, blocks, True, head_dim, choice)))
    for limit in reduction_limits[:1] if smoke else reduction_limits:
        for workload, dtype in REDUCTIONS[:1] if smoke else REDUCTIONS:
            cols = SHAPES[workload][smoke][1]
            for mode in MATRIX_MODES:
                cases.append(Case(f"{workload}-N{cols}-{dtype}-{limit}", "reduction", mode, limit,
                                  _spec(workload, dtype, device, blocks, True)))
    healthy = [("mlp", _spec("mlp", "fp32" if smoke else "bf16", device, blocks * 4, False))]
    if not smoke:
        healthy.append(("flex-D64-fp16", _spec("flex", "fp16", device, blocks * 4, False, 64, "h200")))
    for repeat in range(1, healthy_repeats + 1):
        for name, spec in healthy:
            for mode in HEALTHY_MODES:
                cases.append(Case(f"healthy-{name}-{repeat}", "healthy", mode, None,
                                  {**spec, "smemguard": mode != "off"}))
    return cases


def _selected(cases: list[Case], only: str | None) -> list[Case]:
    parts = [part for part in (only or "").split(",") if part]
    return [case for case in cases if all(part in case.id for part in parts)]


def case_env(case: Case, case_dir: Path, compile_threads: int) -> dict:
    env = {name: value for name, value in os.environ.items() if not name.startswith("SMEMGUARD")}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(case_dir / "inductor"), TRITON_CACHE_DIR=str(case_dir / "triton"),
               TORCHINDUCTOR_COMPILE_THREADS=str(compile_threads), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    env["SMEMGUARD"] = HEALTHY_MODES[case.mode] if case.group == "healthy" else MATRIX_MODES[case.mode]
    if case.spec["smemguard"]:
        env.update(SMEMGUARD_LOG=str(case_dir / "incidents.jsonl"), SMEMGUARD_CACHE_DIR=str(case_dir / "cache"))
    if case.limit:
        env["SMEMGUARD_MAX_SHARED"] = case.limit
    return env


def _incidents(path: Path, keep: Path) -> dict:
    """The case's incident records, summarised (one line each, unreadable lines counted), copied to ``keep``."""
    if not path.is_file():
        return {"count": 0, "actions": {}, "records": [], "unreadable_lines": 0}
    keep.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, keep)
    records, unreadable = [], 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        elif line.strip():
            unreadable += 1
    wanted = ("kernel", "phase", "action", "required", "limit_hit", "config", "final", "compiles", "compile_ms",
              "recovery_ms", "remembered")
    return {"count": len(records), "actions": dict(collections.Counter(str(r.get("action")) for r in records)),
            "compiles": sum(r.get("compiles") or 0 for r in records if isinstance(r.get("compiles"), int)),
            "recovery_s": sum(r.get("recovery_ms") or 0 for r in records
                              if isinstance(r.get("recovery_ms"), (int, float))) / 1000,
            "records": [{key: r.get(key) for key in wanted} for r in records], "unreadable_lines": unreadable}


def run_case(case: Case, scratch: Path, out: Path, compile_threads: int, timeout: float) -> dict:
    case_dir = scratch / case.id
    case_dir.mkdir(parents=True, exist_ok=True)  # experiments/inductor_remembered.py puts caches there first
    result_path = case_dir / "result.json"
    command = [sys.executable, str(WORKER), json.dumps(case.spec), str(result_path)]
    started = time.perf_counter()
    # A session of its own: on timeout the case and Inductor's compile workers go together.
    process = subprocess.Popen(command, env=case_env(case, case_dir, compile_threads), cwd=REPO, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        timed_out = True
    record = {"id": case.id, **asdict(case), "returncode": process.returncode,
              "wall_s": round(time.perf_counter() - started, 2)}
    if result_path.is_file():
        record.update(json.loads(result_path.read_text()))
    else:
        last = [line for line in output.splitlines() if line.strip()][-1:] or [""]
        record.update(outcome="timeout" if timed_out else "crash",
                      error={"phase": "process", "type": "timeout" if timed_out else "crash", "line": last[0][:400]})
    record["output_tail"] = output[-OUTPUT_TAIL_CHARS:]
    record["incidents"] = _incidents(case_dir / "incidents.jsonl", out / "incidents" / f"{case.id}.jsonl")
    limit = smemguard_settings.parse_max_shared(case.limit)[0] if case.limit else None
    record["limit_bytes"] = limit
    record["leaks"] = [k for k in record.get("kernels", []) if limit and k["loaded"] and (k["shared"] or 0) > limit]
    return record


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _note(record: dict) -> str:
    error = record.get("error") or {}
    if "required" in error:
        return f"{error['type']} in {error['phase']}: Required {error['required']} > {error['hardware_limit']}"
    if error:
        return f"{error['type']} in {error['phase']}: {error['line'][:90]}"
    if record.get("outcome") == "wrong":
        return "mismatch: " + ", ".join(name for name, check in record["numerics"].items() if not check["ok"])
    return ""


def summary_counts(records: list[dict]) -> dict:
    pairs = collections.defaultdict(dict)
    for record in records:
        if record["group"] != "healthy":
            pairs[record["pair"]][record["mode"]] = record.get("outcome")
    complete = [modes for modes in pairs.values() if {"plain", "smemguard"} <= modes.keys()]
    return {"pairs": len(complete),
            "fails_without": sum(m["plain"] == "fail" for m in complete),
            "recovered": sum(m["plain"] == "fail" and m["smemguard"] == "ok" for m in complete),
            "broken": sum(m["plain"] == "ok" and m["smemguard"] != "ok" for m in complete),
            "wrong": sum("wrong" in m.values() for m in complete),
            "leaking_plain_cases": sum(bool(r["leaks"]) for r in records if r["mode"] == "plain")}


def print_kernels(records: list[dict]) -> None:
    """Per reduction case, the largest Inductor kernels and the shared memory they compiled to."""
    print("\n# largest Inductor kernels of the reduction cases (pick --limit below these to make them overflow)")
    for record in sorted(records, key=lambda r: r["id"]):
        if record["group"] == "reduction" and record["mode"] == "plain":
            for kernel in record.get("kernels", [])[:3]:
                state = "loaded" if kernel["loaded"] else "not loaded"
                print(f"{record['pair']:34} {kernel['kernel']:44} {_fmt(kernel['shared'], 0):>7} B  {state:10} "
                      f"{kernel['config']}")


def _compile_s(record: dict) -> float | None:
    return None if record.get("backward_s") is None else record["forward_s"] + record["backward_s"]


def print_healthy(records: list[dict]) -> None:
    """Per healthy workload: the median over repeats of compile seconds and run ms, off and on, and their ratio
    (with the range of the repeats' own ratios when there are several)."""
    runs = collections.defaultdict(lambda: collections.defaultdict(dict))  # workload -> repeat -> mode -> record
    for record in records:
        if record["group"] == "healthy":
            workload, _, repeat = record["pair"].rpartition("-")
            if not repeat.isdigit():  # a results file of before --healthy-repeats
                workload, repeat = record["pair"], "1"
            runs[workload][repeat][record["mode"]] = record
    print(f"\n# healthy compile: smemguard off (not imported) vs on (installed, no emulated limit), medians of n runs\n"
          f"{'workload':22} {'n':>2} {'compile s off':>13} {'on':>6} {'ratio':>17} {'run ms off':>10} {'on':>7} "
          f"{'ratio':>17}")
    for workload, repeats in sorted(runs.items()):
        columns = []
        for measure in (_compile_s, lambda record: record.get("run_ms")):
            pairs = [(measure(modes.get("off", {})), measure(modes.get("on", {}))) for modes in repeats.values()]
            pairs = [(off, on) for off, on in pairs if off and on]
            if not pairs:
                columns.append(f"{'-':>13} {'-':>6} {'-':>17}")
                continue
            off, on = (statistics.median(side) for side in zip(*pairs))
            ratios = [b / a for a, b in pairs]
            spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
            columns.append(f"{off:13.3f} {on:6.3f} {f'{on / off:.2f}{spread}':>17}")
        print(f"{workload:22} {len(repeats):>2} {columns[0]} {columns[1]}")


def print_report(results: dict) -> None:
    records = results["cases"]
    versions = next((r["versions"] for r in records if r.get("versions")), {})
    print(f"# inductor matrix: {versions.get('gpu', 'no GPU')}, torch {versions.get('torch')}, "
          f"Triton {versions.get('triton')}, {results['meta']['date']}")
    print_kernels(records)
    print_healthy(records)
    print(f"\n{'case':34} {'mode':9} {'outcome':8} {'fwd s':>6} {'bwd s':>6} {'run ms':>7} {'records':18} "
          f"{'recovery':>12}  note")
    for record in sorted((r for r in records if r["group"] != "healthy"), key=lambda r: (r["pair"], r["mode"])):
        incidents = record["incidents"]
        actions = " ".join(f"{action}:{n}" for action, n in incidents["actions"].items()) or "0"
        recovery = (f"{incidents.get('compiles', 0)}c {incidents.get('recovery_s', 0):.1f}s" if incidents["count"]
                    else "-")
        note = _note(record) + (f" LEAK: {len(record['leaks'])} kernel(s) over the limit loaded"
                                if record["leaks"] else "")
        print(f"{record['pair']:34} {record['mode']:9} {record.get('outcome', '?'):8} "
              f"{_fmt(record.get('forward_s')):>6} {_fmt(record.get('backward_s')):>6} "
              f"{_fmt(record.get('run_ms'), 3):>7} {actions:18} {recovery:>12}  {note}")
    counts = summary_counts(records)
    print(f"\nfails without smemguard: {counts['fails_without']}; recovered with smemguard: {counts['recovered']}; "
          f"broken by smemguard (passes plain, fails with): {counts['broken']}  "
          f"({counts['pairs']} pairs; {counts['wrong']} with a numerics mismatch; "
          f"{counts['leaking_plain_cases']} plain cases loaded a kernel over the emulated limit)")


def _limits(text: str) -> list[str]:
    limits = [part.strip() for part in text.split(",") if part.strip()]
    for limit in limits:
        try:
            smemguard_settings.parse_max_shared(limit)
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"--limit {limit!r}: {error}") from None
    return limits


def main() -> int:
    parser = harness.parser(__doc__, results=False)
    parser.add_argument("--out", type=Path, help="directory for the JSON results and incident files")
    parser.add_argument("--jobs", type=int, default=12, help="cases at once (default 12)")
    parser.add_argument("--only", help="run the cases whose id contains every one of these comma-separated texts")
    parser.add_argument("--limit", type=_limits, help="limits (bytes or GPU names of `smemguard gpus`, comma-"
                        "separated) for every flex and reduction case, instead of RTX4090,T4 / H200,RTX4090,T4")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a smoke run of one tiny case per group (Inductor's C++ kernels, no limit)")
    parser.add_argument("--blocks", type=int, default=5, help="timed blocks of steady steps (about 0.2 s each) per "
                        "case; the healthy cases 4x; run time is the median block's time per step")
    parser.add_argument("--healthy-repeats", type=int, default=1,
                        help="run each healthy off/on pair this many times, alternating (default 1; one pair's "
                             "ratios vary by about 15%% from run to run on the H200)")
    parser.add_argument("--compile-threads", type=int, default=2,
                        help="TORCHINDUCTOR_COMPILE_THREADS per case (default 2: Inductor's worker pool, "
                             "without --jobs x cores workers)")
    parser.add_argument("--case-timeout", type=float, default=420, help="seconds before a case is killed")
    parser.add_argument("--dry-run", action="store_true", help="list the cases and run nothing")
    parser.add_argument("--report", type=Path, help="print the tables of an earlier results file and exit")
    args = parser.parse_args()
    if args.report:
        try:
            print_report(json.loads(args.report.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as error:
            print(f"--report {args.report}: not a results file of this script ({error})", file=sys.stderr)
            return 2
        return 0
    if min(args.jobs, args.blocks, args.compile_threads, args.healthy_repeats) < 1:
        parser.error("--jobs, --blocks, --healthy-repeats and --compile-threads must be at least 1")
    cases = _selected(build_cases(args.device, args.blocks, args.limit, args.healthy_repeats), args.only)
    if args.dry_run:
        for case in cases:
            print(f"{case.id:48} SMEMGUARD_MAX_SHARED={case.limit or '-':8} {json.dumps(case.spec)}")
        print(f"{len(cases)} cases")
        return 0
    if args.out is None:
        parser.error("--out DIR is required unless --dry-run or --report")
    if not cases:
        parser.error(f"--only {args.only!r} selects no case (--dry-run lists them)")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"meta": harness.meta(time=time.strftime("%H:%M UTC", time.gmtime()), jobs=args.jobs,
                                    compile_threads=args.compile_threads),
               "cases": []}
    # Healthy cases first, one at a time (a GPU shared with another process would time both): off, on, off, on.
    healthy = [case for case in cases if case.group == "healthy"]
    matrix = sorted((case for case in cases if case.group != "healthy"),
                    key=lambda case: (case.group != "reduction", -(case.spec["shape"][-1])))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="inductor-matrix-") as scratch:
        for batch, jobs in ((healthy, 1), (matrix, args.jobs)):
            with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
                futures = [pool.submit(run_case, case, Path(scratch), args.out, args.compile_threads,
                                       args.case_timeout) for case in batch]
                for future in concurrent.futures.as_completed(futures):
                    record = future.result()
                    results["cases"].append(record)
                    (args.out / RESULTS_NAME).write_text(json.dumps(results, indent=1))
                    print(f"[{len(results['cases'])}/{len(cases)} {time.perf_counter() - started:5.0f} s] "
                          f"{record['id']}: {record.get('outcome')} ({record['wall_s']:.0f} s) {_note(record)}",
                          flush=True)
    results["meta"]["wall_s"] = round(time.perf_counter() - started, 1)
    (args.out / RESULTS_NAME).write_text(json.dumps(results, indent=1))
    print_report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
