"""An ``OutOfResources`` that gives no byte counts flows through records, report, replay and the metrics.

SGLang 0.5.23's DSA sparse-MLA prefill launches its kernel at each of its own candidate tiles, catches each
``OutOfResources`` and, when none fits, raises ``OutOfResources(0, 0, "shared memory: no fallback config fits this
device/shape")`` itself (``sglang/kernels/ops/attention/dsa/triton_sparse_mla_prefill.py``). Here a launcher that
does the same in its ``run`` (an ``Autotuner`` subclass, launched as ``kernel[grid](...)``) raises it on the CPU
harness: the caller gets that error, one record keeps Required 0 and limit 0, ``smemguard report`` counts it (table,
JSON, Prometheus), ``smemguard replay`` says in one line why it cannot run it again, and the live series count it."""

import json

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.autotuner import Autotuner
from triton.runtime.errors import OutOfResources

from smemguard.cli import commands
from smemguard.testing import fake_gpu

from conftest import records

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

NO_CONFIG_FITS = "shared memory: no fallback config fits this device/shape"


@triton.jit
def _copy(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n), mask=offs < n)


class SteppingDown(Autotuner):
    """A library's launcher that tries its own tiles and, when none fits, says so without byte counts."""

    def run(self, *args, **kwargs):
        raise OutOfResources(0, 0, NO_CONFIG_FITS)


def incidents_total(text: str) -> dict:
    return {tuple(sorted(sample.labels.items())): sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "smemguard_incidents_total"}


def test_a_zero_byte_out_of_resources_is_recorded_reported_and_explained(install_guard, incident_log, triton_cache,
                                                                        capsys, caplog):
    install_guard()
    launcher = SteppingDown(_copy, _copy.arg_names, [triton.Config({"BLOCK": 64})], ["n"], None, None, None, None)
    x = torch.empty(100)
    live_before = incidents_total(prometheus_client.generate_latest().decode())
    with fake_gpu("RTX5090", cache_dir=triton_cache), pytest.raises(OutOfResources) as caught:
        launcher[(2,)](x, torch.empty_like(x), 100)
    assert (caught.value.required, caught.value.limit, caught.value.name) == (0, 0, NO_CONFIG_FITS)
    assert "Traceback" not in caplog.text
    [warning] = [entry.getMessage() for entry in caplog.records if entry.getMessage().startswith("smemguard:")]
    assert f"{NO_CONFIG_FITS} (the error gives no byte counts) with ?; re-raised" in warning
    [record] = records(incident_log)
    assert (record["required"], record["limit_hit"], record["resource"], record["action"]) == (
        0, 0, NO_CONFIG_FITS, "reraised")
    kernel = record["kernel"]
    labels = tuple(sorted({"kernel": kernel, "resource": NO_CONFIG_FITS, "action": "reraised",
                           "gpu": "cuda:120"}.items()))
    live = incidents_total(prometheus_client.generate_latest().decode())
    assert live[labels] - live_before.get(labels, 0.0) == 1

    assert commands.main(["report", str(incident_log)]) == 0
    table = capsys.readouterr().out
    assert kernel in table and NO_CONFIG_FITS in table and "reraised 1" in table
    assert commands.main(["report", "--format", "json", str(incident_log)]) == 0
    assert json.loads(capsys.readouterr().out)
    assert commands.main(["report", "--format", "prometheus", str(incident_log)]) == 0
    assert incidents_total(capsys.readouterr().out) == {labels: 1.0}

    assert commands.main(["replay", str(incident_log)]) == 1
    out, err = capsys.readouterr()
    assert err == "" and out == (
        f"not reproduced: {kernel}: the error gives no byte counts (Required 0 B, limit 0 B): the library raised "
        "OutOfResources itself, not Triton's check of a compiled kernel, so there is no launch to run again\n")
