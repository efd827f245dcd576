"""``smemguard pin add|list|remove``: the options a kernel compiles with on a GPU, kept in the decision cache
(:mod:`smemguard.facts.pins` says what a pin is, :mod:`smemguard.engine.pins` where it applies)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..facts import files, pins, untrusted
from ..facts.settings import PINS
from ..store.decision import PINNED

HELP = "pin the num_stages / num_warps a kernel compiles with on a GPU: add, list, remove"

DESCRIPTION = f"""\
A pin says which options a kernel compiles with on a GPU, before anything is compiled: no
OutOfResources, no compile wasted on a variant that does not fit, and the operator's choice over
smemguard's own. It names the kernel by its module:name as records and 'smemguard report' show it
(a glob allowed: 'vllm.*:fused_moe_kernel'), the GPU by name ('smemguard gpus'), by arch (sm_89,
gfx942) or by per-block limit in bytes (101376), and num_stages, num_warps or both.

A pin is a ceiling: a compile that asks for more stages (or warps) gets the pin's count, one that
asks for as few is compiled as asked. Only the launch options are pinned, which change no result
(the same tiles, the same grid, the same answer bitwise); a tile is never pinned, since a caller
may compute its grid from it: smaller tiles come from the kernel's autotune configs,
smemguard.register_alternatives or a wrapper declared with smemguard.rerun_on_overflow. A pin is
refused, with one line, where the kernel computes with a parameter named like the option, or where
the pinned variant needs more shared memory than the GPU has: the kernel is then compiled as without
it. Each pin that applies writes one incident record per process (action "pinned", never paging).

Pins live in the decision cache (SMEMGUARD_CACHE_DIR/decisions.json, shared by every process of the
host; 'smemguard cache export' and 'import' carry them to a fleet; 'cache clear' keeps them), and
in the JSON file {PINS} names, in the format 'pin list --json' prints; the file's pin wins where both
pin the same kernel and GPU. 'smemguard check' shows what each pin does on each GPU it checks.
"""

EPILOG = f"""\
examples:
  smemguard pin add smemguard.examples:matmul_kernel --gpu L4 --num-stages 2
      the example matmul compiles with at most 2 stages on an L4
  smemguard pin add 'vllm.*:fused_moe_kernel' --gpu sm_89 --num-stages 3 --num-warps 4
  smemguard pin list
  smemguard pin list --json > pins.json; {PINS}=$PWD/pins.json vllm serve ...
  smemguard pin remove 'vllm.*:fused_moe_kernel' --gpu sm_89

exit status: 0 done; 2 nothing done, or not all of it: a pin that is not one (each problem in one
line), no such pin to remove, a cache directory that is unusable, read-only or off (pass --dir), a
decision file that is not smemguard's, or pins of the cache that are no pins (named, left out).
"""

def add_pin_command(commands, run) -> argparse.ArgumentParser:
    """Add ``pin`` to an argparse subparsers object; ``run(args)`` runs the parsed command."""
    parser = commands.add_parser("pin", help=HELP, description=DESCRIPTION, epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for action, what in (("add", "pin the options a kernel compiles with on a GPU (replacing its pin there)"),
                         ("list", "the pins in force: the decision cache's and the SMEMGUARD_PINS file's"),
                         ("remove", "remove the decision cache's pin of a kernel on a GPU")):
        sub = actions.add_parser(action, help=what, description=what, epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        if action != "list":
            sub.add_argument("kernel", metavar="KERNEL", help="the kernel's module:name, a glob allowed")
            sub.add_argument("--gpu", required=True, help="a GPU of 'smemguard gpus' (L4), an arch (sm_89, gfx942) "
                                                          "or a per-block limit in bytes (101376)")
        if action == "add":
            sub.add_argument("--num-stages", type=int, metavar="N", help="at most N pipeline stages (1 to 32)")
            sub.add_argument("--num-warps", type=int, metavar="N", help="at most N warps (a power of two, 1 to 32)")
        if action == "list":
            sub.add_argument("--json", action="store_true", help="the pins in force as a SMEMGUARD_PINS file")
        sub.add_argument("--dir", type=Path, help="cache directory (default: SMEMGUARD_CACHE_DIR)")
        sub.set_defaults(run=run)
    return parser


def run(args, directory: Path | None, refusal: str | None) -> int:
    """``smemguard pin ACTION`` on the decision cache in ``directory`` (None: ``refusal`` says why there is none)."""
    command = f"smemguard pin {args.action}"
    if args.action == "list":
        return _list(command, args, directory, refusal)
    entry = {"kernel": args.kernel, "gpu": args.gpu}
    if args.action == "add":
        entry.update({name: value for name, value in (("num_stages", args.num_stages), ("num_warps", args.num_warps))
                      if value is not None})
    named = entry if args.action == "add" else {**entry, "num_stages": 1}  # a pin to remove is named, not set
    found = pins.problems(named)
    if found:
        for problem in found:
            print(f"{command}: {untrusted.printable(problem)}", file=sys.stderr)
        return 2
    if refusal is not None:
        print(f"{command}: {refusal}; nothing was changed", file=sys.stderr)
        return 2
    from ..store import decision_cache

    store = decision_cache.Store(directory)
    if store.read_only:
        print(f"{command}: {untrusted.printable(str(directory))} is read-only: its pins apply, but this command "
              "writes; nothing was changed", file=sys.stderr)
        return 2
    pin = pins.of(named, pins.CACHE_ORIGIN)
    try:
        decision_cache.read(store.path)  # a file that is not smemguard's is refused, never moved aside or rewritten
        before = store.edit("pins", pin.table_key, None if args.action == "remove" else {
            **pin.entry(), "action": PINNED, **decision_cache.provenance()})
    except (OSError, ValueError) as error:
        print(f"{command}: {_problem(store.path, error)}; nothing was changed", file=sys.stderr)
        return 2
    return _said(command, args.action, pin, before, store.path, args.settings)


def _said(command: str, action: str, pin: pins.Pin, before: dict | None, path: Path, settings) -> int:
    """What ``pin add`` or ``remove`` did, in a line (and the file's pin of the same kernel and GPU, which wins)."""
    shown_path = untrusted.printable(str(path))
    where = f"{untrusted.printable(pin.kernel)} on {pin.gpu}"
    if action == "remove" and before is None:
        print(f"{command}: no pin of {where} in {shown_path}; nothing was changed", file=sys.stderr)
        return 2
    if action == "remove":
        print(f"removed the pin of {where} ({pins.of(before, pins.CACHE_ORIGIN).options_text()}) from {shown_path}")
    else:
        replaced = f", replacing {pins.of(before, pins.CACHE_ORIGIN).options_text()}" if before is not None else ""
        print(f"pinned {where}: {pin.options_text()} in {shown_path}{replaced}")
    declared = next((declared for declared in settings.pins if declared.key == pin.key), None)
    if declared is not None:
        print(f"note: {PINS} pins {where} too ({declared.options_text()}): its pin wins while it does")
    return 0


def _problem(path: Path, error: Exception) -> str:
    shown_path = untrusted.printable(str(path))
    if isinstance(error, files.Refused):
        return untrusted.printable(str(error))
    if isinstance(error, OSError):
        return f"cannot use {shown_path}: {error.strerror or error}"
    return f"{shown_path} is not a smemguard decision file ({untrusted.printable(str(error))})"


def stored_pins(directory: Path, command: str) -> tuple[list[pins.Pin], bool]:
    """The pins of the decision cache in ``directory``, read without a lock and changing nothing; what is left out
    (each pin that is no pin, or the file) is named on stderr, one line each. (the pins, whether nothing was)."""
    from ..store import decision_cache

    path = directory / decision_cache.FILE_NAME
    try:
        data, dropped = decision_cache.read(path)
    except (OSError, ValueError) as error:
        print(f"{command}: {_problem(path, error)}; its pins are left out", file=sys.stderr)
        return [], False
    left_out = [line for line in dropped if line.startswith("pins ")]
    for problem in left_out:
        print(f"{command}: {untrusted.printable(str(path))}: {untrusted.printable(problem)}; left out",
              file=sys.stderr)
    return [pins.of(entry, f"{pins.CACHE_ORIGIN}, {path}") for entry in data["pins"].values()], not left_out


def pins_in_force(settings, command: str, from_cache: bool = True) -> tuple[pins.Pin, ...]:
    """The pins a process with ``settings`` applies (what ``smemguard check`` shows); ``from_cache`` False: the
    ``SMEMGUARD_PINS`` file's only (the caller said already why the cache is not read)."""
    stored = stored_pins(settings.cache_dir, command)[0] if settings.cache_dir is not None and from_cache else []
    return pins.in_force(settings.pins, stored)


def _list(command: str, args, directory: Path | None, refusal: str | None) -> int:
    """The pins in force, the file's and the cache's (the cache's that the file overrides named as such)."""
    stored, usable = stored_pins(directory, command) if refusal is None else ([], False)
    if refusal is not None:
        print(f"{command}: {refusal}; only {PINS}'s pins are listed", file=sys.stderr)
    in_force = pins.in_force(args.settings.pins, stored)
    if args.json:
        print(json.dumps({"pins": [pin.entry() for pin in in_force]}, indent=1))
        return 0 if usable else 2
    declared = {pin.key for pin in args.settings.pins}
    overridden = [pin for pin in stored if pin.key in declared]
    print(f"{len(in_force)} pins in force" + (":" if in_force else ""))
    for pin in in_force:
        print(f"  {untrusted.printable(pin.text())}  ({untrusted.printable(_origin(pin, args.settings))})")
    for pin in overridden:
        print(f"  overridden by {PINS}: {untrusted.printable(pin.text())}  ({untrusted.printable(pin.origin)})")
    return 0 if usable else 2


def _origin(pin: pins.Pin, settings) -> str:
    return f"{PINS}={settings.pins_file}" if pin.origin == PINS else pin.origin
