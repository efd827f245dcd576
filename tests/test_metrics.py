"""Prometheus metrics: live series, PROMETHEUS_MULTIPROC_DIR, the textfile, and ``report --format prometheus``."""

import json
import logging
import os
import re
import stat
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import triton
from triton.runtime.errors import OutOfResources

from smemguard import __version__
from smemguard.cli import commands
from smemguard.store import metrics
from smemguard.facts import process, settings
from smemguard.facts.settings import Settings
from smemguard.testing import fake_gpu

from conftest import ROOT, TESTS, records, run_python
from kernels import autotuned, config, matmul_args, matmul_kernel, tiled_grid

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

KERNEL = "smemguard.examples:matmul_kernel"


def smemguard_samples(text: str | None = None) -> dict:
    """{(sample name, sorted labels): value} of smemguard's series: of ``text``, else of the default registry."""
    families = (text_string_to_metric_families(text) if text is not None
                else prometheus_client.REGISTRY.collect())
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in families for s in family.samples
            if s.name.startswith("smemguard_") and not s.name.endswith("_created")}


def incident_deltas(before: dict, after: dict) -> dict:
    """What the incidents in between added to each incident series (smemguard_info is not one)."""
    return {key: after[key] - before.get(key, 0.0) for key in after
            if key[0] != "smemguard_info" and after[key] != before.get(key, 0.0)}


def overflow_a_plain_kernel(triton_cache, expect_error=False):
    """One launch of 49152 B against a 40000 B limit: recoverable with 3 stages."""
    a, b, c = (torch.empty(256, 256, dtype=torch.float16) for _ in range(3))
    with fake_gpu("L4", max_shared=40000, cache_dir=triton_cache):
        launch = lambda: matmul_kernel[(4, 4)](*matmul_args(a, b, c), BLOCK_M=64, BLOCK_N=64, BLOCK_K=64,  # noqa: E731
                                               num_stages=4)
        if expect_error:
            with pytest.raises(OutOfResources):
                launch()
        else:
            launch()


def incident_labels(action):
    return {"kernel": KERNEL, "resource": "shared memory", "action": action, "gpu": "cuda:89"}


def value(name, **labels):
    return prometheus_client.REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("mode, action", [("on", "stages_reduced"), ("observe", "observed")])
def test_an_incident_counts_with_its_labels(install_guard, incident_log, triton_cache, mode, action):
    before = smemguard_samples()
    install_guard(mode=mode)
    assert value("smemguard_info", version=__version__, triton=triton.__version__, mode=mode, limit="device") == 1
    overflow_a_plain_kernel(triton_cache, expect_error=mode == "observe")
    [record] = records(incident_log)
    after = smemguard_samples()
    changed = incident_deltas(before, after)
    incidents = ("smemguard_incidents_total", tuple(sorted(incident_labels(action).items())))
    assert changed.pop(incidents) == 1
    kernel = (("kernel", KERNEL),)
    assert changed.pop(("smemguard_recovery_seconds_count", kernel)) == 1
    assert changed.pop(("smemguard_recovery_seconds_sum", kernel)) == pytest.approx(record["recovery_ms"] / 1000)
    assert all(name == "smemguard_recovery_seconds_bucket" and delta == 1 for (name, _), delta in changed.items())
    assert min(float(dict(labels)["le"]) for _, labels in changed) >= record["recovery_ms"] / 1000
    assert ("smemguard_remembered_total", kernel) not in changed, "decided by trying candidates"


def test_info_follows_install_and_uninstall(install_guard):
    labels = dict(version=__version__, triton=triton.__version__, mode="on", limit="101376")
    install_guard(max_shared=101376)
    assert value("smemguard_info", **labels) == 1
    import smemguard

    smemguard.uninstall()
    assert prometheus_client.REGISTRY.get_sample_value("smemguard_info", labels) is None
    assert not any(name == "smemguard_info" for name, _ in smemguard_samples())


def test_a_decision_from_memory_counts_as_remembered(install_guard, incident_log, triton_cache, tmp_path):
    """Two autotuners of the same kernel and configs: the second recalls the first one's decision."""
    install_guard(cache_dir=tmp_path / "cache")
    a, b, c = (torch.empty(256, 256, dtype=torch.float16) for _ in range(3))
    before = value("smemguard_remembered_total", kernel=KERNEL)
    with fake_gpu("L4", max_shared=30000, cache_dir=triton_cache):
        for _ in range(2):
            autotuned([config(128, 128, 64, 3), config(64, 64, 64, 4)])[tiled_grid(256, 256)](*matmul_args(a, b, c))
    assert [r["remembered"] for r in records(incident_log)] == [False, True]
    assert value("smemguard_remembered_total", kernel=KERNEL) - before == 1


CHILD = """
    import sys
    from pathlib import Path
    if sys.argv[2] == "without-client":
        sys.modules["prometheus_client"] = None  # as if not installed: importing it raises ImportError
    import torch
    import smemguard
    from smemguard.facts.settings import Settings
    from smemguard.testing import fake_gpu
    from kernels import matmul_args, matmul_kernel
    smemguard.install(Settings(metrics_file=Path(sys.argv[3]) if len(sys.argv) > 3 else None))
    assert sys.modules.get("prometheus_client") is None, "installing imports no prometheus_client"
    a, b, c = (torch.empty(256, 256, dtype=torch.float16) for _ in range(3))
    with fake_gpu("L4", max_shared=40000, cache_dir=sys.argv[1]):
        matmul_kernel[(4, 4)](*matmul_args(a, b, c), BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_stages=4)
"""


def run_child(*args: str, **env: str) -> subprocess.CompletedProcess:
    """CHILD in a fresh interpreter, with only ``env`` of the PROMETHEUS_* and SMEMGUARD* variables."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SMEMGUARD", "PROMETHEUS"))}
    full_env.update(PYTHONPATH=f"{TESTS}:{ROOT}", **env)
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), *args], env=full_env,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    assert "compiled with num_stages=3 (32768 B) before it loaded" in child.stderr
    return child


def test_a_child_with_prometheus_multiproc_dir_is_seen_by_a_multiprocess_collector(tmp_path, triton_cache):
    from prometheus_client import CollectorRegistry, multiprocess

    directory = tmp_path / "multiproc"
    directory.mkdir()
    run_child(triton_cache, "with-client", PROMETHEUS_MULTIPROC_DIR=str(directory))
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(directory))
    assert registry.get_sample_value("smemguard_incidents_total", incident_labels("stages_reduced")) == 1
    assert registry.get_sample_value("smemguard_recovery_seconds_count", {"kernel": KERNEL}) == 1
    assert registry.get_sample_value("smemguard_info", {"version": __version__, "triton": triton.__version__,
                                                        "mode": "on", "limit": "device"}) == 1


def test_without_prometheus_client_nothing_is_imported_and_recovery_goes_on(tmp_path, triton_cache):
    child = run_child(triton_cache, "without-client", str(tmp_path / "smemguard.prom"))
    [warning] = [line for line in child.stderr.splitlines() if "prometheus_client" in line]
    assert "SMEMGUARD_METRICS_FILE" in warning and "pip install 'smemguard[metrics]'" in warning
    assert not (tmp_path / "smemguard.prom").exists()


def test_the_textfile_is_valid_exposition_format(install_guard, incident_log, triton_cache, tmp_path):
    textfile = tmp_path / "node" / "smemguard.prom"
    install_guard(metrics_file=textfile)
    overflow_a_plain_kernel(triton_cache)
    [record] = records(incident_log)
    written = smemguard_samples(textfile.read_text())
    assert written[("smemguard_incidents_total", tuple(sorted(incident_labels("stages_reduced").items())))] == 1
    assert written[("smemguard_recovery_seconds_sum", (("kernel", KERNEL),))] == record["recovery_ms"] / 1000
    assert stat.S_IMODE(textfile.stat().st_mode) == 0o644, "readable by node_exporter's user"
    assert sorted(p.name for p in textfile.parent.iterdir()) == [".smemguard.prom.lock", "smemguard.prom"]


WRITER = """
    import sys, time
    from pathlib import Path
    from smemguard.store import metrics
    from smemguard.facts.settings import Settings
    import prometheus_client
    metrics.configure(Settings(metrics_file=Path(sys.argv[1])))
    record = {"kernel": "k:" + sys.argv[2], "resource": "shared memory", "action": "stages_reduced",
              "device": {"name": "NVIDIA L4"}, "recovery_ms": 12.5, "remembered": True}
    started = time.perf_counter()
    for _ in range(int(sys.argv[3])):
        metrics.count(record)
    print((time.perf_counter() - started) / int(sys.argv[3]) * 1000)
"""


def test_the_textfile_is_replaced_atomically_and_concurrent_processes_lose_no_count(tmp_path):
    """Four processes add 40 records each while a reader parses the file: never half a file, 160 in the end."""
    textfile = tmp_path / "smemguard.prom"
    env = {"PYTHONPATH": f"{TESTS}:{ROOT}", "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    writers = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER), str(textfile), str(n % 2), "40"],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in range(4)]
    reads = 0
    while any(w.poll() is None for w in writers):
        if textfile.exists():
            samples = smemguard_samples(textfile.read_text())  # raises on a partial file
            assert all(value == int(value) for (name, _), value in samples.items() if name.endswith("_total"))
            reads += 1
    results = [w.communicate() for w in writers]
    assert all(w.returncode == 0 for w in writers), [err for _, err in results]
    per_write_ms = sorted(float(out.strip()) for out, _ in results)
    print(f"textfile update: {per_write_ms[len(per_write_ms) // 2]:.2f} ms per incident (median of 4 writers)")
    samples = smemguard_samples(textfile.read_text())
    totals = {dict(labels)["kernel"]: v for (name, labels), v in samples.items() if name == "smemguard_incidents_total"}
    assert totals == {"k:0": 80, "k:1": 80}
    assert samples[("smemguard_remembered_total", (("kernel", "k:0"),))] == 80
    assert samples[("smemguard_recovery_seconds_bucket", (("kernel", "k:1"), ("le", "0.01")))] == 0
    assert samples[("smemguard_recovery_seconds_bucket", (("kernel", "k:1"), ("le", "0.05")))] == 80
    assert samples[("smemguard_recovery_seconds_sum", (("kernel", "k:1"),))] == pytest.approx(80 * 0.0125)
    assert reads > 0
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")], "no temporary file is left"


@pytest.fixture
def textfile_only(tmp_path):
    """The textfile configured without installing the guard."""
    metrics.configure(Settings(metrics_file=tmp_path / "smemguard.prom"))
    process.forget_warnings()
    yield tmp_path / "smemguard.prom"
    metrics.configure(None)


RECORD = {"kernel": "k:one", "resource": "shared memory", "action": "fallback", "recovery_ms": 3.0}


def test_a_textfile_smemguard_did_not_write_is_moved_aside(textfile_only, caplog):
    textfile_only.write_text("node_load1 0.5\n")
    with caplog.at_level(logging.WARNING, logger="smemguard"):
        metrics.count(RECORD)
    [aside] = textfile_only.parent.glob("smemguard.prom.bad-*")
    assert aside.read_text() == "node_load1 0.5\n", "nothing is lost"
    [line] = [r.getMessage() for r in caplog.records]
    assert "not a metrics file smemguard wrote" in line and str(aside) in line
    labels = (("action", "fallback"), ("gpu", "unknown"), ("kernel", "k:one"), ("resource", "shared memory"))
    assert smemguard_samples(textfile_only.read_text())[("smemguard_incidents_total", labels)] == 1


def test_a_lock_held_too_long_keeps_the_counts_for_the_next_update(textfile_only, monkeypatch, caplog):
    """Another process holding the textfile's lock past the wait (a stopped writer, a hand-held flock) turns nothing
    off: the incidents counted meanwhile are written with the next update that gets the lock."""
    import fcntl

    from smemguard.facts import files

    monkeypatch.setattr(files, "LOCK_WAIT_S", 0.05)
    monkeypatch.setattr(metrics._exporter, "waiting", [])
    held = os.open(textfile_only.parent / f".{textfile_only.name}.lock", os.O_WRONLY | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)  # another open file description: this process's flock waits on it too
    try:
        with caplog.at_level(logging.WARNING, logger="smemguard"):
            metrics.count(RECORD)
            metrics.count(RECORD)
    finally:
        os.close(held)
    assert not textfile_only.exists(), "nothing written while the lock was held"
    [line] = [r.getMessage() for r in caplog.records]
    assert "held by another process" in line and "counted there at the next update" in line
    time.sleep(0.2)  # past the pause a wait that ran out sets
    metrics.count(RECORD)
    labels = (("action", "fallback"), ("gpu", "unknown"), ("kernel", "k:one"), ("resource", "shared memory"))
    assert smemguard_samples(textfile_only.read_text())[("smemguard_incidents_total", labels)] == 3
    assert metrics._exporter.waiting == []


def test_an_unwritable_textfile_warns_once_and_counting_goes_on(tmp_path, caplog):
    (tmp_path / "file").write_text("")
    metrics.configure(Settings(metrics_file=tmp_path / "file" / "smemguard.prom"))
    process.forget_warnings()
    try:
        before = value("smemguard_incidents_total", kernel="k:one", resource="shared memory", action="fallback",
                       gpu="unknown")
        with caplog.at_level(logging.WARNING, logger="smemguard"):
            metrics.count(RECORD)
            metrics.count(RECORD)
    finally:
        metrics.configure(None)
    [line] = [r.getMessage() for r in caplog.records]
    assert "cannot write metrics to" in line and "SMEMGUARD_METRICS_FILE" in line
    assert value("smemguard_incidents_total", kernel="k:one", resource="shared memory", action="fallback",
                 gpu="unknown") - before == 2


def test_names_taken_by_the_host_leave_its_registry_alone_and_the_textfile_working(tmp_path):
    result = run_python(f"""
        import json, logging
        from pathlib import Path
        import prometheus_client
        from smemguard.store import metrics
        from smemguard.facts.settings import Settings
        logging.basicConfig()
        theirs = prometheus_client.Counter("smemguard_incidents", "the host's own")
        metrics.configure(Settings(metrics_file=Path({str(tmp_path / "smemguard.prom")!r})))
        metrics.count(json.loads({json.dumps(RECORD)!r}))
        print(prometheus_client.REGISTRY.get_sample_value("smemguard_incidents_total"))
    """)
    assert result.stdout.split() == ["0.0"], "the host's counter is untouched"
    [warning] = [line for line in result.stderr.splitlines() if "smemguard" in line]
    assert "no Prometheus metrics in this process" in warning and "Duplicated timeseries" in warning
    assert "smemguard_incidents_total{" in (tmp_path / "smemguard.prom").read_text()


@pytest.mark.parametrize("text", ["", "# only a comment\n"])
def test_an_empty_textfile_is_started_on(textfile_only, text):
    textfile_only.write_text(text)
    metrics.count(RECORD)
    assert not list(textfile_only.parent.glob("*.bad-*"))


def test_the_setting(tmp_path):
    path = tmp_path / "textfile" / "smemguard.prom"
    assert settings.load({"SMEMGUARD_METRICS_FILE": str(path)}).metrics_file == path
    assert settings.load({}).metrics_file is None
    (tmp_path / "file").write_text("")
    for value, why in [(str(tmp_path / "smemguard.txt"), "reads only *.prom files"),
                       (str(tmp_path / "dir.prom"), "is a directory"),
                       (str(tmp_path / "file" / "x.prom"), "is not a directory")]:
        (tmp_path / "dir.prom").mkdir(exist_ok=True)
        loaded = settings.load({"SMEMGUARD_METRICS_FILE": value})
        [problem] = loaded.problems
        assert loaded.metrics_file is None
        assert problem.startswith(f"SMEMGUARD_METRICS_FILE={value!r} ignored: ") and why in problem
        assert "accepted: a writable file path ending in .prom" in problem and "\n" not in problem


def test_report_format_prometheus_prints_the_live_series(install_guard, incident_log, triton_cache, tmp_path,
                                                         capsys):
    """The same incidents, counted live and from their records: the same numbers."""
    before = smemguard_samples()
    install_guard(cache_dir=tmp_path / "cache")
    overflow_a_plain_kernel(triton_cache)
    a, b, c = (torch.empty(256, 256, dtype=torch.float16) for _ in range(3))
    with fake_gpu("L4", max_shared=30000, cache_dir=triton_cache):
        for _ in range(2):
            autotuned([config(128, 128, 64, 3), config(64, 64, 64, 4)])[tiled_grid(256, 256)](*matmul_args(a, b, c))
    after = smemguard_samples()
    live = incident_deltas(before, after)
    with incident_log.open("a") as log:
        log.write("not json\n")
    # a malformed line is bad input (exit 2) but never stops the count: the series come from the rest
    assert commands.main(["report", "--format", "prometheus", str(incident_log)]) == 2
    out, err = capsys.readouterr()
    reported = {key: v for key, v in smemguard_samples(out).items() if v != 0}
    assert reported == pytest.approx(live)
    assert reported[("smemguard_incidents_total", tuple(sorted(incident_labels("config_changed").items())))] == 2
    assert reported[("smemguard_remembered_total", (("kernel", KERNEL),))] == 1
    assert "skipped" in err and ":4: not JSON" in err
    assert commands.main(["report", "--format", "prometheus", "--kernel", "nothing", str(incident_log)]) == 2
    assert smemguard_samples(capsys.readouterr().out) == {}


def test_report_format_prometheus_without_prometheus_client(tmp_path):
    (tmp_path / "i.jsonl").write_text(json.dumps(RECORD) + "\n")
    result = run_python(f"""
        import sys
        sys.modules["prometheus_client"] = None
        from smemguard import cli
        sys.exit(cli.main(["report", "--format", "prometheus", {str(tmp_path / "i.jsonl")!r}]))
    """, check=False)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == ("smemguard report: --format prometheus needs prometheus_client. "
                                     "Fix: pip install 'smemguard[metrics]'")


def test_counting_costs_microseconds_without_a_textfile():
    record = {**RECORD, "kernel": "k:cost"}
    started = time.perf_counter()
    for _ in range(1000):
        metrics.count(record)
    per_record_us = (time.perf_counter() - started) * 1000
    print(f"live series: {per_record_us:.1f} us per incident")
    assert value("smemguard_incidents_total", kernel="k:cost", resource="shared memory", action="fallback",
                 gpu="unknown") == 1000


def test_the_docs_name_only_series_smemguard_exports():
    guide = (ROOT / "docs" / "METRICS.md").read_text()
    text = guide + (ROOT / "README.md").read_text()
    exported = {"smemguard_incidents_total", "smemguard_remembered_total", "smemguard_info",
                *(f"smemguard_recovery_seconds{suffix}" for suffix in ("", "_bucket", "_sum", "_count"))}
    assert set(re.findall(r"\bsmemguard_[a-z_]+", text)) - {"smemguard_"} <= exported
    assert "Buckets " + ", ".join(f"{b:g}" for b in metrics.BUCKETS) + " s" in text
    [dashboard] = [json.loads(block.split("```")[0]) for block in guide.split("```json\n")[1:]]
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert all(any(name in query for name in exported) for query in queries) and len(queries) == 6


@pytest.mark.parametrize("written", ["+Inf", "NaN", "-3"])
def test_a_textfile_holding_what_no_count_can_be_is_moved_aside(textfile_only, caplog, written):
    """Issue 45: non-finite or negative values are not a file smemguard wrote: moved aside with one line (never a
    traceback), and counting goes on from zero."""
    metrics.count(RECORD)
    text = textfile_only.read_text()
    total = re.search(r"^smemguard_incidents_total\{.*\} (1\.0)$", text, re.M)
    textfile_only.write_text(text[:total.start(1)] + written + text[total.end(1):])
    with caplog.at_level(logging.WARNING, logger="smemguard"):
        metrics.count(RECORD)
        metrics.count(RECORD)
    [aside] = textfile_only.parent.glob("smemguard.prom.bad-*")
    assert f"}} {written}\n" in aside.read_text(), "nothing is lost"
    [line] = [r.getMessage() for r in caplog.records]
    assert "not a metrics file smemguard wrote" in line and "not a count smemguard wrote" in line
    assert not any(r.exc_info for r in caplog.records), "no traceback"
    labels = (("action", "fallback"), ("gpu", "unknown"), ("kernel", "k:one"), ("resource", "shared memory"))
    assert smemguard_samples(textfile_only.read_text())[("smemguard_incidents_total", labels)] == 2


@pytest.mark.parametrize("named", ["textfile", "lock"])
def test_the_textfile_and_its_lock_are_never_opened_through_a_symbolic_link(textfile_only, caplog, named):
    """Issue 45: a link named as the textfile is never read (its target's first line never logged) and a link named
    as its lock never creates its target: one line each, and the link's target is left as it was."""
    target = textfile_only.parent / "elsewhere" / "theirs"
    target.parent.mkdir()
    if named == "textfile":
        target.write_text("secret first line\n")
    link = textfile_only if named == "textfile" else textfile_only.parent / f".{textfile_only.name}.lock"
    link.symlink_to(target)
    with caplog.at_level(logging.WARNING, logger="smemguard"):
        metrics.count(RECORD)
        metrics.count(RECORD)
    [line] = [r.getMessage() for r in caplog.records]
    assert "is a symbolic link" in line and "secret" not in line
    if named == "textfile":
        assert target.read_text() == "secret first line\n"
        [aside] = textfile_only.parent.glob("smemguard.prom.bad-*")
        assert aside.is_symlink() and "moved it to" in line, "the link is kept, as it was, under another name"
        assert not textfile_only.is_symlink() and "smemguard_incidents_total{" in textfile_only.read_text()
    else:
        assert not target.exists(), "nothing created where the link points"
        assert "cannot write metrics to" in line and not textfile_only.exists()
