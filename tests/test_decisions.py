"""Decisions persisted across processes (SMEMGUARD_CACHE_DIR/decisions.json)."""

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import triton

from smemguard.store import decision_cache
from smemguard.patches.triton_seams import jit_compile

from conftest import ROOT, TESTS, records

#: Entries as recovery stores them, less the fields that only identify the case.
RERAISED = {"action": "reraised", "reason": "nothing fits"}
FALLBACK = {"action": "fallback", "fallback": "m:f"}


def stages(count: int) -> dict:
    return {"action": "stages_reduced", "options": {"num_stages": count}}


def test_first_decision_stored_for_a_case_wins(tmp_path):
    store = decision_cache.Store(tmp_path)
    first = store.put("compile", "case", stages(3))
    assert store.put("compile", "case", stages(2)) == first
    assert decision_cache.Store(tmp_path).get("compile", "case") == stages(3), "on disk for others"


def test_a_change_by_another_process_is_seen(tmp_path):
    mine, theirs = decision_cache.Store(tmp_path), decision_cache.Store(tmp_path)
    assert mine.get("launch", "case") is None
    theirs.put("launch", "case", RERAISED)
    assert mine.get("launch", "case") == RERAISED


def test_reading_a_cache_nobody_wrote_touches_nothing(tmp_path):
    """Every JIT compile miss asks the store: with no decisions there, no directory, no lock file."""
    directory = tmp_path / "not-yet"
    store = decision_cache.Store(directory)
    assert store.get("compile", "case") is None and store.get("launch", "case") is None
    assert not directory.exists()
    decision_cache.Store(directory).put("compile", "case", stages(3))
    assert store.get("compile", "case") == stages(3), "a file written since is read"


@pytest.mark.parametrize("content, problem", [("{not json", "Expecting property name"),
                                              ('{"schema": 99, "compile": {}, "launch": {}}', "schema 99")])
def test_corrupt_or_foreign_file_is_moved_aside_with_one_warning(tmp_path, caplog, content, problem):
    (tmp_path / "decisions.json").write_text(content)
    store = decision_cache.Store(tmp_path)
    with caplog.at_level(logging.WARNING, logger="smemguard"):
        assert store.get("compile", "case") is None
        store.put("compile", "case", stages(1))
        assert store.get("compile", "case") == stages(1)
    [line] = [r.getMessage() for r in caplog.records]
    assert problem in line and "moved it to" in line
    [aside] = tmp_path.glob("decisions.json.bad-*")
    assert aside.read_text() == content, "nothing is lost"
    assert json.loads((tmp_path / "decisions.json").read_text())["compile"]["case"] == stages(1)


def test_unusable_directory_warns_once_and_keeps_decisions_in_memory(tmp_path, caplog):
    blocked = tmp_path / "cache"
    blocked.write_text("a file, not a directory")
    store = decision_cache.Store(blocked)
    with caplog.at_level(logging.WARNING, logger="smemguard"):
        store.put("compile", "a", stages(2))
        store.put("compile", "b", stages(1))
        assert store.get("compile", "a") == stages(2)
    [line] = [r.getMessage() for r in caplog.records]
    assert "cannot use the decision cache" in line and "SMEMGUARD_CACHE_DIR" in line


@pytest.mark.parametrize("overflow, usable", [
    ({"resource": "shared memory", "required": 131072}, True), ({}, True),
    ({"resource": "shared memory", "required": "lots"}, False), ({"resource": 7, "required": 131072}, False),
    ({"resource": "shared memory", "required": 2**40}, False), ({"resource": "shared memory", "required": -1}, False)])
def test_what_a_stored_variant_needed_is_checked_when_read(overflow, usable):
    """``resource`` and ``required`` (from which a variant is refused before compiling) are optional, and bounded."""
    entry = {"action": "config_changed", "config": {"kwargs": {"BLOCK_M": 64}, "num_warps": 4, "num_stages": 2,
                                                    "num_ctas": 1, "maxnreg": None}, **overflow}
    assert (decision_cache.entry_problems("launch", entry) == []) is usable


def test_export_import_round_trip(tmp_path):
    source = decision_cache.Store(tmp_path / "a")
    source.put("compile", "x", stages(2))
    source.put("launch", "y", RERAISED)
    exported, _ = decision_cache.read(source.path)
    target = decision_cache.Store(tmp_path / "b")
    target.put("launch", "y", FALLBACK)
    assert target.merge(exported) == (1, 1)
    assert target.get("compile", "x") == stages(2)
    assert target.get("launch", "y") == FALLBACK, "what a host learned itself is kept"
    assert target.clear() == 2 and decision_cache.read(target.path) == (decision_cache.empty(), [])
    with pytest.raises(ValueError, match="schema"):
        target.merge({"schema": 0})


WORKER = """
    import json, sys, torch
    from triton import knobs
    import smemguard
    from smemguard.engine import recovery
    from smemguard.facts.settings import Settings
    from smemguard.testing import fake_gpu
    from kernels import autotuned, config, matmul_args, matmul_kernel, tiled_grid

    cache_dir, triton_cache, log, kind = sys.argv[1:5]
    compiled, handled = [], []
    knobs.runtime.jit_cache_hook = lambda **kw: compiled.append(kw["compile"]["num_stages"]) or False
    handle = recovery.handle
    recovery.handle = lambda *a: handled.append(1) or handle(*a)
    # The launch guard's decisions (the compile-time core, which would fit the kernel first, left off).
    smemguard.install(Settings(cache_dir=__import__("pathlib").Path(cache_dir),
                               log_path=__import__("pathlib").Path(log), disabled=("triton_compile",)))
    a, b, c = (torch.empty(256, 256, dtype=torch.float16) for _ in range(3))
    with fake_gpu("L4", max_shared=40000 if kind == "stages" else 30000, cache_dir=triton_cache) as gpu:
        if kind == "stages":
            matmul_kernel[(4, 4)](*matmul_args(a, b, c), BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_stages=4)
        else:
            tuned = autotuned([config(128, 128, 64, 3), config(64, 64, 64, 4)])
            tuned[tiled_grid(256, 256)](*matmul_args(a, b, c))
        print(json.dumps({"stages": gpu.launches[-1].num_stages, "shared": gpu.launches[-1].shared,
                          "compiled": compiled, "handled": len(handled)}))
"""


def run_worker(cache_dir, triton_cache, log, kind, prefix=()):
    return subprocess.Popen([*prefix, sys.executable, "-c", textwrap.dedent(WORKER), str(cache_dir), triton_cache,
                             str(log), kind], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={"PYTHONPATH": f"{TESTS}:{ROOT}", "PATH": "/usr/bin:/bin"})


def finish(process, stderr=None):
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    if stderr is not None:
        stderr.append(err)
    return json.loads(out.strip().splitlines()[-1])


#: Root without the capabilities that let it write whatever the modes say: a read-only directory is one for it too.
AS_ANY_USER = ("setpriv", "--inh-caps=-dac_override,-dac_read_search", "--bounding-set=-dac_override,-dac_read_search")


@pytest.mark.skipif(os.getuid() == 0 and shutil.which("setpriv") is None,
                    reason="as root, a read-only directory needs util-linux's setpriv to drop CAP_DAC_OVERRIDE")
def test_decisions_in_a_read_only_directory_apply_and_nothing_there_changes(tmp_path, triton_cache):
    """A cache baked into an image (a read-only layer, readOnlyRootFilesystem, a server user other than the
    importer) once never applied: the setting was refused as "not writable" and the store's read took the
    writers' lock. Now its decisions apply, a new one stays in the process, and nothing in it changes."""
    cache = tmp_path / "cache"
    finish(run_worker(cache, triton_cache, tmp_path / "writer.jsonl", "stages"))
    (cache / decision_cache.LOCK_NAME).unlink()
    (cache / decision_cache.FILE_NAME).chmod(0o444)
    cache.chmod(0o555)
    baked = (cache / decision_cache.FILE_NAME).read_bytes()
    prefix = AS_ANY_USER if os.getuid() == 0 else ()
    try:
        stderr: list[str] = []
        reader = run_worker(cache, triton_cache, tmp_path / "stages.jsonl", "stages", prefix)
        newcomer = run_worker(cache, triton_cache, tmp_path / "configs.jsonl", "configs", prefix)
        read, _ = finish(reader, stderr), finish(newcomer, stderr)
        commands = {action: subprocess.run([*prefix, sys.executable, "-m", "smemguard.cli", "cache", action],
                                           capture_output=True, text=True, env={"PYTHONPATH": str(ROOT),
                                                                                "SMEMGUARD_CACHE_DIR": str(cache)})
                    for action in ("show", "clear")}
    finally:
        cache.chmod(0o755)
    if jit_compile.PATCH.supported.admits(triton.__version__):
        assert read == {"stages": 3, "shared": 32768, "compiled": [3], "handled": 0}, "the baked decision applied"
    else:  # Triton 3.4 compiles inline: the remembered decision applies at the first failing launch
        assert read["stages"] == 3 and records(tmp_path / "stages.jsonl")[0]["remembered"] is True
    assert "decision cache" not in stderr[0] and "SMEMGUARD_CACHE_DIR" not in stderr[0], stderr[0]
    assert stderr[1].count(f"decision cache in {cache} is read-only: its decisions apply, new ones stay in "
                           "this process") == 1, stderr[1]
    show, clear = commands["show"], commands["clear"]
    assert (show.returncode, show.stderr) == (0, ""), "the setting is accepted as it is"
    assert show.stdout.startswith(f"1 decision in {cache / decision_cache.FILE_NAME}:") and \
        show.stdout.endswith("(read-only: these apply; a new decision stays in the process that made it)\n")
    assert clear.returncode == 2 and clear.stderr == f"smemguard cache clear: {cache} is read-only: the decisions " \
        "in it apply, but this command writes; nothing was changed\n"
    assert sorted(path.name for path in cache.iterdir()) == [decision_cache.FILE_NAME], "no lock file, nothing aside"
    assert (cache / decision_cache.FILE_NAME).read_bytes() == baked


def test_a_second_process_compiles_no_failing_variant(tmp_path, triton_cache):
    first = finish(run_worker(tmp_path / "cache", triton_cache, tmp_path / "first.jsonl", "stages"))
    assert first["stages"] == 3 and 4 in first["compiled"] and first["handled"] == 1
    second = finish(run_worker(tmp_path / "cache", triton_cache, tmp_path / "second.jsonl", "stages"))
    if jit_compile.PATCH.supported.admits(triton.__version__):
        assert second == {"stages": 3, "shared": 32768, "compiled": [3], "handled": 0}
        assert not (tmp_path / "second.jsonl").exists(), "no incident at all in the second process"
    else:  # Triton 3.4 compiles inline: the remembered decision applies at the first failing launch
        assert second == {"stages": 3, "shared": 32768, "compiled": [4, 3], "handled": 1}
        [record] = records(tmp_path / "second.jsonl")
        assert record["remembered"] is True


def test_two_processes_racing_on_a_new_case_store_one_decision_and_both_use_it(tmp_path, triton_cache):
    workers = [run_worker(tmp_path / "cache", triton_cache, tmp_path / f"{n}.jsonl", "stages") for n in range(2)]
    results = [finish(worker) for worker in workers]
    assert [r["stages"] for r in results] == [3, 3]
    stored = json.loads((tmp_path / "cache" / "decisions.json").read_text())
    assert len(stored["compile"]) == 1 and stored["launch"] == {}
    [entry] = stored["compile"].values()
    assert entry["options"] == {"num_stages": 3} and entry["kernel"] == "smemguard.examples:matmul_kernel"
    assert (entry["gpu"], entry["arch"], entry["limit"]) == ("cuda:89", 89, 40000)


def test_a_remembered_config_change_tries_no_candidates(tmp_path, triton_cache):
    first = finish(run_worker(tmp_path / "cache", triton_cache, tmp_path / "first.jsonl", "configs"))
    second = finish(run_worker(tmp_path / "cache", triton_cache, tmp_path / "second.jsonl", "configs"))
    assert first["stages"] == second["stages"] == 2 and first["shared"] == second["shared"] == 16384
    # tuning both configs, the stage count of the tuned one its measured bytes give (1), then the other's
    # variant predicted to fit (2)
    assert first["compiled"] == [3, 4, 1, 2], "tuning both configs, then the ladder"
    if jit_compile.PATCH.supported.admits(triton.__version__):
        # the tuner's benchmark meets the stored variant as failing without compiling it; the launch guard
        # switches to the stored config: no incident
        assert second["compiled"] == [4, 2] and second["handled"] == 1
        assert not (tmp_path / "second.jsonl").exists(), "decided before: no incident"
    else:  # Triton 3.4: applied at the first failing launch, without candidates
        [record] = records(tmp_path / "second.jsonl")
        assert record["remembered"] is True and record["action"] == "config_changed"
        assert len(record["attempts"]) == 1, "only the remembered config is compiled to confirm it fits"
        assert second["compiled"] == [3, 4, 2], "tuning both configs, then only the remembered config"


def test_an_import_that_would_outgrow_what_readers_accept_writes_nothing(tmp_path, capsys):
    """Two imports of 12000 valid entries each would make a file over the 8 MiB every reader accepts: the second is
    refused with one line and nothing written, and the cache stays usable (issue 33)."""
    from smemguard.cli import commands

    def entries(first: int) -> dict:
        data = decision_cache.empty()
        for n in range(first, first + 12000):
            data["compile"][f"{n:024x}"] = {"action": "stages_reduced", "final": "num_stages=3",
                                             "options": {"num_stages": 3}, "resource": "shared memory",
                                             "required": 131072, "kernel": f"pkg.kernels:kernel_{n}",
                                             "source_hash": "0" * 16, "triton": "3.9.0", "arch": 89,
                                             "limit": 101376, "variant": "f" * 32, "gpu": "NVIDIA L4"}
        return data

    cache = tmp_path / "cache"
    for name, first in (("one.json", 0), ("two.json", 12000)):
        (tmp_path / name).write_text(json.dumps(entries(first)))
    assert commands.main(["cache", "import", str(tmp_path / "one.json"), "--dir", str(cache)]) == 0
    before = (cache / decision_cache.FILE_NAME).read_bytes()
    capsys.readouterr()
    assert commands.main(["cache", "import", str(tmp_path / "two.json"), "--dir", str(cache)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "over the 8 MiB a decision file may hold; nothing imported" in err[0]
    assert (cache / decision_cache.FILE_NAME).read_bytes() == before, "nothing written"
    assert commands.main(["cache", "show", "--dir", str(cache)]) == 0, "every reader still accepts the file"


def test_parallel_imports_and_a_serving_processs_write_lose_no_entry(tmp_path):
    """Four `cache import`s of 500 entries each and a serving process storing its own decision, all at once, into
    one cache: 2001 entries after, whatever the interleaving (issue 33 measured this three times; kept as a test)."""
    entry = {"action": "stages_reduced", "final": "num_stages=4", "options": {"num_stages": 4},
             "resource": "shared memory", "required": 131072}
    sources = []
    for index in range(4):
        source = tmp_path / f"fleet-{index}.json"
        source.write_text(json.dumps({"schema": 1, "compile": {f"{index}-{n}": entry for n in range(500)},
                                      "launch": {}}))
        sources.append(source)
    cache = tmp_path / "cache"
    serving = textwrap.dedent(f"""
        from pathlib import Path
        from smemguard.store import decision_cache
        decision_cache.Store(Path({str(cache)!r})).put("compile", "served", {entry!r})
    """)
    processes = [subprocess.Popen([sys.executable, "-m", "smemguard.cli", "cache", "import", str(source), "--dir",
                                   str(cache)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for source in sources] + [subprocess.Popen([sys.executable, "-c", serving], stderr=subprocess.PIPE)]
    for process in processes:
        assert process.wait(timeout=120) == 0, process.stderr.read()
    stored = json.loads((cache / decision_cache.FILE_NAME).read_text())["compile"]
    assert len(stored) == 2001 and "served" in stored


def _matmul_through(kernel, a, b, c):
    """A library's wrapper: it chose 128x128 tiles; the grid is a function of the meta-parameters."""
    from kernels import matmul_args, tiled_grid

    kernel[tiled_grid(a.shape[0], b.shape[1])](*matmul_args(a, b, c), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64,
                                               num_stages=1)


@pytest.mark.parametrize("added", ["alternatives", "fallback", "declared wrapper"])
def test_a_remembered_reraise_yields_to_what_its_note_told_the_user_to_register(tmp_path, triton_cache, added):
    """The first process meets a plain kernel whose tiles fit at no stage count, with nothing registered: it
    re-raises, stores that, and the note says what to register. The next process has done so: what it registered
    runs (a stored fallback already yielded so to another registration); with nothing new, the stored re-raise
    still applies, at once."""
    import torch
    from triton.runtime.errors import OutOfResources

    import smemguard
    from smemguard.facts.settings import Settings
    from smemguard.testing import fake_gpu

    from kernels import config, matmul_kernel

    a, b, c = (torch.empty(256, 256, dtype=torch.float16) for _ in range(3))
    settings = Settings(log_path=tmp_path / "incidents.jsonl", cache_dir=tmp_path / "cache",
                        disabled=("triton_compile",))

    def process(call) -> list:
        """One process's view (a new install: what the last one decided in memory is forgotten): what launched."""
        assert smemguard.install(settings)
        try:
            with fake_gpu("L4", max_shared=30000, cache_dir=triton_cache) as gpu:  # 128x128x64: 32768 B at 1 stage
                call()
        finally:
            smemguard.uninstall()
        return gpu.launches

    for _ in range(2):
        with pytest.raises(OutOfResources) as caught:
            process(lambda: _matmul_through(matmul_kernel, a, b, c))
        assert "smemguard.register_alternatives(smemguard.examples.matmul_kernel" in "\n".join(caught.value.__notes__)
    assert [(record["action"], record["remembered"]) for record in records(tmp_path / "incidents.jsonl")] == [
        ("reraised", False), ("reraised", True)], "stored, then applied at once"

    wrapper = lambda: _matmul_through(matmul_kernel, a, b, c)  # noqa: E731
    if added == "alternatives":
        smemguard.register_alternatives(matmul_kernel, [config(64, 64, 64, 1)])
    elif added == "fallback":
        smemguard.register_fallback(matmul_kernel, lambda **_: None)
    else:
        @smemguard.tile_choice(kernel=matmul_kernel, tile="BLOCK_M")
        def block_m_for(rows: int) -> int:
            return 128

        @smemguard.rerun_on_overflow(block_m_for)
        def declared(a, b, c):
            from kernels import matmul_args

            block_m = block_m_for(a.shape[0])
            matmul_kernel[(triton.cdiv(256, block_m), 2)](*matmul_args(a, b, c), BLOCK_M=block_m, BLOCK_N=128,
                                                          BLOCK_K=64, num_stages=1)

        wrapper = lambda: declared(a, b, c)  # noqa: E731
    try:
        launches = process(wrapper)
    finally:
        smemguard.unregister_alternatives(matmul_kernel)
        smemguard.unregister_fallback(matmul_kernel)
    latest = records(tmp_path / "incidents.jsonl")[2:]
    expected = {"alternatives": ("config_changed", 1), "fallback": ("fallback", 0),
                "declared wrapper": ("tiles_reduced", 1)}[added]
    assert ([record["action"] for record in latest][-1], len(launches)) == expected, latest
    assert not any(record["remembered"] for record in latest), "decided again, now that something is registered"


def test_in_the_same_process_alternatives_registered_after_a_reraise_are_tried(install_guard, incident_log,
                                                                               triton_cache):
    """The install's own memory of the case yields too (it is keyed by what is registered, as by the fallback)."""
    import torch
    from triton.runtime.errors import OutOfResources

    import smemguard
    from smemguard.testing import fake_gpu

    from kernels import config, matmul_kernel

    a, b, c = (torch.empty(256, 256, dtype=torch.float16) for _ in range(3))
    install_guard()
    try:
        with fake_gpu("L4", max_shared=30000, cache_dir=triton_cache) as gpu:
            with pytest.raises(OutOfResources):
                _matmul_through(matmul_kernel, a, b, c)
            smemguard.register_alternatives(matmul_kernel, [config(64, 64, 64, 1)])
            _matmul_through(matmul_kernel, a, b, c)
            assert [(launch.grid, launch.shared) for launch in gpu.launches] == [((4, 4, 1), 16384)]
    finally:
        smemguard.unregister_alternatives(matmul_kernel)
    assert [record["action"] for record in records(incident_log)] == ["reraised", "config_changed"]
