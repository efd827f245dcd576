"""Every command on mutated incident records, decision files and settings, in-process: never a traceback.

Valid documents are mutated the ways files go bad: fields of the wrong type, missing and extra
fields, truncation, binary, long lines, unicode (control characters and lone surrogates too),
gzip streams cut short. Output goes to strict UTF-8 streams, as to a terminal. Every command must
end within MAX_SECONDS and MAX_RSS, with exit status 0, 1 or 2, writing nothing but what it names
(report and replay nothing; cache import the decision file and its lock, only when it adds an
entry; no command a path a setting names). The examples are
budgeted per property (BUDGET: 10,000 in all, derandomized, so CI runs the same cases every
time); no case compiles a kernel, and the file takes about 50 s of one core, most of it
hypothesis generating the cases. What the deeper paths do on real compiles is tested in
test_postmortem.py and test_cli.py, and by the regressions at the end of this file.
"""

from __future__ import annotations

import contextlib
import copy
import gzip
import io
import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import smemguard
from smemguard.cli import commands, replay
from smemguard.store import decision_cache, entry_rules
from smemguard.facts import gpus
from smemguard.store.decision import (
    BLOCKS_REDUCED,
    CONFIG_CHANGED,
    FALLBACK,
    PINNED,
    RERAISED,
    STAGES_REDUCED,
    TILES_REDUCED,
    WARPS_REDUCED,
)
from smemguard.facts import settings as smemguard_settings
from smemguard.testing import fake_gpu
from smemguard.facts.untrusted import printable

from kernels import matmul_args, matmul_kernel

BUDGET = {"report": 3000, "replay": 2500, "cache": 2500, "settings": 2000}
assert sum(BUDGET.values()) >= 10_000


def budget(name: str):
    return settings(max_examples=BUDGET[name], deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])


#: A record as smemguard writes it (the CPU harness, sm_89, a 40000 B limit): replayable as it is.
RECORD = {
    "schema": 1, "id": "26437-1", "time": "2026-11-30T08:25:31+0000", "pid": 26437, "host": "vm", "rank": None,
    "kernel": "smemguard.examples:matmul_kernel", "launched_as": "JITFunction",
    "source": "smemguard/examples.py:7", "source_hash": "c87c6cc56c8208e9", "triton": "3.9.0",
    "device": {"arch": 89, "backend": "cuda", "index": 0, "name": None},
    "limit": {"device": 40000, "emulated": None}, "resource": "shared memory", "required": 49152,
    "limit_hit": 40000, "constexprs": {"BLOCK_K": 64, "BLOCK_M": 64, "BLOCK_N": 64}, "num_warps": 4,
    "num_stages": 4, "config": "BLOCK_M=64 BLOCK_N=64 BLOCK_K=64 num_warps=4 num_stages=4", "grid": [4, 4],
    "args": {"K": 256, "M": 256, "N": 256, "stride_ak": 1, "stride_am": 256, "stride_bk": 256, "stride_bn": 1,
             "stride_cm": 256, "stride_cn": 1,
             **{name: {"dtype": "torch.float16", "ptr_mod_16": 0, "shape": [256, 256], "stride": [256, 1]}
                for name in ("a_ptr", "b_ptr", "c_ptr")}},
    "specialization": {"K": "div16", "a_ptr": "div16", "stride_ak": "==1"}, "autotune_key": None,
    "attempts": [{"config": "BLOCK_M=64 BLOCK_N=64 BLOCK_K=64 num_warps=4 num_stages=4", "error": None,
                  "fits": False, "limit": 40000, "required": 49152},
                 {"config": "BLOCK_M=64 BLOCK_N=64 BLOCK_K=64 num_warps=4 num_stages=3", "error": None,
                  "fits": True, "limit": 40000, "required": 32768}],
    "timings_ms": None, "remembered": False, "action": "stages_reduced",
    "final": "BLOCK_M=64 BLOCK_N=64 BLOCK_K=64 num_warps=4 num_stages=3", "reason": None, "recovery_ms": 842.2,
}

_CASE = {"kernel": "m:k", "source_hash": "c87c6cc56c8208e9", "triton": "3.9.0", "gpu": "NVIDIA L4", "arch": 89,
         "limit": 101376, "jit_key": "[...]", "time": 1764491131.0, "host": "vm", "pid": 1,
         "from_config": "BLOCK_M=128 BLOCK_N=128 BLOCK_K=64 num_warps=4 num_stages=5"}
#: A decision file with an entry of every action recovery stores.
DECISIONS = {"schema": 1, "compile": {
    "a" * 24: {**_CASE, "action": "stages_reduced", "options": {"num_stages": 4}, "final": "... num_stages=4"},
    "b" * 24: {**_CASE, "action": "warps_reduced", "options": {"num_warps": 2}, "final": "... num_warps=2"},
}, "launch": {
    "c" * 24: {**_CASE, "tuning_key": "(512,)", "action": "config_changed", "final": "BLOCK_M=64 ...",
               "config": {"kwargs": {"BLOCK_M": 64}, "num_warps": 4, "num_stages": 2, "num_ctas": 1,
                          "maxnreg": None}, "reason": ""},
    "d" * 24: {**_CASE, "tuning_key": "(512,)", "action": "fallback", "final": "fallback m:f", "fallback": "m:f",
               "reason": ""},
    "e" * 24: {**_CASE, "tuning_key": "(1,)", "action": "reraised", "final": None, "reason": "nothing fits"},
}, "tiles": {
    "f" * 24: {**_CASE, "wrapper": "m:w", "choice": "m:c", "tile": "BLOCK_M,BLOCK_N", "shape": [["n", 1]],
               "action": "tiles_reduced", "from_config": "BLOCK_M=128 BLOCK_N=64", "final": "BLOCK_M=64 BLOCK_N=64",
               "value": [64, 64], "resource": "shared memory", "required": 24576},
}, "pins": {
    "m:k* on L4": {"action": "pinned", "kernel": "m:k*", "gpu": "L4", "num_stages": 2, "num_warps": 4, "pid": 1},
}}

# Text with every code point: control characters, lone surrogates, right-to-left marks.
any_text = st.text(st.characters(exclude_categories=()), max_size=12)
#: Values that break readers, drawn whole (one choice each: cheaper than building them from parts).
NASTY = [None, True, False, 0, -1, 2**64, -2**63, 10**400, 1e308, float("nan"), float("inf"), -0.0, 1.5,
         "", " ", "x", "\x00", "\x1b[2J", "\ud800", "\udcff", "é", "\u202e", "a\nb", "0", "4", "null", "[]",
         "torch.float16", "torch.nope", "shared memory", "m:k", "os:system", "a" * 300, [], [0], [-1], ["x"], [[]],
         [1, 2, 3, 4], {}, {"": None}, {"shape": [1], "stride": [1]}, {"descriptor": True}]
json_leaf = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | any_text
json_value = st.sampled_from(NASTY).map(copy.deepcopy) | st.recursive(
    json_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(any_text, inner, max_size=3), max_leaves=4)


def _containers(value, path=()):
    if isinstance(value, (dict, list)):
        yield path, value
        for key, child in (value.items() if isinstance(value, dict) else enumerate(value)):
            yield from _containers(child, (*path, key))


@st.composite
def mutated_value(draw, document):
    """``document`` with 1 to 3 fields replaced by any JSON value, deleted, or added."""
    document = json.loads(json.dumps(document))  # a deep copy, faster
    for _ in range(draw(st.integers(1, 3))):
        path, container = draw(st.sampled_from(list(_containers(document))))
        keys = list(container) if isinstance(container, dict) else list(range(len(container)))
        operation = draw(st.sampled_from(["replace", "delete", "add"] if keys else ["add"]))
        if operation == "add":
            if isinstance(container, dict):
                container[draw(any_text)] = draw(json_value)
            else:
                container.append(draw(json_value))
        elif operation == "replace":
            container[draw(st.sampled_from(keys))] = draw(json_value)
        else:
            del container[draw(st.sampled_from(keys))]
    return document


@st.composite
def damaged_bytes(draw, value):
    """``value`` as one JSON line, perhaps cut short, with bytes spliced in, padded to a long line, or binary."""
    if draw(st.integers(0, 19)) == 0 and isinstance(value, dict):  # a long line, now and then
        value = {**value, "padding": "x" * draw(st.integers(10_000, 100_000))}
    text = json.dumps(value, ensure_ascii=draw(st.booleans()))
    raw = text.encode("utf-8", "surrogatepass")  # lone surrogates become bytes no UTF-8 decoder accepts
    damage = draw(st.sampled_from(["none", "none", "truncate", "splice", "binary"]))
    if damage == "truncate":
        raw = raw[:draw(st.integers(0, len(raw)))]
    elif damage == "splice":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.binary(min_size=1, max_size=8) | any_text.map(
            lambda t: t.encode("utf-8", "surrogatepass"))) + raw[at:]
    elif damage == "binary":
        raw = draw(st.binary(max_size=64))
    return raw


#: Bounds on one command over one damaged input: seconds, and the test process's peak memory.
MAX_SECONDS = 30
MAX_RSS = 3 * 2**30


def run(argv: list[str]) -> tuple[int, str, str]:
    """cli.main(argv) with stdout and stderr as a terminal's: strict UTF-8 (a lone surrogate cannot be printed)."""
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", write_through=True)
    err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", write_through=True)
    started = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = commands.main(argv)
    assert time.monotonic() - started < MAX_SECONDS, argv
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 < MAX_RSS, argv
    texts = [stream.buffer.getvalue().decode("utf-8") for stream in (out, err)]
    assert status in (0, 1, 2), (argv, status)
    for line in texts[1].splitlines():  # one line per problem, each saying who speaks (or a problem list's item)
        assert line.startswith(("smemguard", "  ")), (argv, line)
    return status, texts[0], texts[1]


@pytest.fixture(scope="module")
def scratch():
    # Thousands of small files: a RAM file system where there is one keeps them out of the time budget.
    directory = Path(tempfile.mkdtemp(prefix="smemguard-untrusted-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                      else None))
    yield directory
    shutil.rmtree(directory)


@pytest.fixture(autouse=True)
def _no_smemguard_settings(monkeypatch, scratch):
    for name in list(os.environ):
        if name.startswith("SMEMGUARD"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CACHE_HOME", str(scratch / "xdg"))  # never the user's own decision cache


@pytest.fixture
def fresh(scratch):
    """A new empty directory per example (hypothesis reuses the test's fixtures across examples)."""
    counter = iter(range(10**9))
    return lambda: Path(tempfile.mkdtemp(dir=scratch, prefix=f"{next(counter)}-"))


@budget("report")
@given(data=st.data())
def test_report_survives_any_damage_and_counts_every_good_line(fresh, data):
    damaged = data.draw(damaged_bytes(data.draw(mutated_value(RECORD))))
    lines = json.dumps(RECORD).encode() + b"\n" + damaged + b"\n"
    zipped = data.draw(st.integers(0, 3)) == 0
    if zipped:
        lines = gzip.compress(lines, mtime=0)
        cut = data.draw(st.none() | st.integers(0, len(lines)))
        lines = lines if cut is None else lines[:cut]
    path = fresh() / ("i.jsonl.gz" if zipped else "i.jsonl")
    path.write_bytes(lines)
    extra = data.draw(st.sampled_from([[], ["--kernel", "matmul"], ["--since", "2d"]]) | st.tuples(
        st.sampled_from(["--kernel", "--since"]), any_text.filter(lambda t: not t.startswith("-"))).map(list))
    as_json = data.draw(st.booleans())
    status, out, err = run(["report", str(path), *extra] + (["--json"] if as_json else []))
    assert (status == 0) == (err == ""), err
    assert list(path.parent.iterdir()) == [path], "report writes nothing"
    if as_json and out:  # none after a bad --since
        json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    if as_json and not zipped and not extra:
        assert sum(row["count"] for row in json.loads(out)["rows"]) >= 1, "the good line is always counted"


def _invalidate(data, record):
    """Make a field replay needs missing or of the wrong type, so the record is refused before any compile."""
    if not isinstance(record, dict):
        return record
    field = data.draw(st.sampled_from(sorted(replay.REQUIRED)))
    expect = replay.REQUIRED[field]
    if data.draw(st.booleans()):
        record.pop(field, None)
    else:
        record[field] = data.draw(json_value.filter(lambda value: expect.problem(field, value) is not None))
    return record


@budget("replay")
@given(data=st.data())
def test_replay_refuses_any_damaged_record_in_one_line_per_problem(fresh, data):
    record = _invalidate(data, data.draw(mutated_value(RECORD)))
    path = fresh() / "i.jsonl"
    path.write_bytes(data.draw(damaged_bytes(record)) + b"\n")
    index = data.draw(st.sampled_from([[], ["--index", "0"], ["--index", "-3"], ["--kernel", "matmul"]]))
    status, out, err = run(["replay", str(path), *index])
    assert status == 2 and out == "", (out, err)
    assert list(path.parent.iterdir()) == [path], "replay writes nothing"
    assert err.count("cannot replay this record") <= 1


def _entries(document) -> list[tuple[str, str]]:
    if not isinstance(document, dict):
        return []
    return [(kind, key) for kind in decision_cache.KINDS if isinstance(document.get(kind), dict)
            for key in document[kind]]


@budget("cache")
@given(data=st.data())
def test_cache_never_stores_an_entry_recovery_cannot_apply(fresh, data):
    document = data.draw(mutated_value(DECISIONS))
    raw = data.draw(damaged_bytes(document))
    incoming = fresh() / "fleet.json"
    incoming.write_bytes(raw)

    imported_into = fresh()
    status, _, err = run(["cache", "import", str(incoming), "--dir", str(imported_into)])
    stored = decision_cache.read(imported_into / decision_cache.FILE_NAME)[1]
    assert stored == [], "stored an entry a later command cannot read"
    written = sorted(path.name for path in imported_into.iterdir())
    assert written in ([], [decision_cache.FILE_NAME, decision_cache.LOCK_NAME]), written
    try:
        usable = _entries(decision_cache.parse(raw)[0])
    except ValueError:
        usable = []
    assert (written == []) == (usable == []), "only an import that adds an entry creates the cache's files"

    cache = fresh()
    (cache / decision_cache.FILE_NAME).write_bytes(raw)  # the same bytes as the host's own cache
    try:
        _, dropped = decision_cache.parse(raw)
        readable = True
    except ValueError:
        readable, dropped = False, []
    status, _, err = run(["cache", "show", "--dir", str(cache)])
    assert status == (0 if readable and not dropped else 2), err
    exported = cache.parent / f"{cache.name}-export.json"
    status, _, _ = run(["cache", "export", str(exported), "--dir", str(cache)])
    if readable:
        assert run(["cache", "import", str(exported), "--dir", str(fresh())])[::2] == (0, ""), \
            "export writes only what import accepts"
    else:
        assert status == 2 and not exported.exists()
        assert (cache / decision_cache.FILE_NAME).read_bytes() == raw, "a file that is not a decision file is untouched"
    store = decision_cache.Store(cache)  # recovery's own reading
    assert store.get("compile", "no such case") is None
    for kind, key in _entries(document):
        entry = store.get(kind, key)
        assert entry is None or decision_cache.entry_problems(kind, entry) == []
    assert run(["cache", "clear", "--dir", str(cache)])[0] == 0, "the store set the unreadable file aside"


_env_text = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=20)


@budget("settings")
@given(data=st.data())
def test_every_command_reports_any_settings_in_one_line_each(fresh, data):
    home = fresh()
    (home / "a-file").write_text("not a directory")
    os.mkfifo(home / "a-fifo")
    env = {
        "SMEMGUARD": data.draw(st.sampled_from(["on", "off", "observe", "strict", "STRICT ", ""]) | _env_text),
        "SMEMGUARD_MAX_SHARED": data.draw(st.sampled_from(["L4", "101376", "0", "-5", "MI300X", "4090", "9" * 5000])
                                          | _env_text),
        "SMEMGUARD_LOG": data.draw(st.sampled_from([str(home / "i.jsonl"), str(home), str(home / "a-file" / "x"),
                                                    str(home / "a-fifo"), "/dev/full", "~nobody-here/i.jsonl",
                                                    "x" * 5000]) | _env_text),
        "SMEMGUARD_METRICS_FILE": data.draw(st.sampled_from(["", str(home / "m.prom"), str(home / "a-fifo"),
                                                             "~nobody-here/m.prom", "/x" * 3000]) | _env_text),
        "SMEMGUARD_CACHE_DIR": data.draw(st.sampled_from([str(home / "c"), str(home / "a-file"), "off", "OFF",
                                                          "~nobody-here", "/x" * 3000])
                                         | _env_text.map(lambda t: str(home / t))),
        "SMEMGUARD_PINS": data.draw(st.sampled_from(["", str(home / "a-file"), str(home / "a-fifo"), str(home),
                                                     "~nobody-here/p.json", "/x" * 3000]) | _env_text),
        **data.draw(st.dictionaries(_env_text.filter(lambda t: "=" not in t).map(lambda t: "SMEMGUARD_" + t),
                                    _env_text, max_size=2)),
    }
    not_a_gpu = _env_text.filter(lambda t: gpus.lookup(t) is None and not t.startswith("-"))
    command = data.draw(st.sampled_from([["gpus"], ["gpus", "--json"], ["cache", "show"],
                                         ["report", str(home / "missing.jsonl")]]) | not_a_gpu.map(
        lambda t: ["demo", "--gpu", t]))
    with mock.patch.dict(os.environ, env):
        expected = smemguard_settings.load()
        status, out, err = run(command)
    assert sorted(path.name for path in home.iterdir()) == ["a-fifo", "a-file"], "no command writes a setting's path"
    cache_dir_problem = expected.problem_of(smemguard_settings.CACHE_DIR)
    for problem in expected.problems:
        if command[0] == "cache" and problem == cache_dir_problem and expected.mode != "strict":  # in the refusal
            assert err.count(printable(problem.removesuffix(smemguard_settings.USING_THE_DEFAULT))) == 1
            assert printable(problem) not in err
        else:
            assert err.count(f"smemguard: {printable(problem)}\n") == 1
    if expected.problems and expected.mode == "strict":
        assert status == 2 and out == ""
    elif command[:2] == ["cache", "show"] and cache_dir_problem is not None:
        assert status == 2 and "Nothing was touched" in err


def test_a_line_longer_than_the_limit_is_skipped_and_the_next_one_read(fresh, capsys):
    path = fresh() / "i.jsonl"
    with open(path, "wb") as out:
        out.write(b'{"kernel": "' + b"k" * (17 * 2**20) + b'", "action": "x"}\n')
        out.write(json.dumps(RECORD).encode() + b"\n")
    assert commands.main(["report", str(path)]) == 2
    out, err = capsys.readouterr()
    assert f"{path}:1: longer than 16 MiB; line skipped" in err
    assert "smemguard.examples:matmul_kernel" in out


def test_a_number_too_long_for_python_is_a_bad_line_not_a_crash(fresh, capsys):
    path = fresh() / "i.jsonl"
    too_long = '{"kernel": "m:k", "action": "x", "recovery_ms": 1' + "0" * 5000 + "}"
    path.write_text(too_long + "\n" + json.dumps(RECORD) + "\n")
    assert commands.main(["report", str(path)]) == 2
    out, err = capsys.readouterr()
    assert f"{path}:1: not JSON (ValueError: Exceeds the limit (4300 digits)" in err
    assert "smemguard.examples:matmul_kernel" in out


def test_the_decision_actions_are_recoverys_own_and_the_pins():
    stored = {STAGES_REDUCED, WARPS_REDUCED, CONFIG_CHANGED, FALLBACK, RERAISED, BLOCKS_REDUCED, TILES_REDUCED, PINNED}
    assert {action for actions in entry_rules.ACTIONS.values() for action in actions} == stored


def test_a_cached_entry_recovery_cannot_apply_is_set_aside_and_the_launch_still_recovers(tmp_path, install_guard,
                                                                                         triton_cache, caplog):
    cache = tmp_path / "cache"
    storage = torch.empty(256 * 256 + 8, dtype=torch.float16)
    a = storage[: 256 * 256].view(256, 256)
    b, c = torch.empty(256, 256, dtype=torch.float16), torch.empty(256, 256, dtype=torch.float16)

    def launch():
        with fake_gpu("L4", max_shared=40000, cache_dir=triton_cache) as gpu:
            matmul_kernel[(4, 4)](*matmul_args(a, b, c), BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_stages=4)
        return gpu.launches[-1]

    install_guard(cache_dir=cache)
    assert launch().num_stages == 3
    smemguard.uninstall()
    stored = json.loads((cache / "decisions.json").read_text())
    [key] = stored["compile"]
    stored["compile"][key]["options"] = {"num_stages": "three"}  # hand-edited
    (cache / "decisions.json").write_text(json.dumps(stored))
    install_guard(cache_dir=cache)
    assert launch().num_stages == 3, "recovered as if nothing had been remembered"
    [aside] = cache.glob("decisions.json.bad-*")
    assert json.loads(aside.read_text()) == stored, "the hand-edited file is kept as it was"
    assert json.loads((cache / "decisions.json").read_text())["compile"][key]["options"] == {"num_stages": 3}
    [warning] = [r.getMessage() for r in caplog.records if "cannot apply" in r.getMessage()]
    assert "'options' is {\"num_stages\": \"three\"}" in warning and f"moved the file to {aside}" in warning
