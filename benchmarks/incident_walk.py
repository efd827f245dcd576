"""The walk of one incident: how much of smemguard one recovered launch goes through.

One plain ``matmul_kernel`` launch, 64x64x64 with 5 stages (65536 B), under 60000 B on smemguard's
CPU stand-in for an L4 (``smemguard.testing.fake_gpu``: Triton compiles, nothing executes), which
smemguard recovers at 4 stages (49152 B). Two installs, each in a fresh process:

  default        ``smemguard.install()`` as a user gets it: the compile-time core
                 (``patches/triton_seams/triton_compile.py``) catches the overflow before the kernel loads
  launch-guard   ``SMEMGUARD_DISABLE=triton_compile``, as the tests' ``install_guard`` installs: the launch
                 guard catches Triton's ``OutOfResources`` and recovers (what stays for what stages cannot fix)

``sys.setprofile`` is on around the failing launch only (not the install, not the imports), and
``threading.setprofile`` for the threads it starts (candidate compiles may run concurrently). Counted
are the frames whose code lies in the imported ``smemguard`` package, named by their path in it
(``recovery.py``, ``patches/triton_seams/kernel_interface.py``); the stand-in driver's module, and whatever it
calls, is the GPU's part and left out (its function count is shown apart). For each install:

  files entered        smemguard files in which any code ran, in order of first entry; the smemguard modules
                       imported during the launch, and the top-level packages outside it
  functions            distinct functions run (code objects; comprehensions and module bodies not counted,
                       so the number does not change with Python's inlining of comprehensions), and which ran
                       in each file
  moves between files  calls and returns (a generator's yield and resume too) from a frame of one smemguard
                       file directly to a frame of another
  deepest stack        the most smemguard frames on the stack at once (comprehensions not counted), the
                       modules on it in order, and any module on it twice with another between
  twice on any stack   the modules on some stack twice with another between, each with the first such stack

The action and the stages are read from the incident record. Each measured process is the second of
two identical ones sharing a Triton cache in a temporary directory (the first warms it), each with
a decision store of its own, so no decision is recalled and the walk does not depend on the cache.

    python benchmarks/incident_walk.py [--install default|launch-guard] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import threading
from pathlib import Path

import harness

INSTALLS = {"default": (), "launch-guard": ("triton_compile",)}
LIMIT = 60000
LAUNCH = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_stages=5)
EXPECTED = ("stages_reduced", 5, 4)
COMPREHENSIONS = {"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"}
INDENT = "\n" + " " * 23  # a value's next line, under the first


class Walk:
    """A ``sys.setprofile`` function that records what ran inside the smemguard package."""

    def __init__(self, package: Path, harness_file: str) -> None:
        self.package = package
        self.names: dict[str, str | None] = {}  # code file -> its path in the package (None: outside)
        self.files: dict[str, None] = {}  # in order of first entry
        self.functions: dict = {}  # code -> its file in the package
        self.harness_functions: set = set()
        self.imported: dict[str, None] = {}
        self.moves = 0
        self.deepest: list[tuple[str, str]] = []
        self.reentered: dict[str, list[str]] = {}  # module -> the first stack it is on twice
        self.harness = self.relative(harness_file)  # the stand-in driver's module
        self.lock = threading.Lock()  # candidate compiles may run in threads of their own

    def name(self, frame) -> str | None:
        return self.relative(frame.f_code.co_filename)

    def relative(self, path: str) -> str | None:
        if path not in self.names:
            resolved = Path(path).resolve()
            inside = resolved.is_relative_to(self.package)
            self.names[path] = resolved.relative_to(self.package).as_posix() if inside else None
        return self.names[path]

    def stack(self, frame) -> list[tuple[str, str]] | None:
        """The smemguard frames from ``frame`` out, outermost first, as (file, function); None under the harness."""
        frames = []
        while frame is not None:
            name = self.name(frame)
            if name == self.harness:
                return None
            if name is not None and frame.f_code.co_name not in COMPREHENSIONS:
                frames.append((name, getattr(frame.f_code, "co_qualname", frame.f_code.co_name)))  # 3.10: no qualname
            frame = frame.f_back
        return frames[::-1]

    def __call__(self, frame, event: str, arg) -> None:
        if event in ("call", "return") and self.name(frame) is not None:
            with self.lock:
                self.step(frame, event)

    def step(self, frame, event: str) -> None:
        stack = self.stack(frame)
        if stack is None:
            if event == "call" and self.name(frame) == self.harness:
                self.harness_functions.add(frame.f_code)
            return
        caller = self.name(frame.f_back) if frame.f_back is not None else None
        self.moves += caller not in (None, self.name(frame))
        if event == "call":
            self.entered(frame, stack)

    def entered(self, frame, stack: list[tuple[str, str]]) -> None:
        code = frame.f_code
        self.files[self.name(frame)] = None
        if code.co_name == "<module>":
            self.imported[self.name(frame)] = None
        elif code.co_name not in COMPREHENSIONS:
            self.functions[code] = self.name(frame)
        if len(stack) > len(self.deepest):
            self.deepest = stack
        for module in twice(stack):
            self.reentered.setdefault(module, [f"{file}:{function}" for file, function in stack])

    def result(self) -> dict:
        by_file = {file: sorted(getattr(code, "co_qualname", code.co_name) for code, name in self.functions.items()
                                if name == file) for file in self.files}
        return {"files": list(self.files), "functions": len(self.functions), "by_file": by_file, "moves": self.moves,
                "deepest": [f"{file}:{function}" for file, function in self.deepest],
                "deepest_modules": modules_of(self.deepest), "twice": twice(self.deepest),
                "reentered": self.reentered, "imported": list(self.imported),
                "harness_functions": len(self.harness_functions)}


def modules_of(stack: list[tuple[str, str]]) -> list[str]:
    """The modules on ``stack`` in order, a run of frames in one module counted once."""
    return [file for i, (file, _) in enumerate(stack) if i == 0 or stack[i - 1][0] != file]


def twice(stack: list[tuple[str, str]]) -> list[str]:
    """The modules on ``stack`` twice with another module between."""
    modules = modules_of(stack)
    return sorted({module for module in modules if modules.count(module) > 1})


def stages_of(record: dict) -> tuple[int, int | None]:
    """The record's stages: those of the failing launch and those it recovered with (from ``final``)."""
    final = re.search(r"num_stages=(\d+)", record.get("final") or "")
    return record["num_stages"], int(final.group(1)) if final else None


def worker(install: str) -> dict:
    """Install smemguard, launch the overflowing kernel once under the profiler, return the walk and the record."""
    import torch
    import triton

    import smemguard
    from smemguard.examples import matmul_args, matmul_kernel
    from smemguard.testing import fake_gpu

    smemguard.install()  # from the environment run() set: SMEMGUARD_LOG, SMEMGUARD_CACHE_DIR, SMEMGUARD_DISABLE
    args = matmul_args(*(torch.empty(256, 256, dtype=torch.float16) for _ in range(3)))
    walk = Walk(Path(smemguard.__file__).resolve().parent, sys.modules[fake_gpu.__module__].__file__)
    with fake_gpu("L4", max_shared=LIMIT, cache_dir=os.environ["TRITON_CACHE_DIR"]) as gpu:
        before = set(sys.modules)
        threading.setprofile(walk)  # threads started by the launch (concurrent candidate compiles)
        sys.setprofile(walk)
        try:
            matmul_kernel[(4, 4)](*args, **LAUNCH)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
        launched = gpu.launches[-1].num_stages if gpu.launches else None
    others = sorted({name.partition(".")[0] for name in set(sys.modules) - before} - {"smemguard"})
    smemguard.uninstall()
    record = json.loads(Path(os.environ["SMEMGUARD_LOG"]).read_text().splitlines()[-1])
    return {"install": install, **walk.result(), "action": record["action"], "phase": record.get("phase"),
            "stages": stages_of(record), "launched_stages": launched, "harness": walk.harness, "others": others,
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "triton": triton.__version__}}


def run(install: str) -> dict:
    """The walk in the second of two fresh processes that share a Triton cache (the first warms it)."""
    with harness.scratch("incident-walk") as scratch:
        cache = harness.TritonCache("warm", Path(scratch)).next()
        for process in ("warm-up", "measured"):
            own = Path(scratch, process)  # its own decision store: nothing is recalled
            own.mkdir()
            env = harness.environment(triton_cache=cache, log=str(own / "incidents.jsonl"),
                                      cache_dir=str(own / "decisions"), disable=",".join(INSTALLS[install]),
                                      base={k: v for k, v in os.environ.items() if not k.startswith("SMEMGUARD")})
            env.update(XDG_CACHE_HOME=scratch, TRITON_HOME=scratch)
            walk = harness.fresh_process([__file__, "--worker", install], env=env, timeout=1800)
    return walk


def verdict(walk: dict) -> str:
    stages = tuple(walk["stages"])
    got = f"{walk['action']}, {stages[0]} -> {stages[1]} stages (launched with {walk['launched_stages']})"
    ok = (walk["action"], *stages) == EXPECTED and walk["launched_stages"] == EXPECTED[2]
    return f"{got}: {'as expected' if ok else 'NOT the expected stages_reduced 5 -> 4'}"


def show(walk: dict) -> None:
    print(f"\n== {walk['install']} install (the incident's phase: {walk['phase']})")
    rows = [("action", verdict(walk)),
            ("files entered", f"{len(walk['files'])}: {', '.join(walk['files'])}"),
            ("imported during it", ", ".join(walk["imported"]) or "none"),
            ("  outside smemguard", ", ".join(walk["others"]) or "none"),
            ("functions", walk["functions"]),
            *((f"  {file}", f"{len(names)}: {', '.join(names)}") for file, names in walk["by_file"].items()),
            ("moves between files", walk["moves"]),
            ("deepest stack", f"{len(walk['deepest'])} frames"),
            ("  modules in order", " > ".join(walk["deepest_modules"])),
            ("  frames", INDENT.join(walk["deepest"])),
            ("modules twice on the deepest stack", ", ".join(walk["twice"]) or "none"),
            ("modules twice on any stack", ", ".join(walk["reentered"]) or "none"),
            *((f"  first with {module}", INDENT.join(stack)) for module, stack in walk["reentered"].items()),
            ("left out (stand-in)", f"{walk['harness']}: {walk['harness_functions']} functions")]
    for label, value in rows:
        if len(label) <= 22:
            print(f"{label:22} {value}")
        else:  # a long label: a one-line value beside it, the lines of a longer one under it
            print(f"{label}:{INDENT if INDENT in str(value) else ' '}{value}")


def main() -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--install", action="append", choices=sorted(INSTALLS), help="default: both")
    parser.add_argument("--worker", choices=sorted(INSTALLS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return 0
    walks = [run(install) for install in args.install or list(INSTALLS)]
    document = harness.write(args.json, walks, limit=LIMIT)
    print(f"{harness.headline(document)} · smemguard's CPU harness (fake_gpu L4, max_shared {LIMIT} B)")
    print("launch: matmul_kernel[(4, 4)], " + ", ".join(f"{k}={v}" for k, v in LAUNCH.items()))
    for walk in walks:
        show(walk)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
