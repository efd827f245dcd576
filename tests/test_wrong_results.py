"""What smemguard launches after recovering computes the caller's result (issue 45's wrong results): the launch is
decided on the CPU harness, then computed by Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: it makes
every @triton.jit an interpreted function at import) with the tiles and grid the harness saw, and compared with
torch."""

import json

import pytest
import torch
import triton
import triton.language as tl

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


# -- 2: alternatives only where the grid follows the tile that runs ----------------------------------------------

N = 256
#: 128x128x64 fp16 tiles need 32768 B at one stage on sm_89 (matmul and persistent alike); 32x32x32 4096 B.
MATMUL_LIMIT = 30000
BM = BN = 128


def matmul_errors(launches: list) -> list:
    """The largest error of C = A @ B the interpreter computes for each (kernel, grid, constexprs) launched, C
    zeroed first: a program the grid leaves out leaves its tile of C at zero."""
    return interpreted(f"""
        import json, torch
        import kernels
        generator = torch.Generator().manual_seed(0)
        a, b = (torch.randn({N}, {N}, generator=generator).half() for _ in range(2))
        expected = a.float() @ b.float()
        errors = []
        for name, grid, constexprs in {launches!r}:
            c = torch.zeros({N}, {N}, dtype=torch.float16)
            args = kernels.matmul_args(a, b, c)
            if name == "vllm_style_persistent_matmul":
                args = (*args[:3], None, *args[3:])
            getattr(kernels, name)[tuple(grid)](*args, **constexprs)
            errors.append(float((c.float() - expected).abs().max()))
        print(json.dumps(errors))
    """)


def launched(gpu, record: dict, tiles: tuple) -> tuple:
    """(grid, tiles by name) of the last launch the harness saw, its tiles as the record's final config gives them."""
    final = dict(token.split("=") for token in record["final"].split())
    return list(gpu.launches[-1].grid), {name: int(final[name]) for name in tiles}


GRIDS = {
    # The grid: a function that closes over the caller's tiles and ignores its argument.
    "closes over the caller's tiles": ("matmul_kernel", lambda meta: (triton.cdiv(N, BM), triton.cdiv(N, BN))),
    # Reads one tile from its argument and holds the caller's other one: a smaller BLOCK_N would leave columns out.
    "reads BLOCK_M, holds the caller's BLOCK_N": ("matmul_kernel", lambda meta: (triton.cdiv(N, meta["BLOCK_M"]),
                                                                                triton.cdiv(N, BN))),
    "reads the tiles": ("matmul_kernel", lambda meta: (triton.cdiv(N, meta["BLOCK_M"]),
                                                       triton.cdiv(N, meta["BLOCK_N"]))),
    # A persistent kernel loops over the tiles itself: its grid (4 programs) does not change with them, but reads them.
    "persistent": ("vllm_style_persistent_matmul", lambda meta: (
        min(meta["NUM_SMS"], triton.cdiv(N, meta["BLOCK_SIZE_M"]) * triton.cdiv(N, meta["BLOCK_SIZE_N"])),)),
}


@pytest.mark.parametrize("grid", list(GRIDS))
def test_alternatives_run_only_where_the_grid_follows_them_and_c_is_whole(install_guard, incident_log, triton_cache,
                                                                          grid):
    import kernels

    name, grid_function = GRIDS[grid]
    kernel = getattr(kernels, name)
    persistent = name == "vllm_style_persistent_matmul"
    tiles = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K") if persistent else ("BLOCK_M", "BLOCK_N", "BLOCK_K")
    smemguard.register_alternatives(kernel, [triton.Config(dict(zip(tiles, (32, 32, 32))), num_stages=1)])
    a, b, c = (torch.empty(N, N, dtype=torch.float16) for _ in range(3))
    args = kernels.matmul_args(a, b, c)
    args, own = ((*args[:3], None, *args[3:]), {"NUM_SMS": 4, "HAS_BIAS": False}) if persistent else (args, {})
    install_guard()
    try:
        with fake_gpu("L4", max_shared=MATMUL_LIMIT, cache_dir=triton_cache) as gpu:
            try:
                kernel[grid_function](*args, **dict(zip(tiles, (BM, BN, 64))), **own, num_stages=1)
                error = None
            except triton.runtime.errors.OutOfResources as raised:
                error = raised
    finally:
        smemguard.unregister_alternatives(kernel)
    [record] = records(incident_log)
    if gpu.launches:  # whatever ran computes all of C
        grid_seen, constexprs = launched(gpu, record, tiles)
        assert matmul_errors([(name, grid_seen, {**constexprs, **own})]) == [pytest.approx(0.0, abs=0.1)], \
            f"{grid}: {record['final']} on grid {grid_seen} leaves part of C unwritten"
    if grid == "closes over the caller's tiles":
        assert error is not None and gpu.launches == [], "the caller's tiles kept: its own error"
        assert record["action"] == "reraised"
        assert "the grid function reads none of their parameters from its meta-parameters" in record["reason"]
        assert any("reads none of their parameters" in note for note in error.__notes__)
    elif grid == "reads BLOCK_M, holds the caller's BLOCK_N":
        assert error is not None and gpu.launches == [], "the caller's tiles kept: its own error"
        assert record["action"] == "reraised"
        assert "the grid function does not read BLOCK_N from its meta-parameters" in record["reason"]
    else:
        assert error is None and record["action"] == "config_changed" and len(gpu.launches) == 1
        assert gpu.launches[0].grid == ((4, 1, 1) if persistent else (8, 8, 1))


@triton.jit
def _loop_bound_rounded_to_a_tile(x_ptr, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m = tl.program_id(0)
    end = (start_m * BLOCK_M) // BLOCK_N * BLOCK_N  # LMDeploy's causal loop bound: a rounding, not a step
    for _ in range(0, end, BLOCK_N):
        offs = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def test_the_tiles_a_grid_must_follow_are_those_the_program_ids_step_over():
    import kernels

    from smemguard.kernels import parameters

    matmul = parameters.program_tiles(kernels.matmul_kernel)
    assert {"BLOCK_M", "BLOCK_N"} <= matmul and "BLOCK_K" not in matmul, "pid_m * BLOCK_M, pid_n * BLOCK_N; K is looped"
    persistent = parameters.program_tiles(kernels.vllm_style_persistent_matmul)
    assert {"BLOCK_SIZE_M", "BLOCK_SIZE_N"} <= persistent, "through the tile id a persistent program loops over"
    assert parameters.program_tiles(_loop_bound_rounded_to_a_tile) & {"BLOCK_M", "BLOCK_N"} == {"BLOCK_M"}
