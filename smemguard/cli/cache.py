"""``smemguard cache``: show, clear, export or import the decisions this host remembers (the decision cache,
:mod:`smemguard.store.decision_cache`), and the cache directory every command that reads it names."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..facts import files, untrusted

CACHE_EXIT = """\
exit status: 0 done; 2 nothing done, or not all of it: the cache directory is unusable (a bad
SMEMGUARD_CACHE_DIR is never replaced by the default), a file is not a decision file, or some
entries cannot be applied (each named on stderr; show and export leave them out, import skips them).
clear and import act on the cache directory only; export writes FILE only.
"""

def add_cache_command(commands) -> None:
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
    cache.set_defaults(run=run, cache_parser=cache)


def cache_directory(args) -> tuple[Path | None, str | None]:
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


def run(args) -> int:
    from ..store import decision_cache

    command = f"smemguard cache {args.action}"
    directory, refusal = cache_directory(args)
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
