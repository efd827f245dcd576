"""Other projects' released test suites on a GPU under emulated small-GPU limits, three ways.

Runs chosen test files of FlagGems 5.0.2, fla-core, Liger-Kernel 0.8.5 and GemLite 0.6.0.post2 with pytest (and,
when asked for with ``--suites``, SGLang's tests of its Triton attention kernels against SGLang 0.5.23), and
compares, per suite and limit (``SMEMGUARD_MAX_SHARED``):

- ``plain``: no smemguard and no emulation: which tests pass at all on this GPU. The limit is
  emulated by smemguard's own patch, so plain does not depend on it and runs once per suite;
- ``observe``: smemguard installed with ``SMEMGUARD=observe``: the limit is enforced and
  nothing is recovered, so a small GPU's ``OutOfResources`` failures show;
- ``on``: smemguard installed with ``SMEMGUARD=on``.

Wanted: every test that passes plain and fails with ``OutOfResources`` under observe passes
under on, or its incident record says why not; no test that passes under observe fails under on.

smemguard goes into every Python process of a run (pytest, its xdist workers, the tests' own
subprocesses) as ``smemguard run`` puts it there: its ``sitecustomize`` folder (``smemguard/bootstrap``
of this checkout, which imports the smemguard of ``--smemguard``) first on ``PYTHONPATH`` (a
``pytest -p`` plugin would miss the subprocesses). Every process of a run appends to the run's one
incident file; a generated module, loaded with ``-p``, names in the JUnit XML the records each test
produced (those with its process's pid). Each run gets a fresh
``SMEMGUARD_CACHE_DIR`` and ``FLAGGEMS_CACHE_DIR`` (no decisions or tunings carried between
runs); all runs share one Triton compile cache, which holds no decisions, and a suite's observe
and on runs start once its plain run has filled it (``--jobs`` runs at a time).

``--tuning-from-plain`` starts each observe and on run with a copy of its suite's plain run's
``FLAGGEMS_CACHE_DIR``: FlagGems then loads the configs it tuned at the GPU's own limit instead of
tuning again under the emulated one, as a deployment that ships the tuning of a big GPU to a small
one does (and its 30 to 160 s of tuning per new shape are paid once). ``--tuning-dir DIR`` takes
that copy from DIR instead (a plain run's ``flaggems-cache`` kept from an earlier call), and
``--plain-from JSON`` takes the plain runs of that earlier call's results file as this one's, so that
a suite too slow for one device call is compared across two (``--modes observe,on`` in the second).

The third-party test sources and wheels are not ours and are never committed: they live in
git-ignored folders (``.field/``, ``.whl/``); ``benchmarks/field_suites.md`` says how to fill
them and gives the commands of the recorded runs. Usage (on the GPU machine, with FlagGems,
fla-core, Liger-Kernel and gemlite importable)::

    python benchmarks/field_suites.py --smemguard . --limits T4,L4 --modes plain,observe,on \\
        --out results/ --workers 4 --jobs 4

Writes ``field_suites.json`` (per-test outcomes per run, incident records, timings) into
``--out`` after every run, and prints the summary table last. ``--report FILE`` prints the
table of an earlier JSON without running anything.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from harness import meta

REPO = Path(__file__).resolve().parent.parent
MODES = ("plain", "observe", "on")
RESULTS_NAME = "field_suites.json"
OOR_PATTERN = re.compile(r"OutOfResources|out of resource", re.IGNORECASE)
# The note smemguard adds to an error it re-raises names the record: "incident record: PATH#ID".
RECORD_NOTE = re.compile(r"incident record: \S+#(\d+-\d+)")
RECORD_PROPERTY = "smemguard_record"
# The sitecustomize folder of `smemguard run`: it works with any smemguard it finds (the one of --smemguard).
BOOTSTRAP = REPO / "smemguard" / "bootstrap"
NOT_INSTALLED = "smemguard is not installed in this process"  # the line BOOTSTRAP writes when it cannot install
MESSAGE_CHARS = 600  # of a failure kept in the JSON
MIN_RUN_S = 60  # a run started with less time left in --budget reports nothing: it is skipped instead
LOG_TAIL_CHARS = 3000  # of each run's pytest output kept in the JSON


@dataclass(frozen=True)
class Suite:
    name: str
    root: str  # under --field; pytest's rootdir, and on PYTHONPATH like the project's own checkout
    paths: tuple[str, ...]  # test files, relative to root
    select: str | None = None  # pytest -k expression
    options: tuple[str, ...] = ()  # more pytest options
    source: str = ""  # where the test files came from
    pythonpath: tuple[str, ...] = ()  # more directories under --field, on PYTHONPATH right after root
    default: bool = True  # run when --suites is not given


# Chosen for a whole matrix (plain once, observe and on per limit) of about 7 minutes on an H200 with
# --workers 4 --jobs 4 for the first three suites (GemLite's time not yet measured); first compiles and
# autotuning dominate (benchmarks/field_suites.md).
SUITES = {suite.name: suite for suite in (
    # FlagGems tunes every shape afresh over its whole config list: 30 to 50 s a new fp16/bf16 shape,
    # 110 to 160 s a float32 one, on a cold Triton cache. Float32 at 495x5333x71 (an emulated T4's
    # OutOfResources, mm_kernel_general at 147488 B) in each operation, one scalar for addmm.
    # FlagGems' conftest only files results in a JSON report, and under xdist its report hook fails
    # (its table is filled by a hook that runs in the workers only): --noconftest. Its test modules
    # import it as a module, with the defaults of a plain run.
    Suite("flaggems", "flaggems", ("tests/test_mm.py", "tests/test_addmm.py", "tests/test_bmm.py"),
          select="dtype1 and 495 and not 0.001 and not 111 and not non_contiguous", options=("--noconftest",),
          source="flagos-ai/FlagGems tag v5.0.2"),
    # The GDN backward state kernel (chunk_gated_delta_rule_bwd_dhu), chunk_scaled_dot_kkt + solve_tril
    # and every solve_tril test. The chunked GDN forward and backward (test_gdn.py::test_chunk) fails
    # plain on Hopper with Triton < 3.7.1 (fla refuses its gated chunk_bwd_dqkwg there); its other
    # tests compile the same kernels for other sizes, at 5 to 15 s a test.
    Suite("fla", "fla", ("tests/ops/test_gdn_kernels.py", "tests/ops/test_solve_tril.py", "tests/ops/test_gdn.py"),
          select="(bwd_dhu and not many_documents) or kkt_solve or test_solve_tril",
          source="fla-org/flash-linear-attention, tests of the commit in .field/fla/COMMIT"),
    # Left out: RMSNorm under DTensor (spawns a process group per test) and the two RMSNorm tests of
    # row offsets past 2**31 elements (tens of GB each).
    Suite("liger", "liger", tuple(f"test/transformers/test_{name}.py" for name in (
          "fused_neighborhood_attention", "mhc", "multi_token_attention", "rms_norm", "layer_norm",
          "fused_add_rms_norm", "group_norm", "poly_norm")),
          select="not dtensor and not row_offset", source="liger-kernel 0.8.5 sdist (test/)"),
    # GemLite's own kernel tests (unittest classes; each test runs one layer type through every matmul
    # kind at 8 batch sizes, set_autotune(False): the pruner sizes its default configs for the GPU it
    # sees, an H200 under emulation). Left out: test_serialization.py, whose tests all write one file,
    # /tmp/_test_serial.pt, and would race between workers and runs. Both modules set GemLite up at import
    # (tensors on cuda:0): one that fails to import must not keep the other from running.
    Suite("gemlite", "gemlite", ("tests/test_int.py", "tests/test_mxfp.py"),
          options=("--continue-on-collection-errors",),
          source="dropbox/gemlite tests of the commit in .field/gemlite/COMMIT, against the gemlite 0.6.0.post2 sdist"),
    # SGLang's own tests of its Triton attention kernels: extend (two-stage and unified, custom mask, sliding
    # window, compact grid), decode (normal, grouped, MLA 576/512) and prefill (context_attention_fwd), 13 tests
    # (2 of them AMD-only, skipped). Run against 0.5.23's own files: the root holds the part of the sglang
    # package the tests import (sglang/), stand-ins for four packages that cannot travel (stubs/, put last on
    # sys.path by the root's conftest.py, which also bridges two names the stored tests import from their
    # older places) and, in site/, the pure-Python and cp312 dependencies, installed there from wheels/ on
    # the GPU machine (benchmarks/field_suites.md). Not in the default --suites. Its plain run: 1 to 2
    # minutes from a cold Triton cache with 4 workers (estimate, not measured).
    Suite("sglang-attention", "sglang", ("test/registered/attention/test_triton_attention_kernels.py",),
          pythonpath=("sglang/site",), default=False,
          source="sgl-project/sglang test/registered/attention, the stored version named in .field/sglang/COMMIT, "
                 "against sglang 0.5.23's files"),
    # LMDeploy's own tests of its Triton attention kernels (prefill flash attention and paged decoding: fp16, int8,
    # int4, fp8 and quant42 caches; head sizes 16 to 128), 56 tests. Its wrapper picks tiles, warps and stages
    # from the compute capability it reads (sm_90 here), so under an emulated limit the sm_90 tiles meet a smaller
    # GPU's shared memory. Run against the 0.18.0 wheel's Python files (site/, its shared objects left out; the
    # pure-Python and cp312 dependencies installed there from whl/ on the GPU machine); the tests are those of the
    # newest stored commit (0.16.0: the snapshot has no later tag), whose entry points 0.18.0 keeps
    # (benchmarks/field_suites.md). Not in the default --suites.
    Suite("lmdeploy", "lmdeploy/src", ("tests/pytorch/kernel/test_flash_attention.py",
                                       "tests/pytorch/kernel/test_paged_attention.py"),
          pythonpath=("lmdeploy/site",), default=False,
          source="InternLM/lmdeploy tests/pytorch/kernel of the commit in .field/lmdeploy/COMMIT, against the "
                 "lmdeploy 0.18.0 wheel's files"),
)}

PROBE_PLUGIN = '''\
"""Generated by benchmarks/field_suites.py (pytest -p): names in the JUnit XML the smemguard records of each test."""
import json
import os

import pytest

_read_up_to = {{}}  # incident file -> bytes already attributed to a test


def _new_records():
    """This process's records (every process of the run appends to one file) not yet attributed to a test."""
    path = os.environ.get("SMEMGUARD_LOG")
    if not path or not os.path.exists(path):
        return []
    with open(path, "rb") as records:
        records.seek(_read_up_to.get(path, 0))
        data = records.read()
    complete = data[:data.rfind(b"\\n") + 1]  # a line still being written belongs to the next read
    _read_up_to[path] = _read_up_to.get(path, 0) + len(complete)
    found = []
    for line in complete.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("pid") != os.getpid():  # another xdist worker's, or a test's subprocess's
            continue
        found.append({{key: record.get(key) for key in ("id", "kernel", "action")}})
    return found


def pytest_sessionstart(session):
    _new_records()  # records of imports and collection belong to no test


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    if call.when == "teardown":  # JUnit XML takes a test's properties from its teardown report
        for record in _new_records():
            item.user_properties.append(("{property}", json.dumps(record, sort_keys=True)))
    yield
'''

ENVIRONMENT_PROBE = '''\
import json, importlib.metadata as metadata
packages = {}
for name in ("torch", "triton", "flag-gems", "fla-core", "liger-kernel", "gemlite", "pytest", "pytest-xdist",
             "pytest-timeout", "transformers"):
    try:
        packages[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        packages[name] = None
gpu = None
try:
    import torch
    if torch.cuda.is_available():
        gpu = {"name": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0))}
except Exception as error:
    gpu = {"error": repr(error)}
import platform
print(json.dumps({"python": platform.python_version(), "packages": packages, "gpu": gpu}))
'''


class UsageError(Exception):
    """Bad input: one line for the user, no traceback."""


# ---------------------------------------------------------------------------------------------
# Reading what a run left: JUnit XML and incident records


def classify(text: str) -> str:
    """``oor`` when a failure's text is a shared-memory (or other resource) OutOfResources, else ``other``."""
    return "oor" if OOR_PATTERN.search(text) else "other"


def parse_junit(path: Path) -> dict[str, dict]:
    """Per test ``classname::name``: outcome (passed, failed, error, skipped), time, and for the
    ones that did not pass or skip, the kind of failure, its first lines and the records it names."""
    tests: dict[str, dict] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        if not case.get("name"):  # pytest-xdist leaves one empty case per worker
            continue
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        entry = {"outcome": "passed", "time": round(float(case.get("time") or 0), 3)}
        records = [json.loads(prop.get("value")) for prop in case.iter("property")
                   if prop.get("name") == RECORD_PROPERTY]
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                entry["outcome"] = "failed" if child.tag == "failure" else child.tag
                text = f"{child.get('message', '')}\n{child.text or ''}"
                if child.tag != "skipped":
                    entry["failure"] = classify(text)
                    noted = sorted(set(RECORD_NOTE.findall(text)))
                    if noted:
                        entry["noted_records"] = noted
                entry["message"] = text.strip()[:MESSAGE_CHARS]
                break
        if records:
            entry["records"] = records
        while test_id in tests:  # two cases named alike (never seen): keep both
            test_id += "'"
        tests[test_id] = entry
    return tests


def read_incidents(path: Path) -> tuple[list[dict], int]:
    """Every record in the run's incident file, shortened; and the number of unreadable lines."""
    records, unreadable = [], 0
    if path.exists():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                unreadable += 1
                continue
            records.append({"id": record.get("id"), "kernel": record.get("kernel"),
                            "launched_as": record.get("launched_as"), "action": record.get("action"),
                            "reason": record.get("reason"), "required": record.get("required"),
                            "limit_hit": record.get("limit_hit"), "config": record.get("config"),
                            "final": record.get("final"), "attempts": len(record.get("attempts") or ()),
                            "attempt_errors": sorted({attempt["error"] for attempt in record.get("attempts") or ()
                                                      if attempt.get("error")}),
                            "remembered": record.get("remembered"), "recovery_ms": record.get("recovery_ms")})
    return records, unreadable


# ---------------------------------------------------------------------------------------------
# The summary


def _passed(run: dict | None) -> set[str]:
    return {t for t, entry in (run or {}).get("tests", {}).items() if entry["outcome"] == "passed"}


def _failed(run: dict | None, kind: str | None = None) -> set[str]:
    return {t for t, entry in (run or {}).get("tests", {}).items()
            if entry["outcome"] in ("failed", "error") and (kind is None or entry.get("failure") == kind)}


def why_not_recovered(run: dict, test_id: str) -> str:
    """The incident record behind a test still failing with smemguard on: ``action: reason``."""
    entry = run["tests"][test_id]
    by_id = {record["id"]: record for record in run.get("incidents", [])}
    ids = [record["id"] for record in entry.get("records", [])] + entry.get("noted_records", [])
    found = [by_id[i] for i in dict.fromkeys(ids) if i in by_id]
    if not found:
        return "no incident record: smemguard did not see the failing launch"
    record = next((r for r in found if r.get("action") == "reraised"), found[-1])
    text = f"{record.get('action')}: {record.get('kernel')}"
    if record.get("required") is not None:
        text += f" ({record['required']} > {record.get('limit_hit')} B)"
    if record.get("attempt_errors"):
        text += f": candidates failed inside smemguard: {'; '.join(record['attempt_errors'])}"
    if record.get("reason"):
        text += f": {record['reason']}"
    return text


def _incomplete(run: dict) -> str | None:
    """Why a run's outcomes do not cover its selection, or None."""
    if run.get("skipped"):
        return run["skipped"]
    if run.get("timed_out"):
        return f"interrupted after {run.get('wall_s')} s with {len(run['tests'])} tests reported"
    if run.get("junit_error"):
        return f"no JUnit XML ({run['junit_error']})"
    return None


def summarize(results: dict) -> list[dict]:
    """One row per (suite, limit): the counts the acceptance criteria name, and the failing tests."""
    runs = {(run["suite"], run["mode"], run["limit"]): run for run in results["runs"] if run["tests"]}
    reported = {(run["suite"], run["mode"], run["limit"]): run for run in results["runs"]}
    rows = []
    for suite in results["suites"]:
        plain = runs.get((suite, "plain", None))
        for limit in results["limits"]:
            observe, on = runs.get((suite, "observe", limit)), runs.get((suite, "on", limit))
            passed_plain = _passed(plain)
            oor_observe = passed_plain & _failed(observe, "oor")
            incomplete = [f"{run['label']}: {_incomplete(run)}" for run in (reported.get(key) for key in (
                (suite, "plain", None), (suite, "observe", limit), (suite, "on", limit))) if run and _incomplete(run)]
            row = {"suite": suite, "limit": limit, "incomplete": incomplete,
                   "tests": len((plain or observe or on or {}).get("tests", {})),
                   "passed_plain": len(passed_plain) if plain else None,
                   "oor_observe": len(oor_observe) if plain and observe else None,
                   "other_fail_observe": len(passed_plain & _failed(observe, "other")) if plain and observe else None,
                   "recovered_on": len(oor_observe & _passed(on)) if plain and observe and on else None,
                   "broken_by_on": sorted(_passed(observe) & _failed(on)) if observe and on else None,
                   "still_failing": {}}
            if plain and observe and on:
                for test_id in sorted(oor_observe - _passed(on)):
                    row["still_failing"][test_id] = (why_not_recovered(on, test_id) if test_id in on["tests"]
                                                     else "not run under on")
            rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    def cell(value):
        return "-" if value is None else str(value)

    header = ("suite", "limit", "tests", "passed plain", "OOR observe", "recovered on", "observe ok, on fails",
              "other fail observe")
    body = [(row["suite"], row["limit"], cell(row["tests"]), cell(row["passed_plain"]), cell(row["oor_observe"]),
             cell(row["recovered_on"]), cell(None if row["broken_by_on"] is None else len(row["broken_by_on"])),
             cell(row["other_fail_observe"])) for row in rows]
    widths = [max(len(line[i]) for line in (header, *body)) for i in range(len(header))]
    lines = ["  ".join(text.ljust(width) for text, width in zip(line, widths)).rstrip() for line in (header, *body)]
    lines.insert(1, "  ".join("-" * width for width in widths))
    lines.append("OOR observe: passed plain, failed with OutOfResources under observe; recovered on: of those, passed "
                 "under on; observe ok, on fails: must be 0.")
    for row in rows:
        for note in row.get("incomplete", ()):
            lines.append(f"INCOMPLETE ({row['suite']}, {row['limit']}): {note}; counts cover the tests reported")
        for test_id in row["broken_by_on"] or ():
            lines.append(f"BROKEN by smemguard ({row['suite']}, {row['limit']}): {test_id}")
        for test_id, why in row["still_failing"].items():
            lines.append(f"still failing ({row['suite']}, {row['limit']}): {test_id}\n    "
                         + textwrap.shorten(why, 600))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Running


@dataclass(frozen=True)
class Run:
    suite: Suite
    mode: str
    limit: str | None  # None for plain

    @property
    def label(self) -> str:
        return f"{self.suite.name}-{self.mode}" + (f"-{self.limit}" if self.limit else "")


class Harness:
    def __init__(self, args, field: Path, smemguard: Path, work: Path, environment: dict):
        self.args, self.field, self.smemguard, self.work = args, field, smemguard, work
        self.environment = environment
        self.hooks = work / "hooks"
        self.hooks.mkdir()
        (self.hooks / "field_suites_probe.py").write_text(PROBE_PLUGIN.format(property=RECORD_PROPERTY))
        self.ini = work / "pytest.ini"
        self.ini.write_text("[pytest]\n")  # keeps pytest from adopting a configuration file above the suites
        self.triton_cache = work / "triton-cache"
        self.deadline = time.monotonic() + args.budget
        self._lock = threading.Lock()

    def environ(self, run: Run, run_dir: Path) -> dict:
        env = {key: value for key, value in os.environ.items() if not key.startswith("SMEMGUARD")}
        path = [str(self.field / run.suite.root)] + [str(self.field / extra) for extra in run.suite.pythonpath]
        if run.mode != "plain":
            path[:0] = [str(BOOTSTRAP), str(self.hooks), str(self.smemguard)]
            env.update({"SMEMGUARD": run.mode, "SMEMGUARD_MAX_SHARED": run.limit,
                        "SMEMGUARD_CACHE_DIR": str(run_dir / "decisions"),
                        "SMEMGUARD_LOG": str(run_dir / "incidents.jsonl")})
        env["PYTHONPATH"] = os.pathsep.join(path + [p for p in [os.environ.get("PYTHONPATH")] if p])
        env.update({"PYTHONUNBUFFERED": "1", "FLAGGEMS_CACHE_DIR": str(run_dir / "flaggems-cache"),
                    "TRITON_CACHE_DIR": str(self.triton_cache)})
        return env

    def command(self, run: Run, run_dir: Path) -> list[str]:
        root = self.field / run.suite.root
        command = [sys.executable, "-m", "pytest", "-c", str(self.ini), "--rootdir", str(root), "-q",
                   "-p", "no:cacheprovider", "--disable-warnings", f"--junitxml={run_dir / 'junit.xml'}"]
        if run.mode != "plain":
            command += ["-p", "field_suites_probe"]
        command += run.suite.options
        packages = self.environment.get("packages", {})
        if self.args.workers and packages.get("pytest-xdist"):
            command += ["-n", str(self.args.workers)]
        if self.args.test_timeout and packages.get("pytest-timeout"):
            command += [f"--timeout={self.args.test_timeout}"]
        select = self.args.select.get(run.suite.name, run.suite.select)
        if select:
            command += ["-k", select]
        return command + [str(root / path) for path in run.suite.paths]

    def execute(self, run: Run) -> dict:
        run_dir = self.work / run.label
        run_dir.mkdir()
        result = {"suite": run.suite.name, "mode": run.mode, "limit": run.limit, "label": run.label}
        timeout = min(self.args.run_timeout, self.deadline - time.monotonic())
        if timeout < MIN_RUN_S:
            return {**result, "skipped": "not started: too little time left in --budget", "tests": {}}
        command = self.command(run, run_dir)
        env = self.environ(run, run_dir)
        tuning = self.tuning_source(run)
        if tuning is not None:
            shutil.copytree(tuning, env["FLAGGEMS_CACHE_DIR"])
            result["tuning_from"] = str(tuning)
        self.progress(f"start {run.label}")
        started = time.monotonic()
        with open(run_dir / "pytest.log", "wb") as log:
            # Its own session, so that a run past its time can be stopped with all its workers.
            process = subprocess.Popen(command, cwd=run_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
            timed_out = False
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                process.send_signal(signal.SIGINT)  # pytest then writes the JUnit XML of the tests so far
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
            try:  # what the run left behind (a test's own subprocesses) must not hold the GPU for the next
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
        wall = time.monotonic() - started
        output = (run_dir / "pytest.log").read_text(encoding="utf-8", errors="replace")
        try:
            tests = parse_junit(run_dir / "junit.xml")
        except (OSError, ET.ParseError) as error:  # killed before pytest wrote it
            tests, result["junit_error"] = {}, f"{type(error).__name__}: {error}"
        incidents, unreadable = read_incidents(run_dir / "incidents.jsonl") if run.mode != "plain" else ([], 0)
        counts = collections.Counter(entry["outcome"] + (f"_{entry['failure']}" if "failure" in entry else "")
                                     for entry in tests.values())
        actions = collections.Counter(record["action"] for record in incidents)
        result.update({"command": command, "returncode": process.returncode, "timed_out": timed_out,
                       "wall_s": round(wall, 1), "counts": dict(counts), "incident_actions": dict(actions),
                       "unreadable_incident_lines": unreadable, "tests": tests, "incidents": incidents,
                       "log_tail": output[-LOG_TAIL_CHARS:]})
        if NOT_INSTALLED in output:
            result["install_failed"] = True
        self.progress(f"done  {run.label}: {wall:.0f} s, rc {process.returncode}"
                      f"{' (timed out)' if timed_out else ''}, {dict(counts)}, records {dict(actions)}")
        return result

    def tuning_source(self, run: Run) -> Path | None:
        """The FlagGems tuning an observe or on run starts from (``--tuning-from-plain``), if any."""
        if run.mode == "plain" or not self.args.tuning_from_plain:
            return None
        source = self.args.tuning_dir or self.work / Run(run.suite, "plain", None).label / "flaggems-cache"
        return source if source.is_dir() else None

    def progress(self, message: str) -> None:
        with self._lock:
            print(f"[field_suites {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def probe_environment() -> dict:
    done = subprocess.run([sys.executable, "-c", ENVIRONMENT_PROBE], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        return {"error": done.stderr.strip()[-LOG_TAIL_CHARS:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def describe_smemguard(path: Path) -> dict:
    """Which smemguard ran: its version, a hash of its sources, and the git commit when it is a checkout."""
    package = path / "smemguard"
    digest = hashlib.sha256()
    for source in sorted(package.rglob("*.py")):
        digest.update(source.relative_to(package).as_posix().encode() + b"\0" + source.read_bytes())
    version = re.search(r'__version__ = "([^"]+)"', (package / "__init__.py").read_text())
    described = {"path": str(path), "version": version.group(1) if version else None,
                 "sources_sha256": digest.hexdigest()[:16]}
    if (path / ".git").exists():
        commit = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--", "smemguard"],
                               capture_output=True, text=True)
        described.update(commit=commit.stdout.strip() or None, dirty=bool(dirty.stdout.strip()))
    return described


def write_results(results: dict, out: Path) -> None:
    results["table"] = summarize(results)
    temporary = out / f".{RESULTS_NAME}.tmp"
    temporary.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    temporary.replace(out / RESULTS_NAME)


def check_limits(limits: list[str], smemguard: Path) -> None:
    """Every limit must be one smemguard's settings accept; checked with the smemguard that will run."""
    sys.path.insert(0, str(smemguard))
    try:
        from smemguard.facts.settings import parse_max_shared
    finally:
        sys.path.pop(0)
    for limit in limits:
        try:
            parse_max_shared(limit)
        except ValueError as error:
            raise UsageError(f"--limits: {limit!r}: {error}") from None


def _list(text: str, allowed) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [item for item in items if item not in allowed]
    if unknown or not items:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown) or 'nothing'} given; accepted: {', '.join(allowed)}")
    return items


def _selection(text: str) -> tuple[str, str]:
    suite, equals, expression = text.partition("=")
    if not equals or suite not in SUITES:
        raise argparse.ArgumentTypeError(f"{text!r}: expected SUITE=EXPRESSION, SUITE one of {', '.join(SUITES)}")
    return suite, expression


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Run FlagGems', fla-core's, Liger-Kernel's, GemLite's (and, with --suites, SGLang's) own tests "
                    "on the GPU under emulated small-GPU limits: plain (no smemguard, no emulation), "
                    "SMEMGUARD=observe and SMEMGUARD=on.",
        epilog="Test sources go under --field (flaggems/, fla/, liger/, gemlite/, sglang/), each a copy of the "
               "project's files "
               "(see benchmarks/field_suites.md). Example: python benchmarks/field_suites.py --smemguard "
               ".field/smemguard-base --limits T4,L4 --workers 4 --jobs 4 --out /tmp/field")
    parser.add_argument("--smemguard", type=Path, default=REPO,
                        help="directory whose smemguard package the observe and on runs use (default: this checkout)")
    parser.add_argument("--limits", type=lambda text: [item.strip() for item in text.split(",") if item.strip()],
                        default=["T4", "L4"],
                        help="SMEMGUARD_MAX_SHARED values, comma-separated: GPU names or bytes (default T4,L4)")
    parser.add_argument("--modes", type=lambda text: _list(text, MODES), default=list(MODES),
                        help="comma-separated, of plain,observe,on (default all)")
    parser.add_argument("--suites", type=lambda text: _list(text, SUITES),
                        default=[name for name, suite in SUITES.items() if suite.default],
                        help=f"comma-separated, of {','.join(SUITES)} (default: "
                             f"{','.join(name for name, suite in SUITES.items() if suite.default)})")
    parser.add_argument("--select", type=_selection, action="append", default=[], metavar="SUITE=EXPR",
                        help="replace a suite's pytest -k expression (repeatable; empty EXPR: every test)")
    parser.add_argument("--out", type=Path, help="directory for field_suites.json (required unless --report)")
    parser.add_argument("--field", type=Path, default=REPO / ".field",
                        help="directory holding the suites' test sources (default: .field of this checkout)")
    parser.add_argument("--work", type=Path,
                        help="where runs keep JUnit XML, incident files and caches (default: a new temporary "
                             "directory, removed at the end unless --keep-work)")
    parser.add_argument("--keep-work", action="store_true", help="keep the work directory")
    parser.add_argument("--workers", type=int, default=0, help="pytest-xdist workers per run (default 0: none)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1); plain runs go first")
    parser.add_argument("--test-timeout", type=int, default=300,
                        help="pytest-timeout per test in seconds, where installed (default 300; 0: none)")
    parser.add_argument("--run-timeout", type=float, default=1800,
                        help="seconds one run may take before it is interrupted (default 1800)")
    parser.add_argument("--budget", type=float, default=7200,
                        help="seconds for everything; runs not started in time are skipped (default 7200)")
    parser.add_argument("--tuning-from-plain", action="store_true",
                        help="observe and on runs start from a copy of the plain run's FlagGems tuning")
    parser.add_argument("--tuning-dir", type=Path, metavar="DIR",
                        help="with --tuning-from-plain: copy this FLAGGEMS_CACHE_DIR instead of this call's "
                             "plain run's")
    parser.add_argument("--plain-from", type=Path, metavar="JSON",
                        help="take the plain runs of this earlier results file (with --modes observe,on)")
    parser.add_argument("--report", type=Path, metavar="JSON",
                        help="print the table of an earlier results file and exit")
    args = parser.parse_args(argv)
    if not args.limits:
        parser.error("--limits: give at least one GPU name or byte count")
    args.select = dict(args.select)
    if args.report is None and args.out is None:
        parser.error("--out is required (or --report JSON)")
    if args.workers < 0 or args.jobs < 1:
        parser.error("--workers must be 0 or more and --jobs 1 or more")
    return args


def planned_runs(args) -> list[Run]:
    """Plain first (it fills the compile cache the others reuse), then observe and on side by side,
    limit by limit, so that a run cut short by --budget leaves whole (suite, limit) comparisons."""
    suites = [SUITES[name] for name in args.suites]
    runs = [Run(suite, "plain", None) for suite in suites if "plain" in args.modes]
    for limit in args.limits:
        runs += [Run(suite, mode, limit) for suite in suites for mode in ("observe", "on") if mode in args.modes]
    return runs


def run_all(execute, runs: list[Run], jobs: int, finished) -> None:
    """``execute`` every run, ``jobs`` at a time, in order, except that a suite's observe and on runs
    wait for its plain run: they then find its kernels compiled instead of compiling them alongside it.
    ``finished(result)`` is called for each run, one at a time."""
    pending, plain_pending = list(runs), {run.suite.name for run in runs if run.mode == "plain"}
    condition = threading.Condition()

    def ready():
        return next((run for run in pending if run.mode == "plain" or run.suite.name not in plain_pending), None)

    def worker():
        while True:
            with condition:
                condition.wait_for(lambda: not pending or ready() is not None)
                if not pending:
                    return
                run = ready()
                pending.remove(run)
            try:
                result = execute(run)
            except Exception as error:  # our bug: the JSON and the table must say so, and the other runs go on
                traceback.print_exc()
                result = {"suite": run.suite.name, "mode": run.mode, "limit": run.limit, "label": run.label,
                          "tests": {}, "skipped": f"harness error: {type(error).__name__}: {error}"}
            with condition:
                finished(result)
                plain_pending.discard(run.suite.name if run.mode == "plain" else None)
                condition.notify_all()

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for future in [pool.submit(worker) for _ in range(jobs)]:
            future.result()


def earlier_plain_runs(path: Path, suites: list[str]) -> list[dict]:
    try:
        runs = [run for run in json.loads(path.read_text())["runs"]
                if run["mode"] == "plain" and run["suite"] in suites]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UsageError(f"--plain-from: {path} is not a results file of this script "
                         f"({type(error).__name__}: {error})") from None
    if not runs:
        raise UsageError(f"--plain-from: {path} has no plain run of {', '.join(suites)}")
    return runs


def report(path: Path) -> int:
    try:
        results = json.loads(path.read_text())
        table = format_table(summarize(results))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UsageError(f"--report: {path} is not a results file of this script "
                         f"({type(error).__name__}: {error})") from None
    print(table)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report is not None:
        return report(args.report)
    smemguard, field = args.smemguard.resolve(), args.field.resolve()
    if not (smemguard / "smemguard" / "__init__.py").is_file():
        raise UsageError(f"--smemguard: {smemguard} holds no smemguard package (expected {smemguard}/smemguard/)")
    if {"observe", "on"} & set(args.modes):
        check_limits(args.limits, smemguard)
    missing = [f"{name}/{path}" for name in args.suites for path in SUITES[name].paths
               if not (field / SUITES[name].root / path).is_file()]
    missing += [f"{extra}/" for name in args.suites for extra in SUITES[name].pythonpath
                if not (field / extra).is_dir()]
    if missing:
        raise UsageError(f"--field: {field} lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}; "
                         "benchmarks/field_suites.md says how to fetch the test sources (and install a suite's "
                         "wheels)")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="field_suites-", dir=args.work))
    started = time.time()
    environment = probe_environment()
    harness = Harness(args, field, smemguard, work, environment)
    results = {"schema": 1, "meta": meta("flag_gems", "fla_core", "liger_kernel", "gemlite", "sglang", "lmdeploy"),
               "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
               "argv": sys.argv if argv is None else list(argv), "environment": environment,
               "smemguard": describe_smemguard(smemguard), "limits": args.limits, "modes": args.modes,
               "suites": {name: {"paths": list(SUITES[name].paths),
                                 "select": args.select.get(name, SUITES[name].select),
                                 "options": list(SUITES[name].options),
                                 "source": SUITES[name].source,
                                 "pythonpath": list(SUITES[name].pythonpath),
                                 "commit": _read(field / SUITES[name].root / "COMMIT")} for name in args.suites},
               "options": {"workers": args.workers, "jobs": args.jobs, "test_timeout": args.test_timeout,
                           "run_timeout": args.run_timeout, "budget": args.budget,
                           "tuning_from_plain": args.tuning_from_plain,
                           "tuning_dir": str(args.tuning_dir) if args.tuning_dir else None},
               "runs": []}
    if args.plain_from is not None:
        results["plain_from"] = str(args.plain_from)
        results["runs"] += earlier_plain_runs(args.plain_from, args.suites)
    harness.progress(f"{len(planned_runs(args))} runs, {args.jobs} at a time; work directory {work}; "
                     f"environment {json.dumps(environment)}")

    def finished(result: dict) -> None:
        results["runs"].append(result)
        results["wall_s"] = round(time.time() - started, 1)
        write_results(results, args.out)  # after every run: a stopped session keeps what was done

    try:
        run_all(harness.execute, planned_runs(args), args.jobs, finished)
    finally:
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
    harness.progress(f"all runs done in {time.time() - started:.0f} s; results in {args.out / RESULTS_NAME}")
    print(format_table(results["table"]))
    return 0


def _read(path: Path) -> str | None:
    return path.read_text().strip() if path.is_file() else None


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UsageError as error:
        print(f"field_suites: {error}", file=sys.stderr)
        sys.exit(2)
