"""Installs smemguard in every Python process started under ``smemguard run``, then runs the
``sitecustomize`` this one shadows, as Python would have.

``smemguard run`` puts this folder first on ``PYTHONPATH``; every Python process that inherits the
variable (multiprocessing's spawn and forkserver children, ``subprocess``'d interpreters, torch's
compile workers, vLLM's and SGLang's workers) imports this module at start-up, before its own code.
It holds nothing but this file, so that nothing else of smemguard becomes a top-level module.

smemguard is imported and installed only when the process imports Triton (right after Triton's own
module has run, before the importer goes on): a process that never does (a shell tool, a data loader, a
CPU-only worker) pays nothing but this file, not smemguard's imports (wrapt, metrics; measured: docs/MEASURED.md). A
process that imports Triton gets what ``smemguard.install()`` before its first line would give it: the
guard installs at Triton's import in both cases, and library patches find their modules already imported.

Nothing here may stop the interpreter: when smemguard cannot be imported or installed (a broken or
foreign install, a bad setting under ``SMEMGUARD=strict``), one line on stderr and the program runs
unguarded. The settings are smemguard's own (``SMEMGUARD_*``, read by ``smemguard.install()``).
"""

import importlib.machinery
import importlib.util
import os
import sys
import threading

#: How the line about a failed install starts (benchmarks/field_suites.py looks for it in a run's output).
NOT_INSTALLED = "smemguard run: smemguard is not installed in this process"
_MAX_DETAIL = 300  # characters of the error in that line


def _install():
    try:
        import smemguard
        from smemguard.facts import process

        with process.quiet_warnings():  # what the install imports warns of is not the program's to read
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


class _ThenInstall:  # no importlib.abc base: that module imports importlib.resources and pathlib, in every process
    """Triton's own loader, then :func:`_install` once Triton's module has run."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _install()

    def __getattr__(self, name):  # resource readers and the like: Triton's loader answers
        return getattr(self._loader, name)


class _OnTritonImport:
    """First on ``sys.meta_path``: hands back the spec the other finders give for ``triton``, with
    :class:`_ThenInstall` as its loader. Every other name, and ``triton`` once it was found, it passes on."""

    def __init__(self):
        self._finding = threading.local()
        self.done = False

    def find_spec(self, name, path=None, target=None):
        if name != "triton" or self.done or getattr(self._finding, "now", False):
            return None
        self._finding.now = True
        try:
            spec = importlib.util.find_spec(name)  # the finders after this one
        finally:
            self._finding.now = False
        if spec is None or spec.loader is None:
            return None
        self.done = True
        spec.loader = _ThenInstall(spec.loader)
        return spec


if "triton" in sys.modules:  # imported by a .pth file before site ran this module
    _install()
else:
    sys.meta_path.insert(0, _OnTritonImport())
_chain()
