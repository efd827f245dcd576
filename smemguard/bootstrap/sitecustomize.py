"""Installs smemguard in every Python process started under ``smemguard run``, then runs the
``sitecustomize`` this one shadows, as Python would have.

``smemguard run`` puts this folder first on ``PYTHONPATH``; every Python process that inherits the
variable (multiprocessing's spawn and forkserver children, ``subprocess``'d interpreters, torch's
compile workers, vLLM's and SGLang's workers) imports this module at start-up, before its own code.
It holds nothing but this file, so that nothing else of smemguard becomes a top-level module.

Nothing here may stop the interpreter: when smemguard cannot be imported or installed (a broken or
foreign install, a bad setting under ``SMEMGUARD=strict``), one line on stderr and the program runs
unguarded. The settings are smemguard's own (``SMEMGUARD_*``, read by ``smemguard.install()``).
"""

import importlib.machinery
import importlib.util
import os
import sys

#: How the line about a failed install starts (benchmarks/field_suites.py looks for it in a run's output).
NOT_INSTALLED = "smemguard run: smemguard is not installed in this process"
_MAX_DETAIL = 300  # characters of the error in that line


def _install():
    try:
        import smemguard

        smemguard.install()
    except (Exception, SystemExit) as error:  # SystemExit: a broken package must not end the program either
        # Written, not logged: logging is not configured yet, and smemguard itself may be what is broken.
        detail = " ".join(f"{type(error).__name__}: {error}".split())[:_MAX_DETAIL]
        if sys.stderr is not None:
            sys.stderr.write(f"{NOT_INSTALLED} ({detail}); {sys.executable} runs unguarded\n")


def _chain():
    """Run the next ``sitecustomize`` on ``sys.path`` after this folder (the interpreter's or the user's)."""
    here = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
    entries = [os.path.realpath(entry or os.curdir) for entry in sys.path]
    # Only the entries after this folder: another copy of this file further on chains onward, never back.
    after = entries[entries.index(here) + 1:] if here in entries else entries
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry for entry in after if entry != here])
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module  # `import sitecustomize` finds the user's, as without smemguard
    spec.loader.exec_module(module)  # its error is reported by site as "Error in sitecustomize", as without us


_install()
_chain()
