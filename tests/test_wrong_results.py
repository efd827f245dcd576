"""What smemguard launches after recovering computes the caller's result (issue 45's wrong results): the launch is
decided on the CPU harness, then computed by Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: it makes
every @triton.jit an interpreted function at import) with the tiles and grid the harness saw, and compared with
torch."""

import json

import pytest
import torch
import triton

import smemguard
from smemguard.cli import commands
from smemguard.facts.settings import Settings
from smemguard.store import decision_cache
from smemguard.testing import fake_gpu

from conftest import records, run_python
from kernels import causal_attention_kernel

pytest.importorskip("numpy", reason="Triton's interpreter needs numpy")

SEQ, HEAD_DIM = 256, 64
#: On sm_89 at one stage: 128x64 tiles need 24576 B, 64x64 16384 B; the edited 16x64 12288 B (all fit but the first).
LIMIT = 20000


def interpreted(code: str) -> list:
    """The JSON list ``code`` prints, run by Triton's interpreter."""
    result = run_python(code, env={"TRITON_INTERPRET": "1"})
    return json.loads(result.stdout.splitlines()[-1])


# -- 1: a decision file's tiles are applied only if recovery could have produced them ---------------------------

@smemguard.tile_choice(kernel=causal_attention_kernel, tile=("BLOCK_M", "BLOCK_N"), at=(0, 1))
def attention_tiles(head_dim: int) -> tuple:
    return 128, 64


@smemguard.rerun_on_overflow(attention_tiles)
def attention(q, k, v, o):
    """The library's wrapper: its tiles chosen, the grid computed from them; returns what it launched with."""
    block_m, block_n = attention_tiles(q.shape[-1])
    grid = (triton.cdiv(SEQ, block_m),)
    causal_attention_kernel[grid](q, k, v, o, 0.125, HEAD_DIM=HEAD_DIM, BLOCK_M=block_m, BLOCK_N=block_n,
                                  num_stages=1)
    return block_m, block_n, grid


def attention_errors(launches: list) -> list:
    """The largest error of the attention the interpreter computes for each (BLOCK_M, BLOCK_N, grid) launched.
    The keys and values run 64 rows past the sequence (zeros in the reference's eyes: never read by a right tile
    pair), so a wrong pair reads memory that is there and computes a finite wrong answer."""
    return interpreted(f"""
        import json, torch
        from kernels import causal_attention_kernel, causal_attention_reference
        generator = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn({SEQ} + 64, {HEAD_DIM}, generator=generator).half() for _ in range(3))
        expected = causal_attention_reference(q[:{SEQ}], k[:{SEQ}], v[:{SEQ}], 0.125)
        errors = []
        for block_m, block_n, grid in {launches!r}:
            o = torch.zeros_like(q)
            causal_attention_kernel[tuple(grid)](q, k, v, o, 0.125, HEAD_DIM={HEAD_DIM}, BLOCK_M=block_m,
                                                 BLOCK_N=block_n)
            errors.append(float((o[:{SEQ}].float() - expected).abs().max()))
        print(json.dumps(errors))
    """)


def operands():
    return [torch.empty(SEQ, HEAD_DIM, dtype=torch.float16) for _ in range(4)]


def learnt_file(tmp_path, triton_cache) -> dict:
    """The decision file a host exports after its wrapper learnt 64x64 for the attention."""
    settings = Settings(log_path=tmp_path / "learnt.jsonl", cache_dir=tmp_path / "learnt", disabled=("triton_compile",))
    assert smemguard.install(settings)
    try:
        with fake_gpu("L4", max_shared=LIMIT, cache_dir=triton_cache):
            assert attention(*operands())[:2] == (64, 64)
    finally:
        smemguard.uninstall()
    assert commands.main(["cache", "export", str(tmp_path / "fleet.json"), "--dir", str(tmp_path / "learnt")]) == 0
    return json.loads((tmp_path / "fleet.json").read_text())


def edited(document: dict, value: list, from_config: str | None = None) -> dict:
    [entry] = document["tiles"].values()
    entry["value"], entry["final"] = value, f"BLOCK_M={value[0]} BLOCK_N={value[1]}"
    if from_config is not None:
        entry["from_config"] = from_config
    return document


@pytest.mark.parametrize("value", [[16, 64], [48, 64]])
def test_import_refuses_tiles_that_no_halving_of_the_answered_tiles_gives(tmp_path, triton_cache, capsys, value):
    """16x64 is wrong attention for this kernel (BLOCK_N must divide BLOCK_M); 48 is no tile Triton compiles."""
    fleet = tmp_path / "edited.json"
    fleet.write_text(json.dumps(edited(learnt_file(tmp_path, triton_cache), value)))
    capsys.readouterr()
    assert commands.main(["cache", "import", str(fleet), "--dir", str(tmp_path / "host")]) == 2
    refused = [line for line in capsys.readouterr().err.splitlines() if "not imported" in line]
    assert len(refused) == 2 and f"the tiles {value} are not a halving of [128, 64]" in refused[0], refused
    assert decision_cache.read(tmp_path / "host" / decision_cache.FILE_NAME)[0]["tiles"] == {}, "the tiles left out"


@pytest.mark.parametrize("value, answered", [([16, 64], "BLOCK_M=16 BLOCK_N=128"), ([48, 64], "BLOCK_M=96 BLOCK_N=64")])
def test_stored_tiles_the_wrapper_could_not_have_learnt_are_ignored_and_the_attention_is_right(
        tmp_path, triton_cache, install_guard, incident_log, caplog, value, answered):
    """An entry that says it halved other tiles imports (nothing at import knows what the wrapper answers); where
    the wrapper answers 128x64 it is ignored with one warning, and the call recovers as if nothing were stored.
    What the 16x64 entry would launch computes wrong attention (BLOCK_N must divide BLOCK_M); 48 does not compile."""
    fleet = tmp_path / "edited.json"
    fleet.write_text(json.dumps(edited(learnt_file(tmp_path, triton_cache), value, answered)))
    assert commands.main(["cache", "import", str(fleet), "--dir", str(tmp_path / "host")]) == 0
    install_guard(cache_dir=tmp_path / "host")
    with fake_gpu("L4", max_shared=LIMIT, cache_dir=triton_cache) as gpu:
        launched = attention(*operands())
    entrys_own = [(16, 64, (SEQ // 16,))] if value == [16, 64] else []
    errors = attention_errors([launched, *entrys_own])
    assert errors[0] == pytest.approx(0.0, abs=1e-2), f"{launched}: wrong attention"
    assert all(error > 0.1 for error in errors[1:]), errors
    assert launched == (64, 64, (4,)) and [launch.grid for launch in gpu.launches] == [(4, 1, 1)]
    assert [record["final"] for record in records(incident_log)] == ["BLOCK_M=64 BLOCK_N=64"]
    [ignored] = [record.getMessage() for record in caplog.records if "ignoring stored decision" in record.getMessage()]
    assert f"the tiles {value} are not a halving of [128, 64]" in ignored
