"""The ``smemguard`` command."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import sys
from pathlib import Path

from .._version import __version__
from ..facts import gpus, process, untrusted
from . import stdout

DESCRIPTION = """\
smemguard keeps Triton kernels (and the vLLM workers running them) alive when a launch asks for
more shared memory per block than the GPU has. Run vLLM with VLLM_PLUGINS=smemguard, call
smemguard.install() in your own program, or start any program with 'smemguard run -- CMD'. The
other commands help you see what it does.
"""

EPILOG = """\
examples:
  smemguard demo                 reproduce an L4 overflow on this machine (no GPU needed) and recover it
  smemguard demo --gpu T4        a T4's 65536-byte limit, against a config tuned on an A100
  smemguard demo --gpu MI300X    the same trap on an AMD MI300X's 65536 bytes of LDS (Triton's HIP backend)
  smemguard gpus                 the GPU names accepted by SMEMGUARD_MAX_SHARED and their limits
  smemguard check --examples --gpu L4,A100,H100   which configs of the example kernels overflow which GPU
  smemguard report rank*.jsonl   what happened overnight: kernels, GPUs, counts, actions
  smemguard report --format prometheus rank*.jsonl   the same as the series smemguard exports to /metrics
  smemguard replay incidents.jsonl --index 3   rebuild record 3's launch and run it again
  smemguard cache show           the decisions this host remembers
  smemguard pin add my.kernels:matmul --gpu L4 --num-stages 2   compile that kernel with at most 2 stages on an L4
  smemguard run -- python train.py   guard a program and every Python process it starts, no code change

settings (environment): SMEMGUARD=on|off|observe|strict, SMEMGUARD_MAX_SHARED=<bytes|GPU>,
SMEMGUARD_LOG=<incidents.jsonl>, SMEMGUARD_CACHE_DIR=<dir|off>, SMEMGUARD_METRICS_FILE=<file.prom>,
SMEMGUARD_DISABLE=<patch,...> (the names 'smemguard versions' lists), SMEMGUARD_EMULATE_PROPERTIES=0 (under
SMEMGUARD_MAX_SHARED, torch and vLLM report the device's own shared memory and name), SMEMGUARD_PINS=<pins.json>.
See the README. Every command reports a malformed setting in one line on stderr, as install() does; with
SMEMGUARD=strict it then stops (2).

exit status (every command): 0 done; 1 a finding (check: a kernel has no fitting config on some GPU;
replay: the record did not replay as recorded); 2 bad input: a usage error, a missing or unreadable
file, malformed lines or entries (named on stderr, the rest still used), a setting in strict mode.
"""

# The exit statuses, per command, for its --help.
REPORT_EXIT = """\
exit status: 0 every line was used; 2 a FILE is missing, unreadable or read only in part (reading
stops after 4 GiB, gunzipped, or a million lines that are not blank: one line says where), or some
lines (or fields) could not be used: the first 20 are named on stderr with their line numbers, the
others counted in one line, and the table counts the rest; records of another schema than 1 are
skipped, counted in one line per file.
"""
REPLAY_EXIT = """\
exit status: 0 reproduced and recovered as recorded (or the recorded config fits: nothing to
reproduce); 1 not as recorded (different bytes, not reproduced on the GPU, not recovered, output
mismatch); 2 the record cannot be replayed here (missing file or record, a field replay cannot
use: each named).
"""
DEMO_EXIT = """\
exit status: 0 shown; 2 --gpu is not a GPU from 'smemguard gpus', or this Triton cannot compile for
that AMD GPU here (Triton 3.4 needs an ld.lld: the line says which). Honours SMEMGUARD (off,
observe) and SMEMGUARD_LOG (the record is appended there, else written to a temporary file removed
at the end); decisions stay in memory, never in SMEMGUARD_CACHE_DIR.
"""
GPUS_EXIT = "exit status: 0.\n"
VERSIONS_EXIT = "exit status: 0.\n"


def _gpus(args) -> int:
    from ..facts import versions

    triton = versions.installed("triton")
    problems = {gpu.name: gpus.compile_problem(gpu.arch, triton) for gpu in gpus.GPUS}
    if args.json:
        print(json.dumps([{"name": g.name, "aliases": list(g.aliases), "arch": g.arch, "max_shared": g.max_shared,
                           "shared_per_sm": g.shared_per_sm, "tensor_memory": g.tensor_memory,
                           "compile_problem": problems[g.name]} for g in gpus.GPUS], indent=2))
        return 0
    rows = [(g.name + ("*" if problems[g.name] else ""), ", ".join(g.aliases) or "-", g.arch, str(g.max_shared),
             str(g.shared_per_sm or "-"), str(g.tensor_memory or "-")) for g in gpus.GPUS]
    header = ("GPU", "aliases", "arch", "bytes/block", "bytes/SM", "tensor memory (columns)")
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    for problem in dict.fromkeys(problem for problem in problems.values() if problem):
        print(f"* {problem}: check, demo and fake_gpu refuse these GPUs here")
    return 0


def _demo(args) -> int:
    from . import demo

    return demo.run(args.gpu, args.settings)


def _report(args) -> int:
    from . import report

    try:
        since = report.parse_since(args.since) if args.since else None
    except ValueError as error:
        print(f"smemguard report: {error}", file=sys.stderr)
        return 2
    problems = report.Problems()
    records = report.read(args.files, problems)
    if args.format == "prometheus" and importlib.util.find_spec("prometheus_client") is None:
        print("smemguard report: --format prometheus needs prometheus_client. Fix: pip install 'smemguard[metrics]'",
              file=sys.stderr)
        return 2
    if args.format == "prometheus":
        print(report.format_prometheus(records, kernel=args.kernel, since=since), end="")
    elif args.json or args.format == "json":
        rows = report.summarize(records, kernel=args.kernel, since=since)
        print(json.dumps({"rows": [row.as_json() for row in rows], **problems.as_json()}, indent=2))
    else:
        rows = report.summarize(records, kernel=args.kernel, since=since)
        print(report.format_table(rows) if rows else "no incident records" + (" matching the filters" if
                                                                              args.kernel or since else ""))
    for line in problems.text("the report counts the rest. Fix or delete them (a line cut short is usually from a "
                              "process killed while writing it)."):
        print(f"smemguard report: {line}", file=sys.stderr)
    return 2 if problems else 0


def _replay(args) -> int:
    from ..facts.settings import parse_max_shared
    from . import replay, report

    try:
        limit = parse_max_shared(args.limit)[0] if args.limit else None
    except ValueError as error:
        print(f"smemguard replay: --limit {args.limit!r}: {error}", file=sys.stderr)
        return 2
    problems = report.Problems()
    try:
        found = replay.load(args.file, problems, index=args.index, kernel=args.kernel)
    except replay.ReplayError as error:
        found, failure = None, error
    for line in problems.text("not counted by --index", files=found is not None):  # else the failure says why
        print(f"smemguard replay: {line}", file=sys.stderr)
    if found is None:
        print(f"smemguard replay: {failure}", file=sys.stderr)
        return 2
    try:
        return replay.replay(found.fields, limit, print)
    except replay.ReplayError as error:
        print(f"smemguard replay: {untrusted.printable(found.path)}:{found.line}: {error}", file=sys.stderr)
        print("smemguard replay: fix: replay another record (--index N, --kernel TEXT), or correct that line",
              file=sys.stderr)
        return 2


def _pin(args) -> int:
    from . import cache, pin

    return pin.run(args, *cache.cache_directory(args))


@functools.lru_cache(maxsize=1)
def build_parser() -> argparse.ArgumentParser:
    """The command line (built once: parsing does not change it)."""
    parser = argparse.ArgumentParser(prog="smemguard", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"smemguard {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    from .cache import add_cache_command
    from .check import add_check_command
    from .pin import add_pin_command
    from .run import add_run_command

    _add_demo_command(commands)
    _add_gpus_command(commands)
    _add_report_command(commands)
    _add_replay_command(commands)
    add_cache_command(commands)
    add_pin_command(commands, _pin)
    _add_versions_command(commands)
    add_check_command(commands)
    add_run_command(commands)
    return parser


def _add_demo_command(commands) -> None:
    """Add ``demo``: reproduce an overflow on a stand-in GPU, then recover it."""
    demo = commands.add_parser("demo", help="reproduce a small GPU's overflow here (no GPU needed) and recover it",
                               description="Autotunes an example matmul on misaligned views, then launches it on "
                                           "aligned tensors of the same shape: the winner overflows, first without "
                                           "smemguard, then recovered by it. Where alignment does not change the "
                                           "bytes, a config tuned on a bigger GPU is launched instead: tuned on an "
                                           "A100 for the V100 and the T4 (no multi-buffered loads), on an H100 "
                                           "for the MI350X/MI355X and the RX7900XTX/W7900 (their misaligned loads "
                                           "are pipelined too). Triton compiles for real (NVIDIA to PTX, AMD "
                                           "through its HIP backend); the stand-in GPU executes nothing.",
                               epilog=DEMO_EXIT, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_argument("--gpu", default="L4", help="GPU to stand in for (default: L4; any GPU of 'smemguard gpus', "
                                                  "NVIDIA or AMD)")
    demo.set_defaults(run=_demo)


def _add_gpus_command(commands) -> None:
    """Add ``gpus``: the GPUs smemguard knows and their limits."""
    table = commands.add_parser("gpus", help="list the GPUs smemguard knows and their per-block shared-memory limits",
                                description="The per-block opt-in shared-memory limit Triton checks, per GPU, the "
                                            "shared memory per SM (NVIDIA) and the tensor-memory columns a block may "
                                            "use (sm_100 family and Rubin). Any name or alias is accepted by "
                                            "SMEMGUARD_MAX_SHARED, check --gpu and demo --gpu; a GPU marked * is one "
                                            "the installed Triton cannot compile for (the line under the table says "
                                            "why).", epilog=GPUS_EXIT)
    table.add_argument("--json", action="store_true", help="machine-readable output")
    table.set_defaults(run=_gpus)


def _add_report_command(commands) -> None:
    """Add ``report``: summarize incident records."""
    summary = commands.add_parser(
        "report", help="summarize incident records: which kernels overflowed where, and what was done",
        description="Reads the JSON-lines incident files written with SMEMGUARD_LOG (several files, e.g. one per "
                    "rank; gzip is fine) and prints one row per kernel, resource and GPU: count, distinct shapes, "
                    "actions taken, first and last seen, time spent recovering. A line that is not a record is "
                    "skipped, a field of the wrong type left out, each listed on stderr with its line number.",
        epilog=REPORT_EXIT, formatter_class=argparse.RawDescriptionHelpFormatter)
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


def _add_replay_command(commands) -> None:
    """Add ``replay``: run a recorded launch again."""
    again = commands.add_parser(
        "replay", help="rebuild a recorded launch from its incident record and run it again",
        description="Imports the recorded kernel, builds tensors with the recorded shapes, strides, dtypes and "
                    "alignment (random values), and launches the recorded config with the recorded grid. On a GPU: "
                    "reproduces the OutOfResources under the recorded limit (emulated), shows what smemguard does, "
                    "and checks the recovered output against the original config run without emulation. Without a "
                    "GPU: compiles for the recorded arch (NVIDIA or AMD) and prints the bytes each candidate needs. "
                    "The record is checked first: each field replay cannot use is named. The record names the "
                    "module replay imports, and importing a module runs its code: replay only records you trust "
                    "as you would their code.",
        epilog=REPLAY_EXIT, formatter_class=argparse.RawDescriptionHelpFormatter)
    again.add_argument("file", type=Path, metavar="FILE", help="incident file (.jsonl or .jsonl.gz)")
    which = again.add_mutually_exclusive_group()
    which.add_argument("--index", type=int, help="which record (0-based; negative counts from the end; default: last)")
    which.add_argument("--kernel", help="the last record whose kernel contains this text")
    again.add_argument("--limit", help="limit to reproduce against, bytes or a GPU name (default: the recorded one)")
    again.set_defaults(run=_replay)


def _add_versions_command(commands) -> None:
    """Add ``versions``: which patches apply to the releases installed here."""
    checked = commands.add_parser(
        "versions", help="which patches apply here: the releases each was checked against, and yours",
        description="Each patch smemguard can apply, the package it patches, the oldest release read (older ones "
                    "are refused), the newest release checked and the version installed here. Newer releases "
                    "than the newest checked are patched unverified: the patch applies when its own checks pass "
                    "(one info line; records say verified: false), and SMEMGUARD=strict refuses it. Nothing of "
                    "the patched packages is imported.", epilog=VERSIONS_EXIT,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    checked.add_argument("--markdown", action="store_true", help="the README's table of supported versions")
    checked.set_defaults(run=_versions)


def _versions(args) -> int:
    from .. import patches
    from ..facts import versions

    rows = versions.patch_versions(patches.all_patches())
    print(versions.markdown(rows) if args.markdown else versions.table_text(rows))
    return 0


def _report_settings(settings, stated_by_the_command: tuple[str, ...] = ()) -> bool:
    """Print each settings problem as install() logs it, but those of the variables the command states in its own
    refusal; False when strict mode stops here."""
    from ..guard import settings_problems

    problems = settings_problems(settings)
    strict_stops = bool(problems) and settings.mode == "strict"
    if not strict_stops:  # the command runs, and states its own variables' problems itself
        problems = [problem for problem in problems
                    if not problem.startswith(tuple(f"{var}=" for var in stated_by_the_command))]
    for problem in problems:
        print(f"smemguard: {untrusted.printable(problem)}", file=sys.stderr)
    if strict_stops:
        print("smemguard: SMEMGUARD=strict: stopping on the settings problem(s) above", file=sys.stderr)
        return False
    return True


#: The longest argument a command takes: a path (PATH_MAX on Linux), a list of GPUs, a config.
MAX_ARGUMENT = 4096


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"] and argv[1:2] not in (["-h"], ["--help"]):
        # Not through argparse: CMD's own options must stay CMD's, and argparse's handling of "--" before
        # a REMAINDER differs between Python versions. Nor are the settings reported here: each process
        # of CMD reports them as it installs, and a bad one must not stop CMD.
        from . import run

        return run.main(argv[1:])
    too_long = next((arg for arg in argv if len(arg) > MAX_ARGUMENT), None)
    if too_long is not None:  # a mistake (a pasted file?), never echoed whole by argparse or a command
        print(f"smemguard: an argument of {len(too_long)} characters ({untrusted.printable(too_long, 40)}): no path, "
              f"name or value smemguard takes is longer than {MAX_ARGUMENT}; nothing done", file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "cache" and args.action in ("export", "import") and not args.file:
        args.cache_parser.error(f"cache {args.action} needs a FILE")  # its own usage, not the top level's
    from ..facts import settings

    args.settings = settings.load()
    if not _report_settings(args.settings, (settings.CACHE_DIR,) if args.command in ("cache", "pin") else ()):
        return 2
    try:
        with process.quiet_warnings(), stdout.until_the_reader_leaves():  # what the command imports and compiles
            return args.run(args)
    except KeyboardInterrupt:
        print(f"smemguard {args.command}: interrupted", file=sys.stderr)
        return 130
    except stdout.ReaderLeft:  # `smemguard cache show | head -1`: nothing more to say
        stdout.discard_the_rest()
        return 0

