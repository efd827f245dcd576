"""``smemguard run -- CMD [ARGS...]``: CMD, and every Python process it starts, guarded with no code change.

Puts :data:`BOOTSTRAP` (a folder holding only smemguard's ``sitecustomize``) first on ``PYTHONPATH``
and replaces itself with CMD (``os.execvpe``: CMD keeps this process's id, signals and exit status).
The environment passes through otherwise untouched but for the settings that name a path, made absolute
once (``settings.with_absolute_paths``): every ``SMEMGUARD_*`` setting is read by ``smemguard.install()`` in
each process, as with a call in the program's own code.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path
from typing import Mapping

from ..facts import untrusted

#: The folder ``smemguard run`` prepends to ``PYTHONPATH``; its ``sitecustomize`` installs smemguard.
BOOTSTRAP = Path(__file__).resolve().parent.parent / "bootstrap"

HELP = "run a program with every Python process it starts guarded (no code change)"

USAGE = "smemguard run [-h] -- CMD [ARGS...]"

DESCRIPTION = """\
Runs CMD with smemguard installed in every Python process it starts, as smemguard.install() in
the program's own code would: the program itself (python script.py, python -m pkg, a console
script such as vllm or torchrun), multiprocessing's spawn and forkserver children, subprocess'd
interpreters, torch.compile's compile workers, vLLM's and SGLang's workers. It puts a folder with
smemguard's sitecustomize first on PYTHONPATH (an existing PYTHONPATH is kept after it, and an
existing sitecustomize still runs), then replaces itself with CMD: same process id, and the
program's own signals, output and exit status.

Settings are the environment's SMEMGUARD_* variables, read in each process as install() reads
them; a relative SMEMGUARD_LOG, SMEMGUARD_CACHE_DIR or SMEMGUARD_METRICS_FILE is made absolute
here, so a process started in another directory writes the same files.
SMEMGUARD=off runs CMD unchanged. When smemguard cannot install in a process (not
importable by that interpreter, a bad setting under SMEMGUARD=strict), that process writes one
line on stderr and runs unguarded; a bad setting otherwise is one warning line and the default.

Not reached: interpreters started with -I (isolated), -E or -S (they ignore PYTHONPATH or skip
sitecustomize), and processes started with an environment of their own that drops PYTHONPATH.
Fork children need nothing: they inherit the guard from their parent.
"""

EPILOG = """\
examples:
  smemguard run -- python train.py --use_liger_kernel --torch_compile
      a Hugging Face Trainer script with Liger-Kernel and torch.compile: the script, its dataloader
      workers and torch.compile's compile workers
  SMEMGUARD_LOG=/var/log/smemguard/incidents.jsonl smemguard run -- python -m sglang.launch_server \\
      --model-path Qwen/Qwen3-8B --port 30000
      an SGLang server and its scheduler and TP workers, incident records to one file
  SMEMGUARD_MAX_SHARED=L4 smemguard run -- pytest tests/
      a test suite (and its xdist workers) under an emulated L4's limit on a bigger GPU

exit status: CMD's own; 2 no CMD given; 126 CMD is not executable; 127 CMD not found (as a shell).
"""


def add_run_command(commands) -> argparse.ArgumentParser:
    """Add ``run`` to the subparsers, for ``smemguard --help`` and ``smemguard run --help``; :func:`main` runs it."""
    parser = commands.add_parser("run", help=HELP, usage=USAGE, description=DESCRIPTION, epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="CMD [ARGS...]",
                        help="the program and its arguments (after --)")
    return parser


def environment(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with :data:`BOOTSTRAP` first on ``PYTHONPATH`` (once: ``smemguard run`` may run itself). The
    user's entries are kept as they are, empty ones too: an empty entry is the current directory to Python."""
    given = environ.get("PYTHONPATH", "")
    entries = given.split(os.pathsep) if given else []
    kept = [entry for entry in entries if not entry or os.path.realpath(entry) != str(BOOTSTRAP)]
    return {**environ, "PYTHONPATH": os.pathsep.join([str(BOOTSTRAP), *kept])}


def main(argv: list[str]) -> int:
    """``smemguard run`` with ``argv`` (what follows ``run``); returns only when CMD cannot be started."""
    command = argv[1:] if argv[:1] == ["--"] else argv
    if not command:
        print(f"usage: {USAGE}\nsmemguard run: no command given", file=sys.stderr)
        return 2
    if command is argv and command[0].startswith("-"):
        print(f"usage: {USAGE}\nsmemguard run: unknown option {untrusted.printable(command[0])}; "
              "put the command after --", file=sys.stderr)
        return 2
    from ..facts import settings

    # Passed on as it is, but for PYTHONPATH and the paths made absolute; off: install nothing, not even the
    # sitecustomize.
    environ = environment(settings.with_absolute_paths(os.environ)) if settings.load().enabled else os.environ
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        if not command[0]:  # no program has an empty name (os.execvpe raises ValueError for it)
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT))
        os.execvpe(command[0], command, environ)
    except OSError as error:  # nothing was replaced: say why as a shell would
        not_found = isinstance(error, FileNotFoundError)
        print(f"smemguard run: {untrusted.printable(command[0], 200) or repr('')}: "
              f"{'command not found' if not_found else error.strerror or error}", file=sys.stderr)
        return 127 if not_found else 126
