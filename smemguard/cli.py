"""The ``smemguard`` command."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

from . import __version__, gpus

DESCRIPTION = """\
smemguard keeps Triton kernels (and the vLLM workers running them) alive when a launch asks for
more shared memory per block than the GPU has. Run vLLM with VLLM_PLUGINS=smemguard, or call
smemguard.install() in your own program. These commands help you see what it does.
"""

EPILOG = """\
examples:
  smemguard demo                 reproduce an L4 overflow on this machine (no GPU needed) and recover it
  smemguard demo --gpu T4        the same against a T4's 65536-byte limit
  smemguard gpus                 the GPU names accepted by SMEMGUARD_MAX_SHARED and their limits
  smemguard check --examples --gpu L4,A100,H100   which configs of the example kernels overflow which GPU
  smemguard report rank*.jsonl   what happened overnight: kernels, GPUs, counts, actions
  smemguard report --format prometheus rank*.jsonl   the same as the series smemguard exports to /metrics
  smemguard replay incidents.jsonl --index 3   rebuild record 3's launch and run it again
  smemguard cache show           the decisions this host remembers

settings (environment): SMEMGUARD=on|off|observe|strict, SMEMGUARD_MAX_SHARED=<bytes|GPU>,
SMEMGUARD_LOG=<incidents.jsonl>, SMEMGUARD_CACHE_DIR=<dir|off>, SMEMGUARD_METRICS_FILE=<file.prom>.
See the README.
"""


def _gpus(args) -> int:
    rows = [(g.name, ", ".join(g.aliases) or "-", g.arch, str(g.max_shared)) for g in gpus.GPUS]
    if args.json:
        print(json.dumps([{"name": g.name, "aliases": list(g.aliases), "arch": g.arch, "max_shared": g.max_shared}
                          for g in gpus.GPUS], indent=2))
        return 0
    header = ("GPU", "aliases", "arch", "bytes/block")
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(4)]
    for row in (header, *rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def _step(text: str) -> float:
    print(text, flush=True)
    return time.perf_counter()


def _done(started: float, result: str) -> None:
    print(f"   -> {result} ({time.perf_counter() - started:.1f} s)", flush=True)


def _demo(args) -> int:
    gpu = gpus.lookup(args.gpu)
    if gpu is None or gpu.capability is None:
        print(f"smemguard demo: {args.gpu!r} is not an NVIDIA GPU from 'smemguard gpus'", file=sys.stderr)
        return 2
    import torch
    import triton
    from triton.runtime.errors import OutOfResources

    import smemguard
    from .examples import autotuned_matmul, matmul_args, tiled_grid
    from .settings import Settings
    from .testing import fake_gpu

    # Tiles sized for the demo GPU: the widest 4-stage config fits misaligned views but not aligned ones.
    tile = 128 if gpu.max_shared > 80000 else 64
    configs = [triton.Config(dict(BLOCK_M=tile, BLOCK_N=tile, BLOCK_K=64), num_stages=5, num_warps=4),
               triton.Config(dict(BLOCK_M=tile // 2, BLOCK_N=tile // 2, BLOCK_K=32), num_stages=2, num_warps=4)]
    n = 512
    storage = torch.empty(n * n + 8, dtype=torch.float16)
    aligned, misaligned = storage[: n * n].view(n, n), storage[1: n * n + 1].view(n, n)
    b, c = torch.empty(n, n, dtype=torch.float16), torch.empty(n, n, dtype=torch.float16)
    grid = tiled_grid(n, n)
    print(f"smemguard {__version__} demo: Triton {triton.__version__} compiles for a stand-in {gpu.name} "
          f"({gpu.arch}, {gpu.max_shared} B of shared memory per block); no kernel executes.\n")
    incidents = Path(tempfile.mkdtemp(prefix="smemguard-demo-")) / "incidents.jsonl"
    with fake_gpu(gpu.name) as device:
        tuned = autotuned_matmul(configs)
        # The fastest-looking config is the big one, as it would be on the GPU it was tuned for.
        timings = iter([1.0, 2.0])
        device.bench_ms = lambda: next(timings)
        started = _step(f"1. autotune a {n}x{n} fp16 matmul over {len(configs)} configs on misaligned views")
        tuned[grid](*matmul_args(misaligned, b, c))
        won = device.launches[-1]
        _done(started, f"winner {tile}x{tile}x64, {won.num_stages} stages, {won.shared} B")

        started = _step("2. the same shape with 16-byte-aligned tensors, without smemguard")
        try:
            tuned[grid](*matmul_args(aligned, b, c))
            _done(started, "it fit: nothing to show on this GPU")
            return 1
        except OutOfResources as error:
            _done(started, f"OutOfResources: {error.name}, Required: {error.required}, Hardware limit: {error.limit}")

        smemguard.install(Settings(log_path=incidents))
        try:
            started = _step("3. the same launch with smemguard installed")
            tuned[grid](*matmul_args(aligned, b, c))
            fixed = device.launches[-1]
            _done(started, f"ran with {fixed.num_stages} stages, {fixed.shared} B, grid {fixed.grid}")

            started = _step("4. again (remembered: no exception, no compile)")
            tuned[grid](*matmul_args(aligned, b, c))
            _done(started, f"ran with {device.launches[-1].num_stages} stages")
        finally:
            smemguard.uninstall()
    record = json.loads(incidents.read_text().splitlines()[0])
    print(f"\nincident record ({incidents}):")
    for field in ("kernel", "resource", "required", "limit_hit", "config", "action", "final", "recovery_ms"):
        print(f"  {field:12} {record[field]}")
    print(f"  {'attempts':12} " + "; ".join(f"{a.get('changes') or a['config'].split()[-1]}: {a['required']} B"
                                            for a in record["attempts"]))
    return 0


def _report(args) -> int:
    from . import report

    try:
        since = report.parse_since(args.since) if args.since else None
    except ValueError as error:
        print(f"smemguard report: {error}", file=sys.stderr)
        return 2
    malformed: list = []
    records = report.read(args.files, malformed)
    if args.format == "prometheus" and importlib.util.find_spec("prometheus_client") is None:
        print("smemguard report: --format prometheus needs prometheus_client. Fix: pip install 'smemguard[metrics]'",
              file=sys.stderr)
        return 2
    if args.format == "prometheus":
        print(report.format_prometheus(records, kernel=args.kernel, since=since), end="")
    elif args.json or args.format == "json":
        rows = report.summarize(records, kernel=args.kernel, since=since)
        print(json.dumps({"rows": [row.as_json() for row in rows],
                          "malformed": [vars(m) for m in malformed]}, indent=2))
        return 0
    else:
        rows = report.summarize(records, kernel=args.kernel, since=since)
        print(report.format_table(rows) if rows else "no incident records" + (" matching the filters" if
                                                                              args.kernel or since else ""))
    for bad in malformed:
        where = f"{bad.path}:{bad.line}" if bad.line else bad.path
        print(f"skipped {where}: {bad.reason}", file=sys.stderr)
    if malformed:
        print(f"{len(malformed)} malformed line(s) skipped", file=sys.stderr)
    return 0


def _replay(args) -> int:
    from . import replay
    from .settings import parse_max_shared

    try:
        limit = parse_max_shared(args.limit)[0] if args.limit else None
        record = replay.load(args.file, index=args.index, kernel=args.kernel)
        return replay.replay(record, limit, print)
    except (ValueError, OSError, replay.ReplayError) as error:
        print(f"smemguard replay: {error}", file=sys.stderr)
        return 2


def _cache(args) -> int:
    from . import decisions
    from .settings import current

    directory = args.dir or current().cache_dir
    if directory is None:
        print("smemguard cache: the decision cache is off (SMEMGUARD_CACHE_DIR=off); pass --dir", file=sys.stderr)
        return 2
    store = decisions.Store(Path(directory))
    try:
        if args.action == "show":
            data = store.snapshot()
            entries = [(kind, entry) for kind in decisions.KINDS for entry in data[kind].values()]
            if args.json:
                print(json.dumps(data, indent=1, sort_keys=True))
            elif not entries:
                print(f"no decisions in {store.path}")
            else:
                print(f"{len(entries)} decisions in {store.path}:")
                for kind, entry in entries:
                    print(f"  {entry.get('kernel')} on {entry.get('gpu')} (limit {entry.get('limit')} B): "
                          f"{entry.get('from_config')} -> {entry.get('action')} {entry.get('final') or ''}".rstrip())
        elif args.action == "clear":
            print(f"forgot {store.clear()} decisions in {store.path}")
        elif args.action == "export":
            Path(args.file).write_text(json.dumps(store.snapshot(), indent=1, sort_keys=True))
            print(f"exported {store.path} to {args.file}")
        else:
            try:
                incoming = json.loads(Path(args.file).read_text())
                added, present = store.merge(incoming)
            except ValueError as error:
                print(f"smemguard cache import: {args.file} is not a smemguard decision file ({error})", file=sys.stderr)
                return 2
            print(f"imported {added} decisions into {store.path} ({present} already there, kept as they were)")
    except OSError as error:
        print(f"smemguard cache: {error}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="smemguard", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"smemguard {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser("demo", help="reproduce a small GPU's overflow here (no GPU needed) and recover it",
                               description="Autotunes an example matmul on misaligned views, then launches it on "
                                           "aligned tensors of the same shape: the winner overflows, first without "
                                           "smemguard, then recovered by it. Triton compiles for real; the "
                                           "stand-in GPU executes nothing.")
    demo.add_argument("--gpu", default="L4", help="NVIDIA GPU to stand in for (default: L4; see 'smemguard gpus')")
    demo.set_defaults(run=_demo)
    table = commands.add_parser("gpus", help="list the GPUs smemguard knows and their per-block shared-memory limits",
                                description="The per-block opt-in shared-memory limit Triton checks, per GPU. Any "
                                            "name or alias is accepted by SMEMGUARD_MAX_SHARED.")
    table.add_argument("--json", action="store_true", help="machine-readable output")
    table.set_defaults(run=_gpus)

    summary = commands.add_parser(
        "report", help="summarize incident records: which kernels overflowed where, and what was done",
        description="Reads the JSON-lines incident files written with SMEMGUARD_LOG (several files, e.g. one per "
                    "rank; gzip is fine) and prints one row per kernel, resource and GPU: count, distinct shapes, "
                    "actions taken, first and last seen, time spent recovering. Malformed lines are skipped and "
                    "listed with their line numbers.")
    summary.add_argument("files", nargs="+", type=Path, metavar="FILE", help="incident files (.jsonl or .jsonl.gz)")
    summary.add_argument("--kernel", help="only kernels whose module:name contains this text")
    summary.add_argument("--since", help="only incidents since a date (2026-11-30), a time (2026-11-30T08:00) or "
                                         "a duration back from now (90m, 6h, 2d)")
    output = summary.add_mutually_exclusive_group()
    output.add_argument("--format", choices=("table", "json", "prometheus"), default="table",
                        help="table (default); json; prometheus: the series smemguard exports to /metrics, counted "
                             "from the records, in Prometheus' text format (needs smemguard[metrics])")
    output.add_argument("--json", action="store_true", help="the same as --format json")
    summary.set_defaults(run=_report)

    again = commands.add_parser(
        "replay", help="rebuild a recorded launch from its incident record and run it again",
        description="Imports the recorded kernel, builds tensors with the recorded shapes, strides, dtypes and "
                    "alignment (random values), and launches the recorded config with the recorded grid. On a GPU: "
                    "reproduces the OutOfResources under the recorded limit (emulated), shows what smemguard does, "
                    "and checks the recovered output against the original config run without emulation. Without a "
                    "GPU: compiles for the recorded arch and prints the bytes each candidate needs.")
    again.add_argument("file", type=Path, metavar="FILE", help="incident file (.jsonl or .jsonl.gz)")
    which = again.add_mutually_exclusive_group()
    which.add_argument("--index", type=int, help="which record (0-based; negative counts from the end; default: last)")
    which.add_argument("--kernel", help="the last record whose kernel contains this text")
    again.add_argument("--limit", help="limit to reproduce against, bytes or a GPU name (default: the recorded one)")
    again.set_defaults(run=_replay)

    cache = commands.add_parser(
        "cache", help="show, clear, export or import the decisions this host remembers",
        description="Decisions live in SMEMGUARD_CACHE_DIR/decisions.json and are shared by every process on the "
                    "host. Export them on a host that learned them and import them on the others, so no worker of "
                    "the fleet pays for the same overflow again.")
    cache.add_argument("action", choices=("show", "clear", "export", "import"))
    cache.add_argument("file", nargs="?", help="the JSON file to export to or import from")
    cache.add_argument("--dir", type=Path, help="cache directory (default: SMEMGUARD_CACHE_DIR)")
    cache.add_argument("--json", action="store_true", help="with show: the raw file")
    cache.set_defaults(run=_cache)

    from .cli_check import add_check_command

    add_check_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "cache" and args.action in ("export", "import") and not args.file:
        parser.error(f"cache {args.action} needs a FILE")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
