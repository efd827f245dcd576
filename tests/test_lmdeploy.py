"""LMDeploy's own Triton prefill attention (``lmdeploy.pytorch.kernels.cuda.flashattention``), a library smemguard has
no pack for, on the CPU harness at the arches LMDeploy's wrapper picks its tiles for.

``flash_attn_varlen_func`` chooses BLOCK_M, BLOCK_N, warps and stages from the compute capability
(``_kernel_meta_sm86`` for sm_86/sm_89, ``_kernel_meta_sm8x``, ``_kernel_meta_sm12x`` for sm_100 and sm_120 alike)
and sizes them by ``BLOCK_DK``, the largest power of two under the head size: a head size that is not a power of two
(DeepSeek-V3's MLA prefill, 192 = 128 + 64 in two dot products) gets the tiles of 128 and needs more than every one
of these GPUs has, the A100 included. Stages alone recover those launches, bitwise the same; what is left is the
class of tiles a wrapper chose (the absorbed MLA's 576 on sm_120 and on a T4), which smemguard leaves to the caller
with its own exception and a record that names the wrapper.

Needs LMDeploy 0.18 (``pip install --no-deps lmdeploy==0.18.0`` and what its kernels' imports need: CI stage "4",
Triton 3.6; LMDeploy 0.18 asks for Triton 3.4 to 3.7, and Triton 3.9 no longer compiles its block pointers).
LMDeploy reads the capability through ``get_device_props``; the tests answer it as that GPU's process would. Launches
on the harness execute nothing: the numbers are the GPU's to compare (benchmarks/field_suites.md)."""

import pytest
import torch
from triton.runtime.errors import OutOfResources

from smemguard.testing import fake_gpu

from conftest import records

attention = pytest.importorskip("lmdeploy.pytorch.kernels.cuda.flashattention",
                                reason="LMDeploy is not installed (CI stage '4' installs it with Triton 3.6)")

pytestmark = pytest.mark.lmdeploy

TOKENS, HEADS = 256, 8
CAPABILITY = {"RTX5090": (12, 0), "L4": (8, 9), "A100": (8, 0), "T4": (7, 5)}
KERNEL = "lmdeploy.pytorch.kernels.cuda.flashattention:_flash_prefill_fwd_kernel"


@pytest.fixture
def on_gpu(monkeypatch, triton_cache):
    """The harness for ``gpu``, with LMDeploy reading that GPU's capability."""

    def on(gpu: str):
        props = {"compute_capability": CAPABILITY[gpu], "multi_processor_count": 80}
        monkeypatch.setattr(attention, "get_device_props", lambda device=None: props)
        return fake_gpu(gpu, cache_dir=triton_cache)

    return on


def prefill(head_dim: int, head_dim_v: int):
    """One causal prefill of one sequence, the keys and values of one KV head in LMDeploy's default layout."""
    q = torch.empty(TOKENS, HEADS, head_dim, dtype=torch.float16)
    k = torch.empty(1, TOKENS, head_dim, dtype=torch.float16)
    v = torch.empty(1, TOKENS, head_dim_v, dtype=torch.float16)
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


@pytest.mark.parametrize("gpu", ["RTX5090", "T4"])
def test_lmdeploys_absorbed_mla_tiles_are_left_to_lmdeploy_with_its_own_error(install_guard, on_gpu, incident_log,
                                                                             gpu):
    """sm_120 gets the tiles LMDeploy wrote for sm_100 (32x64: 180224 B at 2 stages, 106496 at 1); a T4 pipelines
    nothing. The tiles are the wrapper's: the user gets Triton's error, and the record says who chose them."""
    install_guard()
    with on_gpu(gpu) as gpu_, pytest.raises(OutOfResources):
        prefill(576, 512)
    assert not gpu_.launches
    [record] = records(incident_log)
    assert (record["kernel"], record["action"]) == (KERNEL, "reraised")
    assert "flashattention.py" in record["reason"] and "(flash_attn_varlen_func)" in record["reason"]
    assert "BLOCK_M=" in record["reason"] and "never changed" in record["reason"]
