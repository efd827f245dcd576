"""smemguard report / replay / cache: the morning after."""

import gzip
import json

import pytest
import torch

from smemguard import cli, decisions
from smemguard.testing import fake_gpu

from kernels import matmul_args, matmul_kernel


@pytest.fixture(scope="module")
def real_record(tmp_path_factory, triton_cache):
    """One incident record written by smemguard itself on the CPU harness (sm_89, 40000 B)."""
    import smemguard
    from smemguard.settings import Settings

    log = tmp_path_factory.mktemp("record") / "incidents.jsonl"
    smemguard.install(Settings(log_path=log))
    try:
        storage = torch.empty(256 * 256 + 8, dtype=torch.float16)
        a = storage[: 256 * 256].view(256, 256)
        b, c = torch.empty(256, 256, dtype=torch.float16), torch.empty(256, 256, dtype=torch.float16)
        with fake_gpu("L4", max_shared=40000, cache_dir=triton_cache):
            matmul_kernel[(4, 4)](*matmul_args(a, b, c), BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_stages=4)
    finally:
        smemguard.uninstall()
    return json.loads(log.read_text().splitlines()[0])


def write(path, records, extra_lines=()):
    lines = [json.dumps(r) for r in records] + list(extra_lines)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt") as out:
        out.write("\n".join(lines) + "\n")
    return path


def variant(record, **changes):
    return {**record, **changes}


def test_report_over_mixed_partly_corrupt_files(tmp_path, real_record, capsys):
    other_shape = variant(real_record, args={**real_record["args"], "a_ptr": {**real_record["args"]["a_ptr"],
                                                                             "shape": [512, 256]}},
                          time="2026-11-30T03:10:00+0000", recovery_ms=500.0)
    rank0 = write(tmp_path / "rank0.jsonl", [variant(real_record, time="2026-11-30T03:00:00+0000"), other_shape],
                  extra_lines=["{truncated", '["not", "a", "record"]'])
    rank1 = write(tmp_path / "rank1.jsonl.gz", [variant(real_record, time="2026-11-30T04:00:00+0000",
                                                        action="fallback"),
                                                variant(real_record, kernel="other:kernel", resource="threads")])
    assert cli.main(["report", str(rank0), str(rank1)]) == 0
    out, err = capsys.readouterr()
    header, first, second = out.splitlines()
    assert header.split()[:5] == ["kernel", "resource", "GPU", "count", "shapes"]
    assert first.split()[:3] == ["smemguard.examples:matmul_kernel", "shared", "memory"]
    assert "cuda:89" in first and " 3 " in first and "stages_reduced 2, fallback 1" in first
    assert "2026-11-30T03:00:00+0000" in first and "2026-11-30T04:00:00+0000" in first
    assert second.startswith("other:kernel")
    assert f"{rank0}:3: not JSON" in err and f"{rank0}:4: not an incident record" in err
    assert "2 malformed line(s) skipped" in err


def test_report_json_and_filters(tmp_path, real_record, capsys):
    path = write(tmp_path / "i.jsonl", [variant(real_record, time="2026-11-29T10:00:00+0000"),
                                         variant(real_record, time="2026-11-30T10:00:00+0000"),
                                         variant(real_record, kernel="other:kernel")])
    assert cli.main(["report", str(path), "--json", "--kernel", "matmul", "--since", "2026-11-30"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["malformed"] == []
    [row] = out["rows"]
    assert set(row) == {"kernel", "resource", "gpu", "count", "distinct_shapes", "actions", "first_seen",
                        "last_seen", "recovery_ms"}
    assert (row["count"], row["distinct_shapes"], row["actions"]) == (1, 1, {"stages_reduced": 1})
    assert cli.main(["report", str(path), "--since", "yesterday"]) == 2
    assert "expected a date" in capsys.readouterr().err


def test_replay_on_cpu_reproduces_the_recorded_bytes(tmp_path, real_record, capsys):
    path = write(tmp_path / "i.jsonl", [real_record])
    assert cli.main(["replay", str(path)]) == 0
    out = capsys.readouterr().out
    assert "no GPU: compiling for sm_89 on a stand-in device with a 40000 B limit" in out
    assert "reproduced: OutOfResources shared memory, required 49152 B, limit 40000 B (same as recorded)" in out
    assert "tried num_stages=3: 32768 B, limit 40000 B: fits" in out
    assert "smemguard: stages_reduced" in out


def test_replay_against_another_gpu_limit(tmp_path, real_record, capsys):
    path = write(tmp_path / "i.jsonl", [real_record])
    assert cli.main(["replay", str(path), "--limit", "16000"]) == 0
    out = capsys.readouterr().out
    assert "limit 16000 B: too big" in out and "smemguard: reraised" in out


def test_replay_of_an_unimportable_kernel_names_the_module(tmp_path, real_record, capsys):
    path = write(tmp_path / "i.jsonl", [variant(real_record, kernel="vllm_private.ops:fused_kernel")])
    assert cli.main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert "cannot import module 'vllm_private.ops'" in err and "vllm_private.ops:fused_kernel" in err


def test_replay_index_out_of_range(tmp_path, real_record, capsys):
    path = write(tmp_path / "i.jsonl", [real_record])
    assert cli.main(["replay", str(path), "--index", "5"]) == 2
    assert "out of range; it holds 1 records" in capsys.readouterr().err


def test_cache_show_export_import_clear(tmp_path, capsys):
    here, there = tmp_path / "here", tmp_path / "there"
    decisions.Store(here).put("compile", "case", {"kernel": "m:k", "gpu": "NVIDIA L4", "limit": 101376,
                                                  "from_config": "BLOCK_M=128 num_stages=5",
                                                  "action": "stages_reduced", "final": "num_stages=4"})
    assert cli.main(["cache", "show", "--dir", str(here)]) == 0
    assert "m:k on NVIDIA L4 (limit 101376 B): BLOCK_M=128 num_stages=5 -> stages_reduced num_stages=4" in \
        capsys.readouterr().out
    exported = tmp_path / "fleet.json"
    assert cli.main(["cache", "export", str(exported), "--dir", str(here)]) == 0
    assert cli.main(["cache", "import", str(exported), "--dir", str(there)]) == 0
    assert "imported 1 decisions" in capsys.readouterr().out
    assert decisions.Store(there).get("compile", "case")["action"] == "stages_reduced"
    assert cli.main(["cache", "clear", "--dir", str(there)]) == 0
    assert decisions.Store(there).get("compile", "case") is None
    (tmp_path / "junk.json").write_text("[]")
    assert cli.main(["cache", "import", str(tmp_path / "junk.json"), "--dir", str(there)]) == 2
    assert "not a smemguard decision file" in capsys.readouterr().err
