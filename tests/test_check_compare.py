"""The Triton-upgrade diff (issue 47, deliverable 3): ``smemguard check --compare OLD.json NEW.json`` lists, per
kernel, config, GPU and specialization, the bytes before and after, what newly overflows (exit status 1), and refuses
a report it cannot use in one line per problem (exit status 2). On hand-made reports here; on reports made by two
Triton releases where CI names the other environment's python (stages 3 and 4: PYTEST_OTHER_TRITON_PYTHON)."""

import copy
import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from smemguard.cli import commands
from smemguard.facts import versions
from smemguard.preflight import compare

from conftest import ROOT

KERNEL = "kernels.py:matmul"
CONFIG = "BLOCK_M=32 BLOCK_N=32 BLOCK_K=512 num_warps=4 num_stages=3"


def verdict(shared: int, limit: int) -> dict:
    return {"verdict": "fits" if shared <= limit else "overflows", "how": "measured", "shared": shared}


def report(triton: str, shared: dict, limits: dict | None = None) -> dict:
    """A ``check --json`` document: one kernel, one config, ``shared[gpu] = (aligned, misaligned)`` bytes."""
    limits = limits or {"L4": 101376, "MI355X": 163840}
    cells = {gpu: {"fits": all(b <= limits[gpu] for b in shared[gpu]),
                   "specializations": {"aligned": verdict(shared[gpu][0], limits[gpu]),
                                       "misaligned": verdict(shared[gpu][1], limits[gpu])}} for gpu in shared}
    summary = {gpu: {"checked": True, "configs": 1, "fit": int(cells[gpu]["fits"]),
                     "kernels_without_fit": [] if cells[gpu]["fits"] else [
                         {"kernel": KERNEL, "specializations": [spec for spec, cell in
                                                               cells[gpu]["specializations"].items()
                                                               if cell["verdict"] != "fits"]}]} for gpu in shared}
    return {"schema": "smemguard.check/1", "smemguard": "0.1.0", "triton": triton, "exact": True, "exit_status": 0,
            "seconds": 1.0, "compiles": 4, "cache_hits": 0, "verdicts": {"measured": 4, "cached": 0, "estimated": 0},
            "gpus": [{"name": gpu, "arch": "x", "limit": limits[gpu], "checked": True} for gpu in shared],
            "kernels": [{"kernel": KERNEL, "jit": KERNEL, "specializations": [], "unit_args": [],
                         "unsure_unit_args": [], "configs": [{"config": CONFIG, "constexprs": {}, "num_warps": 4,
                                                              "num_stages": 3, "gpus": cells}]}],
            "summary": summary}


def write(tmp_path, name: str, document) -> str:
    path = tmp_path / name
    if isinstance(document, bytes):
        path.write_bytes(document)
    else:
        path.write_text(document if isinstance(document, str) else json.dumps(document))
    return str(path)


#: gfx950 from Triton 3.6 to 3.9 (measured: tests/upgrade_kernels.py), sm_89 the same.
BEFORE = report("3.6.0", {"L4": (131072, 65536), "MI355X": (131072, 131072)})
AFTER = report("3.9.0", {"L4": (131072, 65536), "MI355X": (204208, 196608)})


def test_bytes_before_and_after_and_what_newly_overflows(tmp_path, capsys):
    status = commands.main(["check", "--compare", write(tmp_path, "old.json", BEFORE),
                            write(tmp_path, "new.json", AFTER)])
    out = capsys.readouterr().out
    assert status == 1, "something that fit MI355X no longer does: the gate fails"
    assert "(Triton 3.6.0) -> NEW" in out and "(Triton 3.9.0); GPUs compared: L4, MI355X" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("matmul ")]
    assert [row[6:] for row in rows] == [["MI355X", "aligned", "131072", "fits", "204208", "OVER", "+73136", "B,",
                                          "NEWLY", "OVERFLOWS"],
                                         ["MI355X", "misaligned", "131072", "fits", "196608", "OVER", "+65536", "B,",
                                          "NEWLY", "OVERFLOWS"]], "L4's unchanged bytes are not listed"
    assert (f"NEWLY OVERFLOWS: {KERNEL} {CONFIG} on MI355X [aligned]: 131072 fits -> 204208 OVER (limit 163840 B)"
            in out)
    assert f"NO FITTING CONFIG NOW: {KERNEL} on MI355X when launched aligned / misaligned" in out
    assert out.rstrip().endswith("2 newly overflow (or no longer compile), 1 kernels newly without a fitting config; "
                                 "exit status 1")


def test_fewer_bytes_pass_the_gate_and_json_says_what_moved(tmp_path, capsys):
    """triton #11526 from 3.8 to 3.9: the tf32x3 tile back from 3072 to 1536 B."""
    old = report("3.8.0", {"L4": (3584, 3072)})
    new = report("3.9.0", {"L4": (1536, 1536)})
    status = commands.main(["check", "--compare", write(tmp_path, "old.json", old), write(tmp_path, "new.json", new),
                            "--json"])
    document = json.loads(capsys.readouterr().out)
    assert status == 0 == document["exit_status"] and document["schema"] == "smemguard.compare/1"
    assert [(change["specialization"], change["before"]["shared"], change["after"]["shared"], change["bytes"],
             change["newly_overflows"]) for change in document["changed"]] == [
        ("aligned", 3584, 1536, -2048, False), ("misaligned", 3072, 1536, -1536, False)]
    assert document["old"]["triton"] == "3.8.0" and document["newly_without_fit"] == []


def test_what_cannot_be_compared_is_said_not_guessed(tmp_path, capsys):
    old = report("3.6.0", {"L4": (65536, 65536), "MI355X": (65536, 65536)})
    new = report("3.9.0", {"L4": (65536, 65536), "T4": (65536, 65536)}, {"L4": 101376, "T4": 65536})
    new["kernels"][0]["configs"][0]["gpus"]["L4"]["specializations"]["aligned"] = {
        "verdict": "fits", "how": "estimated", "shared": None, "estimate": {"low": 60000, "high": 70000}}
    new["exact"] = False
    status = commands.main(["check", "--compare", write(tmp_path, "old.json", old), write(tmp_path, "new.json", new)])
    captured = capsys.readouterr()
    assert status == 0 and "GPUs compared: L4\n" in captured.out
    assert "~<=70000 fits" in captured.out, "the estimate is shown as the bound it is"
    assert captured.err.splitlines() == [
        "smemguard check --compare: NEW was made without --exact: 1 of its verdicts are estimated, from a model that "
        "does not know the Triton release; make both reports with --exact to compare every config's bytes",
        "smemguard check --compare: GPUs checked in OLD only, not compared: MI355X",
        "smemguard check --compare: GPUs checked in NEW only, not compared: T4"]


@pytest.mark.parametrize("content, line", [
    (None, "no such file"),
    ("", "not JSON (Expecting value at column 1)"),
    ("[1, 2]", "holds [1, 2], not a report {...}"),
    ('{"schema": "smemguard.check/1", "schema": "x"}', "the key \"schema\" appears twice in one object"),
    ('{"schema": NaN}', "not strict JSON (NaN is not a JSON number)"),
    (b"\x00\xff binary", "not UTF-8 text (byte 1)"),
    ("[" * 100000 + "]" * 100000, "not JSON (RecursionError"),
    ('{"schema": "smemguard.decisions/1"}', "'schema' is \"smemguard.decisions/1\", expected 'smemguard.check/1'"),
])
def test_a_file_that_is_no_report_is_refused_in_one_line(tmp_path, capsys, content, line):
    old = str(tmp_path / "missing.json") if content is None else write(tmp_path, "old.json", content)
    status = commands.main(["check", "--compare", old, write(tmp_path, "new.json", AFTER)])
    captured = capsys.readouterr()
    assert status == 2 and captured.out == ""
    first, fix = captured.err.splitlines()
    assert first.startswith("smemguard check --compare: OLD ") and line in first, first
    assert fix == ("smemguard check --compare: nothing compared. Fix: make OLD with 'smemguard check ... --json > "
                   "FILE'")


def test_a_report_with_bad_fields_names_each_and_reads_no_further(tmp_path, capsys):
    broken = copy.deepcopy(AFTER)
    cell = broken["kernels"][0]["configs"][0]["gpus"]["MI355X"]["specializations"]
    cell["aligned"]["shared"], cell["misaligned"]["verdict"] = "204208", "maybe"
    broken["kernels"] += [{"kernel": "", "configs": []}] * 40
    assert commands.main(["check", "--compare", write(tmp_path, "old.json", BEFORE),
                          write(tmp_path, "new.json", broken)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith(""""kernels[0].configs[0].gpus['MI355X'].specializations['aligned'].shared" is \
"204208", expected an integer >= 0 or null""")
    assert "'kernels[1].kernel' is \"\", expected non-empty text" in lines[2]
    assert len(lines) == compare.MAX_PROBLEMS_SHOWN + 2 and lines[-2].endswith("and more problems (reading stopped "
                                                                               "there)")


def test_a_fifo_a_directory_and_a_huge_file_are_refused_unread(tmp_path, capsys):
    os.mkfifo(tmp_path / "fifo.json")
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as handle:
        handle.truncate(compare.MAX_REPORT + 1)
    new = write(tmp_path, "new.json", AFTER)
    for old, why in ((tmp_path / "fifo.json", "is a FIFO (named pipe), not a regular file"),
                     (tmp_path, "is a directory"), (huge, "is larger than 64 MiB")):
        assert commands.main(["check", "--compare", str(old), new]) == 2
        assert why in capsys.readouterr().err.splitlines()[0]


def test_compare_checks_nothing_else_and_the_help_teaches_it(capsys, tmp_path):
    assert commands.main(["check", "kernels.py", "--compare", "a.json", "b.json"]) == 2
    assert capsys.readouterr().err == ("smemguard check: --compare takes two reports and checks nothing: leave out "
                                       "TARGET, --examples and --gpu (make each report with 'smemguard check TARGET "
                                       "--gpu ... --json > FILE')\n")
    with pytest.raises(SystemExit):
        commands.main(["check", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--compare OLD.json NEW.json" in help_text and "smemguard check --compare before.json after.json" in \
        help_text and "exit status 1 when something that fit no longer does" in help_text


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                max_size=4), max_leaves=30)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_any_mutation_of_a_report_gives_a_verdict_or_one_line_per_problem(data, tmp_path_factory):
    """A report with any field replaced by any JSON value: exit status 0, 1 or 2, never an exception."""
    document = copy.deepcopy(AFTER)
    paths = [("triton",), ("exact",), ("gpus",), ("gpus", 0, "limit"), ("kernels", 0, "configs"),
             ("kernels", 0, "configs", 0, "gpus"), ("kernels", 0, "configs", 0, "gpus", "MI355X", "specializations"),
             ("kernels", 0, "configs", 0, "gpus", "MI355X", "specializations", "aligned"),
             ("kernels", 0, "configs", 0, "gpus", "MI355X", "specializations", "aligned", "estimate"),
             ("summary",), ("summary", "MI355X", "kernels_without_fit")]
    *parents, last = data.draw(st.sampled_from(paths))
    owner = document
    for key in parents:
        owner = owner[key]
    owner[last] = data.draw(JSON)
    folder = tmp_path_factory.mktemp("reports")
    result = compare.run(write(folder, "old.json", BEFORE), write(folder, "new.json", document), as_json=False,
                         quiet=False, say=lambda text: None, err=lambda line: None)
    assert result in (0, 1, 2)


# -- two Triton releases ------------------------------------------------------------------------------------------

OTHER = os.environ.get("PYTEST_OTHER_TRITON_PYTHON")


def check_report(python: str, target: str, gpu: str, path) -> dict:
    """``smemguard check TARGET --gpu GPU --exact --json`` in the environment of ``python``, kept at ``path``."""
    result = subprocess.run([python, "-m", "smemguard.cli", "check", str(ROOT / "tests" / target), "--gpu", gpu,
                             "--exact", "--no-cache", "--quiet", "--json"], capture_output=True, text=True,
                            timeout=600, env={k: v for k, v in os.environ.items() if not k.startswith("SMEMGUARD")})
    assert result.returncode in (0, 1), result.stderr
    path.write_text(result.stdout)
    return json.loads(result.stdout)


#: What moved, per pair of releases (older, newer): {(kernel, GPU): (config, spec) -> (bytes before, after)}.
MOVED = {
    ((3, 6), (3, 9)): {
        ("tf32x3_tile", "L40S"): {},  # triton #11526 is fixed again in 3.9
        ("matmul_kernel", "MI355X"): {("num_stages=2", "aligned"): (65536, 136112),
                                      ("num_stages=2", "misaligned"): (65536, 131072),
                                      ("num_stages=3", "aligned"): (131072, 204208),
                                      ("num_stages=3", "misaligned"): (131072, 196608)}},
    ((3, 8), (3, 9)): {
        ("tf32x3_tile", "L40S"): {("num_stages=2", "aligned"): (3584, 1536),
                                  ("num_stages=2", "misaligned"): (3072, 1536)},
        ("matmul_kernel", "MI355X"): {}},
}


@pytest.mark.skipif(not OTHER, reason="PYTEST_OTHER_TRITON_PYTHON names no other environment (CI stages 3 and 4 do)")
@pytest.mark.parametrize("kernel, gpu", [("tf32x3_tile", "L40S"), ("matmul_kernel", "MI355X")])
def test_check_compare_of_two_triton_releases(kernel, gpu, tmp_path, capsys):
    """triton #11526's tf32x3 tile on an L40S (1536 B on 3.6, 3072 on 3.8, 1536 on 3.9) and gfx950's asynchronous
    copies into LDS (from 3.8 on) on an MI355X, each checked here and in the other environment, then compared."""
    here = check_report(sys.executable, f"upgrade_kernels.py:{kernel}", gpu, tmp_path / "here.json")
    there = check_report(OTHER, f"upgrade_kernels.py:{kernel}", gpu, tmp_path / "there.json")
    (old, old_report), (new, new_report) = sorted([("here.json", here), ("there.json", there)],
                                                  key=lambda item: versions.parse(item[1]["triton"]))
    status = commands.main(["check", "--compare", str(tmp_path / old), str(tmp_path / new), "--json"])
    document = json.loads(capsys.readouterr().out)
    pair = (versions.parse(old_report["triton"]), versions.parse(new_report["triton"]))
    moved = {(change["config"].split()[-1], change["specialization"]): (change["before"]["shared"],
                                                                         change["after"]["shared"])
             for change in document["changed"]}
    if pair in MOVED:
        assert moved == MOVED[pair][kernel, gpu], (pair, document["changed"])
    newly = any(change["newly_overflows"] for change in document["changed"])
    assert status == document["exit_status"] == (1 if newly else 0)
    if pair == ((3, 6), (3, 9)) and kernel == "matmul_kernel":
        assert newly and document["changed"][-1]["after"]["verdict"] == "overflows", "the 3-stage config"
