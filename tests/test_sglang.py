"""SGLang's own Triton attention wrappers under smemguard's SGLang packs (smemguard/patches/sglang_*.py), on the CPU
harness compiled for sm_120 (RTX 5090, 101376 B), sm_89 (L4) and sm_75 (T4): the two field failures (ktransformers
#1570, SGLang PR #27962, both reported on SGLang 0.5.5) and their neighbours recover with smaller tiles and the grids
SGLang would compute for them, and the next call chooses them at once.

The same tests run against whichever SGLang release is importable, wherever it keeps its kernels (the packs' homes):
CI stage "1b" runs them with SGLang 0.5.23 (``pip install --no-deps sglang==0.5.23`` and the pure-Python packages its
kernels' imports need) and again with SGLang 0.5.5 first on ``PYTHONPATH`` (its wheel unpacked beside them), whose
kernels live in ``sglang.srt.layers.attention.triton_ops``. Launches on the harness execute nothing: SGLang's own
tests compare the numbers on the GPU (benchmarks/field_suites.py, docs/BENCHMARKS.md). SGLang reads the device's
capability once at import; the tests set it (``CUDA_CAPABILITY``, ``_is_cuda``) as that GPU's process would have."""

import importlib
import inspect

import pytest
import torch
from triton.runtime.errors import OutOfResources

from smemguard.patches.contrib import sglang_extend_attention, sglang_prefill_attention
from smemguard.testing import fake_gpu

from conftest import records


def _home(pack):
    """The pack's kernel module of the SGLang release installed here, wherever it keeps it."""
    for name in pack.HOMES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    pytest.skip("SGLang is not installed (CI stage '1b' installs it)", allow_module_level=True)


extend = _home(sglang_extend_attention)
prefill = _home(sglang_prefill_attention)
RELEASE = importlib.import_module("sglang").__version__

pytestmark = [pytest.mark.sglang, pytest.mark.usefixtures("records_name_their_launch")]

BATCH, TOKENS, PREFIX, HEADS = 2, 64, 32, 16


@pytest.fixture
def capability(monkeypatch):
    """Set the compute capability SGLang's modules read at import, as on that GPU."""

    def set_capability(major: int, minor: int) -> None:
        for module in (extend, prefill):
            monkeypatch.setattr(module, "_is_cuda", True)
            monkeypatch.setattr(module, "CUDA_CAPABILITY", (major, minor), raising=False)

    return set_capability


def extend_attention(q, k, v, out, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, **options):
    """``extend_attention_fwd`` causal, without a custom mask, as the release installed takes it: the FP8 KV scales
    (1.0) only where it has them (0.5.10 on)."""
    if "k_scale" in inspect.signature(extend.extend_attention_fwd).parameters:
        options = {"k_scale": 1.0, "v_scale": 1.0, **options}
    extend.extend_attention_fwd(q, k, v, out, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, None, True, None,
                                TOKENS, **options)


def absorbed_mla_extend():
    """Kimi K2's absorbed MLA shape (ktransformers #1570): Lq 576, Lv 512, one KV head, a prefix in the cache."""
    dtype, tokens = torch.bfloat16, BATCH * TOKENS
    q = torch.empty(tokens, HEADS, 576, dtype=dtype)
    k, v = torch.empty(tokens, 1, 576, dtype=dtype), torch.empty(tokens, 1, 512, dtype=dtype)
    out = torch.empty(tokens, HEADS, 512, dtype=dtype)
    k_buffer = torch.empty(BATCH * (PREFIX + TOKENS), 1, 576, dtype=dtype)
    v_buffer = torch.empty(BATCH * (PREFIX + TOKENS), 1, 512, dtype=dtype)
    qo_indptr = torch.arange(BATCH + 1, dtype=torch.int32) * TOKENS
    kv_indptr = torch.arange(BATCH + 1, dtype=torch.int32) * PREFIX
    kv_indices = torch.arange(BATCH * PREFIX, dtype=torch.int64)
    extend_attention(q, k, v, out, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices)


def context_attention(dtype, head_size: int, tokens: int = TOKENS):
    q = torch.empty(BATCH * tokens, HEADS, head_size, dtype=dtype)
    prefill.context_attention_fwd(q, q, q, torch.empty_like(q), torch.arange(BATCH, dtype=torch.int32) * tokens,
                                  torch.full((BATCH,), tokens, dtype=torch.int32), tokens)


def test_kimi_k2_extend_attention_on_sm120_with_hopper_tiles_takes_a_smaller_key_tile(
        install_guard, capability, incident_log, tmp_path, triton_cache):
    """Before SGLang PR #14311, sm_120 took Hopper's tiles (its major 12 >= 9): BLOCK_M=32 BLOCK_N=64 need 106496 B
    at one stage. SGLang 0.5.23's own sm_120 table answers 32x32, the tiles the pack finds too."""
    capability(9, 0)
    install_guard(cache_dir=tmp_path / "decisions")
    with fake_gpu("RTX5090", cache_dir=triton_cache) as gpu:
        absorbed_mla_extend()
        absorbed_mla_extend()
        assert [(launch.kernel, launch.grid) for launch in gpu.launches] == [("_fwd_kernel", (BATCH, HEADS, 2))] * 2, \
            "one launch per call, the grid from BLOCK_M=32: the second call chose the tiles at once"
        assert gpu.launches[0].shared <= 101376
    tiles = records(incident_log)
    assert [record["action"] for record in tiles] == ["tiles_reduced"], "one record: the wrapper's outcome"
    assert (tiles[0]["config"], tiles[0]["final"], tiles[0]["required"]) == (
        "BLOCK_M=32 BLOCK_N=64", "BLOCK_M=32 BLOCK_N=32", 106496)
    assert tiles[0]["launched_as"] == f"{extend.__name__}:extend_attention_fwd"
    assert tiles[0]["shape_class"] == {"Lq": 576, "Lv": 512}
    assert extend._get_block_sizes_for_extend_attention(576, 512)[3:5] == (32, 64), \
        "outside the wrapper (the scheduler's tile budget) SGLang's own answer"


def test_kimi_k2_extend_attention_at_the_reporters_arch_and_limit(install_guard, capability, incident_log,
                                                                  triton_cache):
    """ktransformers #1570 as reported: SGLang 0.5.5 on an RTX 5090 (sm_120, 101376 B). Releases before PR #14311
    (0.5.5 to 0.5.8) give sm_120 Hopper's 32x64, which needs 106496 B: recovered at 32x32, one record, the second
    call at once. Later releases' own sm_120 table answers 32x32: it fits, and nothing is changed."""
    capability(12, 0)
    install_guard()
    own = extend._get_block_sizes_for_extend_attention(576, 512)[3:5]
    with fake_gpu("RTX5090", cache_dir=triton_cache) as gpu:
        absorbed_mla_extend()
        absorbed_mla_extend()
        assert [(launch.kernel, launch.grid) for launch in gpu.launches] == [("_fwd_kernel", (BATCH, HEADS, 2))] * 2
        assert all(launch.shared <= 101376 for launch in gpu.launches)
    if own == (32, 32):
        assert records(incident_log) == [], f"SGLang {RELEASE}'s own sm_120 tiles fit"
        return
    [tiles] = records(incident_log)
    assert own == (32, 64), f"SGLang {RELEASE} gives sm_120 Hopper's tiles"
    assert (tiles["action"], tiles["config"], tiles["final"], tiles["required"]) == (
        "tiles_reduced", "BLOCK_M=32 BLOCK_N=64", "BLOCK_M=32 BLOCK_N=32", 106496)
    assert tiles["launched_as"] == f"{extend.__name__}:extend_attention_fwd"


@pytest.mark.parametrize(("gpu", "major_minor", "dtype", "head_size", "required", "block", "smaller"), [
    # SGLang PR #27962 (open): fp32 on sm_120 needs 131072 B at BLOCK 128
    ("RTX5090", (12, 0), torch.float32, 128, 131072, 128, 64),
    ("L4", (8, 9), torch.float32, 256, 147456, 64, 32),
    ("T4", (7, 5), torch.float16, 256, 131072, 64, 32),
])
def test_context_attention_takes_smaller_blocks_with_the_grid_sglang_computes_for_them(
        install_guard, capability, incident_log, triton_cache, gpu, major_minor, dtype, head_size, required, block,
        smaller):
    """The grid: cdiv(the wrapper's blocks x its BLOCK, the smaller BLOCK), every row covered (at most one block
    more than cdiv(max_input_len, smaller), which stores nothing)."""
    capability(*major_minor)
    install_guard()
    lengths = (TOKENS, 100)  # two lengths: one shape class, a grid each
    with fake_gpu(gpu, cache_dir=triton_cache) as device:
        for tokens in lengths:
            context_attention(dtype, head_size, tokens)
        assert [launch.grid for launch in device.launches] == [
            (BATCH, HEADS, -(-(-(-tokens // block) * block) // smaller)) for tokens in lengths]
        assert all(launch.shared <= device.max_shared for launch in device.launches)
    [tiles] = records(incident_log)  # one record: the wrapper's outcome, none of the launch guard's
    assert (tiles["required"], tiles["final"]) == (required, f"BLOCK_M={smaller} BLOCK_N={smaller}")
    assert tiles["shape_class"] == {"dtype": str(dtype), "head_size": head_size}


def mla_extend_inputs(dtype, device="cpu", seed=0):
    """The absorbed MLA shape with values: two sequences, a prefix in the cache (scattered slots) and extend rows."""
    generator = torch.Generator(device).manual_seed(seed)

    def values(*shape):
        return torch.randn(*shape, generator=generator, device=device).to(dtype)

    tokens, slots = BATCH * TOKENS, BATCH * (PREFIX + TOKENS)
    q, k, v = values(tokens, HEADS, 576), values(tokens, 1, 576), values(tokens, 1, 512)
    k_buffer, v_buffer = values(slots, 1, 576), values(slots, 1, 512)
    kv_indices = torch.randperm(slots, generator=generator, device=device)[:BATCH * PREFIX]
    qo_indptr = torch.arange(BATCH + 1, dtype=torch.int32, device=device) * TOKENS
    kv_indptr = torch.arange(BATCH + 1, dtype=torch.int32, device=device) * PREFIX
    return q, k, v, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices


def reference_extend(q, k, v, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices):
    """What extend attention computes, in float64 with torch's SDPA and an explicit mask (prefix all visible, the
    extend part causal)."""
    out = []
    for sequence in range(BATCH):
        rows = slice(int(qo_indptr[sequence]), int(qo_indptr[sequence + 1]))
        prefix = kv_indices[int(kv_indptr[sequence]):int(kv_indptr[sequence + 1])]
        keys = torch.cat([k_buffer[prefix], k[rows]]).double().transpose(0, 1)
        values = torch.cat([v_buffer[prefix], v[rows]]).double().transpose(0, 1)
        visible = torch.ones(TOKENS, PREFIX + TOKENS, dtype=torch.bool, device=q.device)
        visible[:, PREFIX:] = torch.ones(TOKENS, TOKENS, dtype=torch.bool, device=q.device).tril()
        out.append(torch.nn.functional.scaled_dot_product_attention(
            q[rows].double().transpose(0, 1), keys.expand(HEADS, -1, -1), values.expand(HEADS, -1, -1),
            attn_mask=visible, scale=576 ** -0.5).transpose(0, 1))
    return torch.cat(out)


def test_where_not_even_16x16_fits_extend_attention_runs_in_torch(install_guard, capability, incident_log,
                                                                 triton_cache):
    """The absorbed MLA shape in fp16 on a T4 (sm_75, 65536 B): 69632 B even at BLOCK_M=BLOCK_N=16, one stage.
    The pack's torch fallback computes it (run for real here: it is torch), within SGLang's own test tolerance of an
    fp64 reference; a call with an option the fallback does not compute gets the caller's error, with the note."""
    capability(7, 5)
    install_guard()
    inputs = mla_extend_inputs(torch.float16)
    q, k, v, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices = inputs
    out = torch.zeros(BATCH * TOKENS, HEADS, 512, dtype=torch.float16)
    with fake_gpu("T4", cache_dir=triton_cache) as gpu:
        extend_attention(q, k, v, out, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices)
        assert gpu.launches == [], "the kernel never ran: nothing was half-written"
        with pytest.raises(OutOfResources) as caught:  # attention sinks: not computed by the fallback
            extend_attention(q, k, v, torch.empty_like(out), k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                             sinks=torch.zeros(HEADS))
    torch.testing.assert_close(out.double(), reference_extend(*inputs), rtol=1e-2, atol=1e-3)
    [ran] = records(incident_log)  # once per shape class: the second call went to the outcome at once
    assert (ran["action"], ran["final"], ran["launched_as"]) == (
        "fallback", "smemguard.fallbacks:sglang_extend_attention", f"{extend.__name__}:extend_attention_fwd")
    assert ran["attempts"][-1]["required"] == 69632 and "BLOCK_M=16 BLOCK_N=16" in ran["reason"]
    [note] = [note for note in caught.value.__notes__ if note.startswith("smemguard:")]
    assert "extend_attention.py:" in note and "BLOCK_M=16 BLOCK_N=16, the smallest declared, needs 69632 B" in note
    assert note.endswith("its fallback smemguard.fallbacks:sglang_extend_attention does not cover these arguments")


def test_the_context_attention_fallback_matches_sdpa():
    """The prefill fallback, called directly: two sequences of different lengths, causal and not, grouped heads."""
    from smemguard import fallbacks

    torch.manual_seed(0)
    lengths, heads, kv_heads, size = (40, 24), 8, 2, 64
    q = torch.randn(sum(lengths), heads, size)
    k, v = torch.randn(sum(lengths), kv_heads, size), torch.randn(sum(lengths), kv_heads, size)
    starts = torch.tensor([0, lengths[0]], dtype=torch.int32)
    for causal in (True, False):
        out = torch.empty_like(q)
        assert fallbacks.sglang_context_attention(q, k, v, out, starts, torch.tensor(lengths), max(lengths),
                                                  is_causal=causal) is None
        for start, length in zip(starts.tolist(), lengths):
            rows = slice(start, start + length)
            expected = torch.nn.functional.scaled_dot_product_attention(
                q[rows].transpose(0, 1), k[rows].transpose(0, 1).repeat_interleave(4, 0),
                v[rows].transpose(0, 1).repeat_interleave(4, 0), is_causal=causal).transpose(0, 1)
            torch.testing.assert_close(out[rows], expected, rtol=1e-5, atol=1e-5)
    assert fallbacks.sglang_context_attention(q, k, v, out, starts, torch.tensor(lengths), 40,
                                              newer_option=1) is NotImplemented


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: SGLang's own kernel is the reference")
def test_on_a_gpu_the_extend_fallback_matches_sglangs_kernel():
    from smemguard import fallbacks

    for dtype in (torch.float16, torch.bfloat16):
        inputs = mla_extend_inputs(dtype, device="cuda")
        q, k, v, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices = inputs
        kernel, torch_path = (torch.empty(BATCH * TOKENS, HEADS, 512, dtype=dtype, device="cuda") for _ in range(2))
        extend_attention(q, k, v, kernel, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices)
        fallbacks.sglang_extend_attention(q, k, v, torch_path, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                                          None, True, None, TOKENS)
        torch.testing.assert_close(torch_path, kernel, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(torch_path.double(), reference_extend(*inputs), rtol=1e-2, atol=1e-3)


def test_observe_mode_and_uninstall_leave_sglang_as_it_is(install_guard, capability, triton_cache):
    import smemguard

    capability(9, 0)
    own = (extend._get_block_sizes_for_extend_attention, extend.extend_attention_fwd, prefill._fwd_kernel,
           prefill.context_attention_fwd)
    install_guard(mode="observe")
    assert not sglang_extend_attention.PATCH.is_patched() and not sglang_prefill_attention.PATCH.is_patched()
    with fake_gpu("RTX5090", cache_dir=triton_cache):
        with pytest.raises(OutOfResources):
            absorbed_mla_extend()
    smemguard.uninstall()
    install_guard()
    assert sglang_extend_attention.PATCH.is_patched() and sglang_prefill_attention.PATCH.is_patched()
    smemguard.uninstall()
    assert (extend._get_block_sizes_for_extend_attention, extend.extend_attention_fwd, prefill._fwd_kernel,
            prefill.context_attention_fwd) == own
