"""The ``smemguard`` command."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import sys
from pathlib import Path

from .._version import __version__
from ..facts import files, gpus, process, untrusted
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
CACHE_EXIT = """\
exit status: 0 done; 2 nothing done, or not all of it: the cache directory is unusable (a bad
SMEMGUARD_CACHE_DIR is never replaced by the default), a file is not a decision file, or some
entries cannot be applied (each named on stderr; show and export leave them out, import skips them).
clear and import act on the cache directory only; export writes FILE only.
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


def _cache_directory(args) -> tuple[Path | None, str | None]:
    """The cache directory to act on, or why there is none (nothing is touched then)."""
    from ..facts.settings import CACHE_DIR, USING_THE_DEFAULT

    if args.dir is not None:
        try:  # `--dir=~/x` reaches here unexpanded: the shell expands a ~ only at the start of a word
            directory = args.dir.expanduser()
            if directory.exists() and not directory.is_dir():
                return None, f"--dir {untrusted.printable(str(directory))} is a file, not a cache directory"
        except RuntimeError:  # ~user, and no such user
            return None, f"--dir {untrusted.printable(str(args.dir), 80)}: no such user's home directory"
        except OSError as error:  # a name too long for the file system
            return None, f"--dir {untrusted.printable(str(args.dir), 80)}: {error.strerror or error}"
        return directory, None
    problem = args.settings.problem_of(CACHE_DIR)
    if problem is not None:  # stated here alone: the settings report's "Using the default" is not true of a command
        return None, (f"{problem.removesuffix(USING_THE_DEFAULT)} Nothing was touched: a cache command never "
                      "uses the default cache in its place; fix the setting, or pass --dir DIR")
    if args.settings.cache_dir is None:
        return None, f"the decision cache is off ({CACHE_DIR}=off); pass --dir DIR"
    return args.settings.cache_dir, None


def _show(data: dict, path: Path, as_json: bool) -> None:
    from ..store import decision_cache

    entries = [entry for kind in decision_cache.KINDS for entry in data[kind].values()]
    if as_json:
        print(json.dumps(data, indent=1, sort_keys=True))
    elif not entries:
        print(f"no decisions in {untrusted.printable(str(path))}")
    else:
        print(f"{untrusted.counted(len(entries), 'decision')} in {untrusted.printable(str(path))}:")
        for entry in entries:
            print("  " + untrusted.printable(_entry_line(entry)))


def _entry_line(entry: dict) -> str:
    """One decision as ``cache show`` lists it; a field the entry lacks (an older or hand-written one) is left out."""
    where = " ".join(part for part in (
        str(entry.get("kernel") or "a kernel"), f"on {entry['gpu']}" if entry.get("gpu") else "",
        f"(limit {entry['limit']} B)" if entry.get("limit") is not None else "") if part)
    final = entry.get("final") or " ".join(f"{name}={entry[name]}" for name in ("num_stages", "num_warps")
                                           if name in entry)  # a pin's
    change = " ".join(str(part) for part in (entry.get("from_config"), "->", entry["action"], final) if part)
    return f"{where}: {change}"


def _cache(args) -> int:
    from ..store import decision_cache

    command = f"smemguard cache {args.action}"
    directory, refusal = _cache_directory(args)
    if refusal:
        print(f"{command}: {refusal}", file=sys.stderr)
        return 2
    store = decision_cache.Store(directory)
    shown_path = untrusted.printable(str(store.path))
    if args.action in ("clear", "import") and store.read_only:
        print(f"{command}: {untrusted.printable(str(directory))} is read-only: the decisions in it apply, but this "
              "command writes; nothing was changed", file=sys.stderr)
        return 2
    try:
        data, dropped = decision_cache.read(store.path)
    except ValueError as problem:
        print(f"{command}: {shown_path} is not a smemguard decision file ({problem}); nothing was changed. Fix: "
              "move it away (smemguard starts a new one), or point --dir / SMEMGUARD_CACHE_DIR elsewhere",
              file=sys.stderr)
        return 2
    except OSError as error:
        print(f"{command}: {_unreadable(store.path, error)}; nothing was changed", file=sys.stderr)
        return 2
    status = 0
    try:
        if args.action in ("show", "export"):
            for problem in dropped:
                print(f"{command}: {shown_path}: {problem}; left out", file=sys.stderr)
            if dropped:
                print(f"{command}: entries smemguard cannot apply: {len(dropped)}, listed above. The next process "
                      "that uses the cache moves the file aside and keeps the rest; 'smemguard cache clear' "
                      "forgets all", file=sys.stderr)
                status = 2
            if args.action == "show":
                _show(data, store.path, args.json)
                if store.read_only and not args.json:
                    print("(read-only: these apply; a new decision stays in the process that made it)")
            else:
                _export(Path(args.file), json.dumps(data, indent=1, sort_keys=True) + "\n")
                count = sum(len(data[kind]) for kind in decision_cache.KINDS)
                print(f"exported {untrusted.counted(count, 'decision')} from {shown_path} to "
                      f"{untrusted.printable(args.file)}")
        elif args.action == "clear":
            if not store.path.exists():
                print(f"no decisions in {shown_path}: nothing to forget")
            else:
                print(f"forgot {untrusted.counted(store.clear(), 'decision')} in {shown_path}" + (
                    f"; its {untrusted.counted(len(data['pins']), 'pin')} stay ('smemguard pin remove' takes them)"
                    if data["pins"] else ""))
        else:
            return _import(command, store, Path(args.file))
    except files.Refused as refusal:
        print(f"{command}: {untrusted.printable(str(refusal))}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"{command}: {error.strerror or error}" + (f": {untrusted.printable(str(error.filename))}"
                                                          if error.filename else ""), file=sys.stderr)
        return 2
    return status


def _pin(args) -> int:
    from . import pin

    return pin.run(args, *_cache_directory(args))


def _unreadable(path: Path, error: OSError) -> str:
    """One line saying why ``path`` could not be read (``error`` from :mod:`smemguard.facts.files`)."""
    if isinstance(error, files.Refused):
        return untrusted.printable(str(error))
    return f"cannot read {untrusted.printable(str(path))}: {error.strerror or error}"


def _export(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole (a temporary file renamed over it); a path that exists and is
    not a regular file is refused, never opened."""
    if path.exists() and not path.is_file():
        raise files.Refused(0, f"{path} is not a regular file; nothing exported")
    files.replace(path, text, mode=0o644)


def _import(command: str, store, source: Path) -> int:
    from ..store import decision_cache

    shown_source = untrusted.printable(str(source))
    try:
        raw = files.read_bytes(source, decision_cache.MAX_FILE)
    except OSError as error:
        print(f"{command}: {_unreadable(source, error)}; nothing imported", file=sys.stderr)
        return 2
    try:
        data, dropped = decision_cache.parse(raw)
    except ValueError as error:
        print(f"{command}: {shown_source} is not a smemguard decision file ({error}); nothing imported. Fix: "
              "export one with 'smemguard cache export FILE' on the host that learned the decisions",
              file=sys.stderr)
        return 2
    for problem in dropped:
        print(f"{command}: {shown_source}: {problem}; not imported", file=sys.stderr)
    try:
        added, present = store.merge(data)
    except decision_cache.FileTooLarge as error:
        print(f"{command}: not importing {shown_source} into {untrusted.printable(str(store.path))}: {error}; nothing "
              "imported. Fix: 'smemguard cache clear' first, or import into another --dir", file=sys.stderr)
        return 2
    print(f"imported {untrusted.counted(added, 'decision')} into {untrusted.printable(str(store.path))} ({present} "
          "already there, kept "
          "as they were)")
    if dropped:
        print(f"{command}: entries of {shown_source} not imported: {len(dropped)}, listed above. Fix: export "
              "them again from the host that learned them", file=sys.stderr)
        return 2
    return 0


@functools.lru_cache(maxsize=1)
def build_parser() -> argparse.ArgumentParser:
    """The command line (built once: parsing does not change it)."""
    parser = argparse.ArgumentParser(prog="smemguard", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"smemguard {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    from .check import add_check_command
    from .pin import add_pin_command
    from .run import add_run_command

    _add_demo_command(commands)
    _add_gpus_command(commands)
    _add_report_command(commands)
    _add_replay_command(commands)
    _add_cache_command(commands)
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


def _add_cache_command(commands) -> None:
    """Add ``cache``: show, clear, export or import this host's decisions."""
    cache = commands.add_parser(
        "cache", help="show, clear, export or import the decisions this host remembers",
        description="Decisions live in SMEMGUARD_CACHE_DIR/decisions.json and are shared by every process on the "
                    "host. Export them on a host that learned them and import them on the others, so no worker of "
                    "the fleet pays for the same overflow again. Every entry is checked when read and when "
                    "imported: one recovery could not apply is named and left out, never stored.",
        epilog=CACHE_EXIT, formatter_class=argparse.RawDescriptionHelpFormatter)
    cache.add_argument("action", choices=("show", "clear", "export", "import"))
    cache.add_argument("file", nargs="?", help="the JSON file to export to or import from")
    cache.add_argument("--dir", type=Path, help="cache directory (default: SMEMGUARD_CACHE_DIR)")
    cache.add_argument("--json", action="store_true", help="with show: the raw file")
    cache.set_defaults(run=_cache, cache_parser=cache)


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

