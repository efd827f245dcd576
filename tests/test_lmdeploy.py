"""LMDeploy's own Triton prefill attention (``lmdeploy.pytorch.kernels.cuda.flashattention``) on the CPU harness at
the arches LMDeploy's wrapper picks its tiles for, and on a GPU the alternatives its pack registers.

``flash_attn_varlen_func`` chooses BLOCK_M, BLOCK_N, warps and stages from the compute capability
(``_kernel_meta_sm86`` for sm_86/sm_89, ``_kernel_meta_sm8x``, ``_kernel_meta_sm12x`` for sm_100 and sm_120 alike)
and sizes them by ``BLOCK_DK``, the largest power of two under the head size: a head size that is not a power of two
(DeepSeek-V3's MLA prefill, 192 = 128 + 64 in two dot products) gets the tiles of 128 and needs more than every one
of these GPUs has, the A100 included. Stages alone recover those launches, bitwise the same. Where no stage count
fits the tiles the wrapper chose (the absorbed MLA's 576 and shared keys at 256 on sm_120), the pack's smaller
alternatives run (``patches/contrib/lmdeploy_flash_attention``, whose docstring says why any of them computes the same
attention; the GPU test below checks every one against LMDeploy's own tiles and a float64 reference). On a T4 not
even 16x16 fits the absorbed MLA: the user gets Triton's error and a record that says so.

Needs LMDeploy 0.12 or later, whose wrapper is ``flash_attn_varlen_func`` (``pip install --no-deps
lmdeploy==0.18.0`` and what its kernels' imports need: CI stage "4", Triton 3.6, which runs them again with LMDeploy
0.16 first on ``PYTHONPATH``; LMDeploy asks for Triton 3.4 to 3.7, and Triton 3.9 no longer compiles its block
pointers). LMDeploy 0.17 and later read the capability through ``get_device_props``, earlier releases once into
``_nv_cap`` (and ask the device whether it has TMA at import: answered as an L4 here); the tests answer either as that
GPU's process would. Launches on the harness execute nothing: the numbers are the GPU's to compare
(benchmarks/field_suites.md)."""

import importlib

import pytest
import torch
from triton.runtime.errors import OutOfResources

from smemguard.testing import fake_gpu

from conftest import records

HOME = "lmdeploy.pytorch.kernels.cuda.flashattention"


def _import_lmdeploy():
    """LMDeploy's kernel module; releases before 0.17 ask the device at import whether it has TMA (no: an L4)."""
    pytest.importorskip("lmdeploy", reason="LMDeploy is not installed (CI stage '4' installs it with Triton 3.6)")
    try:
        return importlib.import_module(HOME)
    except (RuntimeError, AssertionError):
        capability = torch.cuda.get_device_capability
        torch.cuda.get_device_capability = lambda device=None: (8, 9)
        try:
            with fake_gpu("L4"):
                return importlib.import_module(HOME)
        finally:
            torch.cuda.get_device_capability = capability


attention = _import_lmdeploy()

pytestmark = [pytest.mark.lmdeploy, pytest.mark.usefixtures("records_name_their_launch")]

TOKENS, HEADS = 256, 8
CAPABILITY = {"RTX5090": (12, 0), "L4": (8, 9), "A100": (8, 0), "T4": (7, 5)}
KERNEL = "lmdeploy.pytorch.kernels.cuda.flashattention:_flash_prefill_fwd_kernel"


@pytest.fixture
def on_gpu(monkeypatch, triton_cache):
    """The harness for ``gpu``, with LMDeploy reading that GPU's capability."""

    def on(gpu: str):
        props = {"compute_capability": CAPABILITY[gpu], "multi_processor_count": 80}
        if hasattr(attention, "get_device_props"):
            monkeypatch.setattr(attention, "get_device_props", lambda device=None: props)
        else:
            monkeypatch.setattr(attention, "_nv_cap", CAPABILITY[gpu])
        return fake_gpu(gpu, cache_dir=triton_cache)

    return on


def prefill(head_dim: int, head_dim_v: int, shared: bool = False):
    """One causal prefill of one sequence, the keys and values of one KV head in LMDeploy's default layout
    (``shared``: the values are the keys' first ``head_dim_v`` columns, as MLA shares them)."""
    q = torch.empty(TOKENS, HEADS, head_dim, dtype=torch.float16)
    k = torch.empty(1, TOKENS, head_dim, dtype=torch.float16)
    v = k[..., :head_dim_v] if shared else torch.empty(1, TOKENS, head_dim_v, dtype=torch.float16)
    starts = torch.tensor([0, TOKENS], dtype=torch.int32)
    return attention.flash_attn_varlen_func(q, k, v, starts, starts, TOKENS, TOKENS, causal=True)


@pytest.mark.parametrize("gpu, head_dims, stages, fewer", [
    ("RTX5090", (192, 128), 3, 2),  # DeepSeek-V3's MLA prefill: 131072 B at 3 stages
    ("L4", (192, 128), 3, 2),
    ("A100", (192, 128), 3, 2),  # 212992 B over 166912
    ("L4", (576, 512), 2, 1),  # the absorbed MLA: 108544 B at 2 stages
])
def test_lmdeploys_prefill_that_does_not_fit_runs_at_fewer_stages(install_guard, on_gpu, incident_log, gpu,
                                                                   head_dims, stages, fewer):
    with on_gpu(gpu) as plain, pytest.raises(OutOfResources):
        prefill(*head_dims)
    assert not plain.launches, "the failure is LMDeploy's own, without smemguard"
    install_guard(core=True)
    with on_gpu(gpu) as gpu_:
        prefill(*head_dims)
        prefill(*head_dims)
    assert [launch.num_stages for launch in gpu_.launches] == [fewer, fewer]
    assert all(launch.shared <= gpu_.max_shared for launch in gpu_.launches)
    [record] = records(incident_log)
    assert (record["kernel"], record["action"], record["phase"]) == (KERNEL, "stages_reduced", "compile")
    assert (record["num_stages"], record["final"]) == (stages, f"num_stages={fewer}")


@pytest.mark.parametrize("gpu, head_dims, shared, tiles, shared_bytes", [
    # sm_120 takes LMDeploy's sm_100 table: the absorbed MLA at 32x64 needs 180224 B at 2 stages, 106496 at 1
    ("RTX5090", (576, 512), False, (32, 16), 72704),
    # head size 256 with the keys shared as values: 64x128, 102400 B at any stage count
    ("RTX5090", (256, 256), True, (64, 64), 69632),
])
def test_tiles_lmdeploys_wrapper_chose_that_fit_at_no_stage_count_run_smaller(install_guard, on_gpu, incident_log,
                                                                              gpu, head_dims, shared, tiles,
                                                                              shared_bytes):
    """The pack's alternatives (``patches/contrib/lmdeploy_flash_attention``): the wrapper's grid is a function of
    ``BLOCK_M``, so the largest alternative that fits runs with the grid recomputed for it; one record, and the next
    call of the same shape runs it again without another."""
    with on_gpu(gpu) as plain, pytest.raises(OutOfResources):
        prefill(*head_dims, shared=shared)
    assert not plain.launches, "the failure is LMDeploy's own, without smemguard"
    install_guard(core=True)
    with on_gpu(gpu) as gpu_:
        prefill(*head_dims, shared=shared)
        prefill(*head_dims, shared=shared)
    block_m, block_n = tiles
    ran = [(launch.shared, launch.grid) for launch in gpu_.launches]
    assert ran == [(shared_bytes, (TOKENS // block_m, HEADS, 1))] * 2, "the grid recomputed for the smaller BLOCK_M"
    [record] = records(incident_log)
    final = dict(part.split("=") for part in record["final"].split())
    assert (record["kernel"], record["action"]) == (KERNEL, "config_changed")
    assert (final["BLOCK_M"], final["BLOCK_N"]) == (str(block_m), str(block_n))


def test_the_absorbed_mla_on_a_t4_fits_no_alternative_and_gets_lmdeploys_own_error(install_guard, on_gpu,
                                                                                   incident_log):
    """A T4 pipelines nothing, and 16x16 still needs 69632 B: the user gets Triton's error, the record says so."""
    install_guard()
    with on_gpu("T4") as gpu_, pytest.raises(OutOfResources):
        prefill(576, 512)
    assert not gpu_.launches
    [record] = records(incident_log)
    assert (record["kernel"], record["action"]) == (KERNEL, "reraised")
    assert "none of the registered alternatives fits" in record["reason"]
    assert min(attempt["required"] or attempt["shared"] for attempt in record["attempts"]) == 69632


# -- On a GPU: the alternatives compute LMDeploy's attention -----------------------------------------------------

NUMERICS_CASES = {  # name: (head_dims, q_seqlens, kv_seqlens, options)
    "causal, history": ((128, 128), [30, 50, 70, 90], [80, 90, 100, 110], {"causal": True}),
    "non-causal, GQA": ((128, 128), [33, 64, 7, 129], [33, 64, 7, 129], {"causal": False}),
    "sliding window": ((64, 64), [100, 37], [140, 37], {"causal": True, "window_size": 32}),
    "split head 192/128": ((192, 128), [64, 17, 96], [64, 40, 96], {"causal": True}),
    "shared keys 256": ((256, 256), [48, 80], [48, 80], {"causal": True, "shared": True}),
    "absorbed MLA 576/512": ((576, 512), [40, 24], [72, 24], {"causal": True}),
}


def _varlen(head_dims, q_seqlens, kv_seqlens, shared=False, dtype=None, kv_heads=2, heads=8):
    device, dtype = "cuda", dtype or torch.float16
    generator = torch.Generator(device=device).manual_seed(0)
    dk, dv = head_dims
    q = torch.randn(sum(q_seqlens), heads, dk, device=device, dtype=dtype, generator=generator)
    k = torch.randn(kv_heads, sum(kv_seqlens), dk, device=device, dtype=dtype, generator=generator)
    v = k[..., :dv] if shared else torch.randn(kv_heads, sum(kv_seqlens), dv, device=device, dtype=dtype,
                                                generator=generator)

    def starts(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)

    return q, k, v, starts(q_seqlens), starts(kv_seqlens)


def _reference(q, k, v, cu_q, cu_k, causal, window_size=-1):
    """Attention per sequence in float64, keys after the history (the queries are the sequence's last tokens)."""
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=torch.float64, device=q.device)
    group = q.shape[1] // k.shape[0]
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = (int(x) for x in (cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]))
        qi = q[qs:qe].double().transpose(0, 1)  # heads, rows, d
        ki = k[:, ks:ke].double().repeat_interleave(group, 0)
        vi = v[:, ks:ke].double().repeat_interleave(group, 0)
        scores = qi @ ki.transpose(1, 2) / q.shape[-1] ** 0.5
        rows = torch.arange(ke - ks - (qe - qs), ke - ks, device=q.device)[:, None]
        keys = torch.arange(ke - ks, device=q.device)[None, :]
        visible = keys <= rows if causal else torch.ones_like(keys <= rows)
        if window_size > 0:
            visible &= keys > rows - window_size - 1
        scores = scores.masked_fill(~visible, float("-inf"))
        out[qs:qe] = (scores.softmax(-1) @ vi).transpose(0, 1)
    return out


class _ForcedTiles:
    """``_flash_prefill_fwd_kernel`` as the wrapper launches it, with ``BLOCK_M``, ``BLOCK_N`` and the options of
    ``config`` in place of the wrapper's (its grid function sees them)."""

    def __init__(self, kernel, config):
        self.kernel, self.config = kernel, config

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel[grid](*args, **{**kwargs, **self.config.all_kwargs()})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: LMDeploy's kernel runs there (Triton's interpreter cannot run it)")
@pytest.mark.parametrize("case", sorted(NUMERICS_CASES))
def test_on_a_gpu_every_alternative_computes_lmdeploys_attention(case, monkeypatch):
    from smemguard.patches.contrib import lmdeploy_flash_attention

    head_dims, q_seqlens, kv_seqlens, options = NUMERICS_CASES[case]
    options = dict(options)
    q, k, v, cu_q, cu_k = _varlen(head_dims, q_seqlens, kv_seqlens, shared=options.pop("shared", False))

    def run():
        return attention.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(q_seqlens), max(kv_seqlens), **options)

    reference = _reference(q, k, v, cu_q, cu_k, options["causal"], options.get("window_size", -1))
    try:
        own = run().double()  # LMDeploy's own tiles, as the baseline
    except Exception as error:  # its tiles for this GPU may not fit it either (the MLA's 64x64 on sm_90)
        assert "out of resource" in str(error), error
        own = None
    if own is not None:
        torch.testing.assert_close(own, reference, rtol=1e-2, atol=2e-3)
    kernel = attention._flash_prefill_fwd_kernel
    worst = {}
    for config in lmdeploy_flash_attention.PATCH.alternatives():
        for stages in (config.num_stages, 1):  # one stage fewer only where they do not fit: bitwise the same
            config.num_stages = stages
            monkeypatch.setattr(attention, "_flash_prefill_fwd_kernel", _ForcedTiles(kernel, config))
            try:
                out = run().double()
            except Exception as error:  # only a tile this GPU cannot hold may fail, never a wrong answer
                assert "out of resource" in str(error), error
                continue
            finally:
                monkeypatch.setattr(attention, "_flash_prefill_fwd_kernel", kernel)
            torch.testing.assert_close(out, reference, rtol=1e-2, atol=2e-3)
            worst[str(config.kwargs), stages] = (out - (reference if own is None else own)).abs().max().item()
            break
    assert worst, "at least one alternative ran"
    assert max(worst.values()) <= 4e-3, worst  # the order of the softmax's additions, not another answer
