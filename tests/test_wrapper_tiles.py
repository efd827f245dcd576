"""A library's wrapper that chooses its kernel's tiles and computes the grid from them, declared with
``smemguard.tile_choice`` and ``smemguard.rerun_on_overflow`` (smemguard/engine/wrapper_tiles.py): on the CPU harness,
the launch that cannot fit at any stage count is run again with a halved tile, remembered in the process and
across processes, and every rule of the contract holds. A wrapper of our own: neither SGLang's nor vLLM's."""

import inspect
import json

import pytest
import torch
import triton
from triton.runtime.errors import OutOfResources

import smemguard
from smemguard.cli import commands
from smemguard.testing import fake_gpu

from conftest import records, run_python
from kernels import matmul_args, matmul_kernel

N = 256
#: 128x128x64 fp16 tiles need 32768 B at one stage on sm_89, 64x128x64 need 24576 B: this limit takes the second.
LIMIT = 30000


@smemguard.tile_choice(kernel=matmul_kernel, tile="BLOCK_M", smallest=32)
def block_m_for(rows: int, dtype: str) -> int:
    """The library's own choice, tuned on a big GPU."""
    return 128


@smemguard.rerun_on_overflow(block_m_for)
def matmul(a, b, c):
    """The library's wrapper: its tile chosen, the grid computed from it, one launch (already at one stage)."""
    block_m = block_m_for(a.shape[0], str(a.dtype))
    grid = (triton.cdiv(a.shape[0], block_m), triton.cdiv(b.shape[1], 128))
    matmul_kernel[grid](*matmul_args(a, b, c), BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=64, num_stages=1)
    return block_m


def operands():
    return [torch.empty(N, N, dtype=torch.float16) for _ in range(3)]


def test_the_wrapper_runs_again_with_a_halved_tile_and_its_grid(install_guard, incident_log, tmp_path,
                                                               triton_cache, capsys):
    install_guard(cache_dir=tmp_path / "decisions")
    with fake_gpu("L4", max_shared=LIMIT, cache_dir=triton_cache) as gpu:
        assert matmul(*operands()) == 64
        assert [(launch.grid, launch.shared) for launch in gpu.launches] == [((4, 2, 1), 24576)], \
            "one launch, at the halved tile, with the grid the wrapper computed from it"
        assert matmul(*operands()) == 64 and len(gpu.launches) == 2, "the next call chooses it at once"
        assert block_m_for(N, "torch.float16") == 128, "another caller keeps the library's own answer"
    [chosen] = records(incident_log)  # one record of the call: the launch guard leaves it to the declared wrapper
    assert (chosen["action"], chosen["final"], chosen["launched_as"]) == (
        "tiles_reduced", "BLOCK_M=64", "test_wrapper_tiles:matmul")
    assert chosen["shape_class"] == {"rows": N, "dtype": "torch.float16"} and chosen["config"] == "BLOCK_M=128"
    assert (chosen["required"], chosen["limit_hit"], chosen["internal_errors"]) == (32768, LIMIT, 0)
    [entry] = json.loads((tmp_path / "decisions" / "decisions.json").read_text())["tiles"].values()
    assert (entry["value"], entry["wrapper"], entry["tile"]) == (64, "test_wrapper_tiles:matmul", "BLOCK_M")
    # The cache commands know the table: a fleet ships the tile like any decision.
    assert commands.main(["cache", "export", str(tmp_path / "fleet.json"), "--dir", str(tmp_path / "decisions")]) == 0
    assert commands.main(["cache", "import", str(tmp_path / "fleet.json"), "--dir", str(tmp_path / "host")]) == 0
    assert commands.main(["cache", "show", "--dir", str(tmp_path / "host")]) == 0
    assert "smemguard.examples:matmul_kernel on cuda:89 (limit 30000 B): BLOCK_M=128 -> tiles_reduced BLOCK_M=64" in \
        capsys.readouterr().out


def test_the_next_process_chooses_the_stored_tile_at_once(incident_log, tmp_path, triton_cache):
    """A new install (a new process's view: the tiles learnt in memory are forgotten at uninstall) reads the tile
    from the decision cache: no overflow, no record."""
    from smemguard.facts.settings import Settings

    settings = Settings(log_path=incident_log, cache_dir=tmp_path / "decisions", disabled=("triton_compile",))
    for _ in range(2):
        assert smemguard.install(settings)
        try:
            with fake_gpu("L4", max_shared=LIMIT, cache_dir=triton_cache) as gpu:
                assert matmul(*operands()) == 64
        finally:
            smemguard.uninstall()
        assert gpu.launches[-1].grid == (4, 2, 1)
    assert [record["action"] for record in records(incident_log)] == ["tiles_reduced"], \
        "the second process raised nothing"


def test_what_an_install_learnt_is_in_its_engine_and_forgotten_at_uninstall(incident_log, triton_cache):
    """The learnt tile is the engine's (its memory's table of declared wrappers), not the declaration's: with no
    decision cache, the next install meets the overflow again and learns the tile again."""
    from smemguard.engine import wrapper_tiles
    from smemguard.facts.settings import Settings

    settings = Settings(log_path=incident_log, cache_dir=None, disabled=("triton_compile",))
    for _ in range(2):
        assert smemguard.install(settings)
        try:
            with fake_gpu("L4", max_shared=LIMIT, cache_dir=triton_cache):
                assert matmul(*operands()) == 64
                learnt = smemguard.guard.installed_engine().memory.table(wrapper_tiles.MEMORY)
                assert learnt[wrapper_tiles.IN_USE] is True
                [declared] = [value for key, value in learnt.items() if key != wrapper_tiles.IN_USE]
                assert list(declared.known.values()) == [(64,)], "what block_m_for's declaration learnt"
        finally:
            smemguard.uninstall()
        assert learnt == {}, "uninstall() forgot it"
    assert [record["action"] for record in records(incident_log)] == ["tiles_reduced", "tiles_reduced"]


def test_nothing_below_the_smallest_tile_and_the_callers_error_is_kept(install_guard, incident_log, triton_cache):
    install_guard()
    with fake_gpu("L4", max_shared=12000, cache_dir=triton_cache) as gpu:  # even BLOCK_M=32 needs 20480 B
        with pytest.raises(OutOfResources) as caught:
            matmul(*operands())
        assert gpu.launches == []
        assert (caught.value.required, caught.value.limit) == (32768, 12000), "the first error, the caller's own"
        with pytest.raises(OutOfResources) as again:
            matmul(*operands())  # the library's own tile again: nothing smaller was kept
        assert len(gpu.launches) == 0
    [record] = records(incident_log)  # one, from the wrapper's layer; the second call is not recorded again
    assert (record["action"], record["launched_as"], record["config"]) == (
        "reraised", "test_wrapper_tiles:matmul", "BLOCK_M=128")
    assert [attempt.get("config") or attempt["changes"] for attempt in record["attempts"]] == [
        "BLOCK_M=128", "BLOCK_M=64", "BLOCK_M=32"]
    assert [attempt["required"] for attempt in record["attempts"]] == [32768, 24576, 20480], \
        "what each tried needs"
    source, first = inspect.getsourcelines(matmul.__wrapped__)
    line = first + next(index for index, text in enumerate(source) if "matmul_kernel[grid]" in text)  # its launch
    expected = (f"test_wrapper_tiles:matmul at {__file__}:{line} chose BLOCK_M=128 for smemguard.examples:"
                "matmul_kernel (block_m_for); even BLOCK_M=32, the smallest declared, needs 20480 B over 12000 B at "
                "any stage count; to run here, give the wrapper a torch fallback: smemguard.rerun_on_overflow("
                "block_m_for, fallback=fn) with fn taking test_wrapper_tiles:matmul's arguments, or "
                "smemguard.register_fallback(smemguard.examples:matmul_kernel, fn) with fn taking the kernel's")
    assert record["reason"] == expected
    assert any(note.startswith(f"smemguard: {expected}; incident record: ") for note in caught.value.__notes__)
    assert f"smemguard: {expected}" in again.value.__notes__


def torch_matmul(a, b, c):
    """The wrapper's fallback: its result computed in torch (what a pack that knows the op supplies)."""
    if a.dtype != torch.float16:
        return NotImplemented  # arguments it does not cover
    torch.matmul(a, b, out=c)
    return "torch"


@smemguard.rerun_on_overflow(block_m_for, fallback=torch_matmul)
def matmul_or_torch(a, b, c):
    return matmul.__wrapped__(a, b, c)


def test_where_nothing_fits_the_wrappers_fallback_runs_in_its_place(install_guard, incident_log, triton_cache):
    install_guard()
    a, b = torch.randn(N, N).half(), torch.randn(N, N).half()
    c = torch.empty(N, N, dtype=torch.float16)
    with fake_gpu("L4", max_shared=12000, cache_dir=triton_cache) as gpu:
        assert matmul_or_torch(a, b, c) == "torch" and torch.equal(c, torch.matmul(a, b))
        assert matmul_or_torch(a, b, c) == "torch", "at once the next time: nothing is compiled or recorded again"
        with pytest.raises(OutOfResources) as caught:  # float32: the fallback declines, the caller's error
            matmul_or_torch(*(torch.empty(N, N) for _ in range(3)))
        assert gpu.launches == []
    ran, declined = records(incident_log)
    assert (ran["action"], ran["final"], ran["launched_as"]) == (
        "fallback", "test_wrapper_tiles:torch_matmul", "test_wrapper_tiles:matmul_or_torch")
    assert "the smallest declared, needs 20480 B over 12000 B" in ran["reason"]
    assert declined["action"] == "reraised" and declined["shape_class"] == {"rows": N, "dtype": "torch.float32"}
    assert declined["reason"].endswith("; its fallback test_wrapper_tiles:torch_matmul does not cover these arguments")
    assert any("does not cover these arguments" in note for note in caught.value.__notes__)


def test_observe_mode_and_no_install_never_run_the_wrapper_again(install_guard, triton_cache):
    calls = []

    @smemguard.rerun_on_overflow(block_m_for)
    def counted(a, b, c):
        calls.append(1)
        return matmul.__wrapped__(a, b, c)

    for install in (lambda: install_guard(mode="observe"), lambda: None):
        install()
        with fake_gpu("L4", max_shared=LIMIT, cache_dir=triton_cache):
            with pytest.raises(OutOfResources):
                counted(*operands())
        smemguard.uninstall()
    assert len(calls) == 2, "one call each: observe mode changes nothing, and without install() nothing is ours"


def test_an_overflow_of_another_kernel_reaches_the_caller_as_raised(install_guard, triton_cache):
    @smemguard.rerun_on_overflow(block_m_for)
    def other_launch(a, b, c):
        block_m_for(a.shape[0], str(a.dtype))  # chosen, but the kernel that fails is another one
        other = triton.jit(matmul_kernel.fn)
        other[(2, 2)](*matmul_args(a, b, c), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=1)

    install_guard()
    with fake_gpu("L4", max_shared=LIMIT, cache_dir=triton_cache) as gpu:
        with pytest.raises(OutOfResources):
            other_launch(*operands())
        assert gpu.launches == []


@smemguard.tile_choice(kernel=matmul_kernel, tile=("BLOCK_M", "BLOCK_N"), at=(1, 2), smallest=32)
def launch_config(rows: int) -> tuple:
    """A library's choice of its whole launch configuration: (num_warps, BLOCK_M, BLOCK_N, BLOCK_K)."""
    return 4, 128, 128, 64


@smemguard.rerun_on_overflow(launch_config)
def matmul_configured(a, b, c):
    warps, block_m, block_n, block_k = launch_config(a.shape[0])
    grid = (triton.cdiv(a.shape[0], block_m), triton.cdiv(b.shape[1], block_n))
    matmul_kernel[grid](*matmul_args(a, b, c), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                        num_stages=1)


def test_a_choice_of_several_tiles_halves_the_largest_together_and_stores_them_all(install_guard, incident_log,
                                                                                  tmp_path, triton_cache):
    """128x128 (32768 B) and 64x128 (24576 B) do not fit 20000 B; equal tiles halve together: 64x64 (16384 B)."""
    install_guard(cache_dir=tmp_path / "decisions")
    with fake_gpu("L4", max_shared=20000, cache_dir=triton_cache) as gpu:
        matmul_configured(*operands())
        assert [(launch.grid, launch.shared) for launch in gpu.launches] == [((4, 4, 1), 16384)]
    [chosen] = [record for record in records(incident_log) if record["action"] == "tiles_reduced"]
    assert (chosen["config"], chosen["final"], chosen["compiles"]) == ("BLOCK_M=128 BLOCK_N=128",
                                                                       "BLOCK_M=64 BLOCK_N=64", 1)
    [entry] = json.loads((tmp_path / "decisions" / "decisions.json").read_text())["tiles"].values()
    assert (entry["value"], entry["tile"]) == ([64, 64], "BLOCK_M,BLOCK_N")


@smemguard.tile_choice(kernel=matmul_kernel, tile="BLOCK_M",
                      smallest=lambda shape: 64 if shape["kind"] == "narrow" else 32,
                      launch_shape=lambda launched: {"rows": launched["M"],
                                                     "kind": "narrow" if launched["BLOCK_N"] == 64 else "wide"})
def block_m_of_kind(rows: int, kind: str) -> int:
    """A choice the wrapper asks twice, once per kind of launch, with equal answers (as vLLM's unified attention
    asks its prefill and its decode tile); the launch's BLOCK_N tells which answer it took."""
    return 128


@smemguard.rerun_on_overflow(block_m_of_kind)
def matmul_of_kind(a, b, c, narrow: bool):
    wide_m, narrow_m = block_m_of_kind(a.shape[0], "wide"), block_m_of_kind(a.shape[0], "narrow")
    block_m, block_n = (narrow_m, 64) if narrow else (wide_m, 128)
    grid = (triton.cdiv(a.shape[0], block_m), triton.cdiv(b.shape[1], block_n))
    matmul_kernel[grid](*matmul_args(a, b, c), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, num_stages=1)


def test_a_choice_asked_twice_learns_for_the_answer_the_failing_launch_took(install_guard, incident_log, tmp_path,
                                                                            triton_cache):
    """The narrow launch (128x64x64: 24576 B) does not fit 20000 B; 64x64x64 (16384 B) does. Its shape class is
    the narrow answer's, read back from the launch (the first answer, the wide one, has the same tile)."""
    install_guard(cache_dir=tmp_path / "decisions")
    with fake_gpu("L4", max_shared=20000, cache_dir=triton_cache) as gpu:
        matmul_of_kind(*operands(), narrow=True)
        assert [(launch.grid, launch.shared) for launch in gpu.launches] == [((4, 4, 1), 16384)]
    [chosen] = records(incident_log)
    assert (chosen["action"], chosen["final"]) == ("tiles_reduced", "BLOCK_M=64")
    assert chosen["shape_class"] == {"rows": N, "kind": "narrow"}, "the answer the failing launch took"
    [entry] = json.loads((tmp_path / "decisions" / "decisions.json").read_text())["tiles"].values()
    assert entry["shape"] == [["rows", N], ["kind", "narrow"]]


def test_the_smallest_tile_may_depend_on_the_shape_class(install_guard, incident_log, triton_cache):
    """At 12000 B neither 128 nor 64 fits the narrow launch, and its class allows nothing below 64 (the wide one
    would go on to 32): the caller's error, with the tiles tried."""
    install_guard()
    with fake_gpu("L4", max_shared=12000, cache_dir=triton_cache), pytest.raises(OutOfResources) as caught:
        matmul_of_kind(*operands(), narrow=True)
    assert (caught.value.required, caught.value.limit) == (24576, 12000), "the first error, the caller's own"
    [record] = records(incident_log)
    assert record["action"] == "reraised" and "even BLOCK_M=64, the smallest declared" in record["reason"]
    assert [attempt.get("config") or attempt["changes"] for attempt in record["attempts"]] == [
        "BLOCK_M=128", "BLOCK_M=64"]


@pytest.mark.parametrize("learnt_elsewhere", [False, True])
def test_a_declaration_held_back_is_put_in_place_at_its_kernels_first_overflow(learnt_elsewhere, install_guard,
                                                                             incident_log, triton_cache):
    """A pack's declaration (``DeclaredWrappers``) stays out of the library's way until its kernel overflows: the
    wrapper asks the library's own choice, and a healthy call pays for the wrapper's layer only. At the first
    overflow it is put in place and the call runs again, whether or not another wrapper's learnt tile already has
    every declared wrapper keeping books; one record, the launch guard's left out."""
    from smemguard.engine.wrapper_tiles import declaration_of

    def library_choice(rows: int, dtype: str) -> int:
        return 128

    asked = {"choice": library_choice}  # the name the library's wrapper looks up at each call
    held = declaration_of(smemguard.tile_choice(kernel=matmul_kernel, tile="BLOCK_M", smallest=32)(library_choice))

    def put_in_place():
        asked["choice"], held.put_in_place = held.over(asked["choice"]), None

    held.put_in_place = put_in_place

    @smemguard.rerun_on_overflow(held)
    def library_matmul(a, b, c):
        block_m = asked["choice"](a.shape[0], str(a.dtype))
        grid = (triton.cdiv(a.shape[0], block_m), triton.cdiv(b.shape[1], 128))
        matmul_kernel[grid](*matmul_args(a, b, c), BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=64, num_stages=1)
        return block_m

    install_guard()
    with fake_gpu("L4", max_shared=LIMIT, cache_dir=triton_cache) as gpu:
        if learnt_elsewhere:
            assert matmul(*operands()) == 64, "a library's own declared wrapper learns a tile first"
        assert asked["choice"] is library_choice, "held back: the library's own choice"
        assert library_matmul(*operands()) == 64 and asked["choice"] is not library_choice
        assert library_matmul(*operands()) == 64, "in place: the next call chooses the learnt tile at once"
        assert [launch.shared for launch in gpu.launches][-2:] == [24576, 24576]
    assert [(record["action"], record["launched_as"].rpartition(".")[2])
            for record in records(incident_log)][-1:] == [("tiles_reduced", "library_matmul")]
    assert [record["action"] for record in records(incident_log)] == ["tiles_reduced"] * (1 + learnt_elsewhere)


def test_tiles_chosen_inline_are_lowered_at_the_launch_with_the_grid_the_declaration_computes(
        install_guard, incident_log, triton_cache):
    """A wrapper with no choice function: the kernel declared where it launches, its grid rule given."""
    kernel = smemguard.tiles_at_launch(
        matmul_kernel, tile="BLOCK_M", smallest=32, shape=lambda args, kwargs: {"dtype": args[0].dtype},
        grid=lambda grid, launched, lowered: (grid[0] * launched["BLOCK_M"] // lowered["BLOCK_M"], grid[1]))

    @smemguard.rerun_on_overflow(kernel)
    def inline(a, b, c):
        block_m = 128  # chosen inline
        kernel[(triton.cdiv(a.shape[0], block_m), 2)](*matmul_args(a, b, c), BLOCK_M=block_m, BLOCK_N=128,
                                                      BLOCK_K=64, num_stages=1)

    install_guard()
    with fake_gpu("L4", max_shared=LIMIT, cache_dir=triton_cache) as gpu:
        inline(*operands())
        inline(*operands())
        assert [(launch.grid, launch.shared) for launch in gpu.launches] == [((4, 2, 1), 24576)] * 2
    assert [record["final"] for record in records(incident_log) if record["action"] == "tiles_reduced"] == \
        ["BLOCK_M=64"]
    with fake_gpu("L4", cache_dir=triton_cache) as gpu:
        kernel[(1,)](*matmul_args(*operands()), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=1)
        assert gpu.launches[-1].grid == (1, 1, 1), "outside a declared wrapper: the kernel itself"


def test_the_declarations_refuse_what_cannot_be_a_tile_choice():
    with pytest.raises(TypeError, match="has no parameter 'BLOCK_Q'"):
        smemguard.tile_choice(kernel=matmul_kernel, tile="BLOCK_Q")
    with pytest.raises(TypeError, match="must be a Triton kernel"):
        smemguard.tile_choice(kernel=print, tile="BLOCK_M")
    with pytest.raises(TypeError, match="smallest must be a positive integer"):
        smemguard.tile_choice(kernel=matmul_kernel, tile="BLOCK_M", smallest=0)
    with pytest.raises(TypeError, match="takes the smemguard.tile_choice functions"):
        smemguard.rerun_on_overflow(len)
    with pytest.raises(TypeError, match="say where each one is with at="):
        smemguard.tile_choice(kernel=matmul_kernel, tile=("BLOCK_M", "BLOCK_N"))
    with pytest.raises(TypeError, match="one position in the returned tuple per tile"):
        smemguard.tile_choice(kernel=matmul_kernel, tile=("BLOCK_M", "BLOCK_N"), at=(1,))
    with pytest.raises(TypeError, match="grid and shape must be functions"):
        smemguard.tiles_at_launch(matmul_kernel, tile="BLOCK_M", grid=(1,), shape=dict)
    with pytest.raises(TypeError, match="launch_shape must be a function"):
        smemguard.tile_choice(kernel=matmul_kernel, tile="BLOCK_M", launch_shape={"rows": 1})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the results are compared bitwise there")
def test_on_a_gpu_the_halved_tile_gives_the_same_bits(install_guard, monkeypatch):
    """Each output element sums the same K tiles in the same order at BLOCK_M 128 and 64: bitwise the same. The
    limit: one byte under what the library's tile needs on this GPU (30000 B suits sm_89, not sm_90)."""
    a, b = (torch.randn(N, N, device="cuda", dtype=torch.float16) for _ in range(2))
    expected = torch.empty(N, N, device="cuda", dtype=torch.float16)
    # The library's own tile on the full GPU, through a copy of the kernel: a kernel already loaded is not checked
    # against the limit again, so the declared one must make its first launch under it.
    reference = triton.jit(matmul_kernel.fn)
    reference[(triton.cdiv(N, 128), triton.cdiv(N, 128))](*matmul_args(a, b, expected), BLOCK_M=128, BLOCK_N=128,
                                                          BLOCK_K=64, num_stages=1)
    compiled = reference.device_caches[torch.cuda.current_device()][0].values()
    limit = max(kernel.metadata.shared for kernel in compiled) - 1
    monkeypatch.setenv("SMEMGUARD_MAX_SHARED", str(limit))
    install_guard(max_shared=limit)
    got = torch.empty_like(expected)
    assert matmul(a, b, got) == 64
    assert torch.equal(got, expected)


def test_under_the_interpreter_every_declaration_is_accepted_and_the_wrapper_computes_its_result():
    """TRITON_INTERPRET=1 makes every @triton.jit an interpreted function: a library that declares its kernels must
    still import (for a user debugging them), and its declared wrapper compute as the interpreter does."""
    pytest.importorskip("numpy", reason="Triton's interpreter needs numpy")
    result = run_python("""
        import torch, triton
        import smemguard
        from smemguard.kernels import registry
        from kernels import matmul_args, matmul_kernel, tiled_grid

        def torch_matmul(a_ptr, b_ptr, c_ptr, **_):
            torch.matmul(a_ptr, b_ptr, out=c_ptr)

        smemguard.register_fallback(matmul_kernel, torch_matmul)
        smemguard.register_alternatives(matmul_kernel, [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16})])
        assert registry.fallback_for(matmul_kernel) is torch_matmul and registry.alternatives_for(matmul_kernel)

        @smemguard.tile_choice(kernel=matmul_kernel, tile=("BLOCK_M", "BLOCK_N"), at=(0, 1))
        def tiles(rows: int) -> tuple:
            return 32, 16

        inline = smemguard.tiles_at_launch(matmul_kernel, tile="BLOCK_M", shape=lambda args, kwargs: {},
                                           grid=lambda grid, launched, lowered: grid)

        @smemguard.rerun_on_overflow(tiles, inline)
        def matmul(a, b, c):
            block_m, block_n = tiles(a.shape[0])
            inline[tiled_grid(a.shape[0], b.shape[1])](*matmul_args(a, b, c), BLOCK_M=block_m, BLOCK_N=block_n,
                                                       BLOCK_K=16)

        smemguard.install()
        a, b = torch.randn(48, 32), torch.randn(32, 40)
        c = torch.zeros(48, 40)
        matmul(a, b, c)
        print(float((c - a @ b).abs().max()))
    """, env={"TRITON_INTERPRET": "1"})
    assert float(result.stdout.split()[-1]) < 1e-4, result.stdout
