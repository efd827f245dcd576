"""Emulation a library believes (issue 47, deliverable 2): under ``SMEMGUARD_MAX_SHARED=<GPU>`` torch's device
properties, and vLLM's own query of the limit, report the emulated GPU, so that libraries sizing themselves from them
choose what they would choose there. On the CPU harness, which makes torch report a stand-in H100
(``fake_gpu(..., torch_device=True)``); SGLang's and vLLM's own choices with their packages installed."""

import importlib
import importlib.util
import logging
import types
from pathlib import Path

import pytest
import torch

import smemguard
from smemguard.facts import gpus, process, settings
from smemguard.patches.torch_seams import torch_device_properties
from smemguard.patches.contrib import vllm_shared_memory
from smemguard.testing import fake_gpu, load_check_failures

from conftest import records


def emulating(name: str) -> dict:
    """The settings ``SMEMGUARD_MAX_SHARED=<name>`` gives."""
    loaded = settings.load({settings.MAX_SHARED: name})
    return {"max_shared": loaded.max_shared, "max_shared_label": loaded.max_shared_label}


def test_torch_reports_the_emulated_gpu_and_smemguard_the_device(install_guard):
    with fake_gpu("H100", torch_device=True):
        device = torch.cuda.get_device_properties(0)
        install_guard(**emulating("L4"))
        seen = torch.cuda.get_device_properties(0)
        assert (seen.shared_memory_per_block_optin, seen.shared_memory_per_multiprocessor) == (101376, 102400)
        assert seen.name == torch.cuda.get_device_name() == "NVIDIA L4"
        assert isinstance(seen, type(device)) and seen.multi_processor_count == device.multi_processor_count
        assert "name='NVIDIA L4'" in repr(seen) and "shared_memory_per_block_optin=101376" in str(seen)
        # Code built for sm_89 does not run on sm_90: libraries pick prebuilt kernels by it, so it stays.
        assert torch.cuda.get_device_capability() == (9, 0)
        assert process.gpu_name(0) == "NVIDIA H100" and process.own_device_properties(0) is device, \
            "smemguard's records name the device it runs on"
        smemguard.uninstall()
        assert torch.cuda.get_device_properties(0) is device and torch.cuda.get_device_name() == "NVIDIA H100"
    assert not torch_device_properties.PATCH.is_patched()


def test_the_capability_follows_where_code_built_for_it_runs_on_the_device(install_guard):
    with fake_gpu("L40S", torch_device=True):  # sm_89: an A10's sm_86 kernels run on it
        install_guard(**emulating("A10"))
        assert torch.cuda.get_device_capability() == (8, 6) and torch.cuda.get_device_name() == "NVIDIA A10"


def test_a_byte_count_lowers_the_per_block_limit_only(install_guard):
    with fake_gpu("H100", torch_device=True):
        install_guard(max_shared=65536, max_shared_label="65536")
        seen = torch.cuda.get_device_properties(0)
        assert seen.shared_memory_per_block_optin == 65536
        assert (seen.name, seen.shared_memory_per_multiprocessor, seen.major) == ("NVIDIA H100", 233472, 9)


def test_setting_emulate_properties_off_leaves_torch_as_the_device_reports(install_guard):
    loaded = settings.load({settings.MAX_SHARED: "L4", settings.EMULATE_PROPERTIES: "0"})
    assert loaded.problems == () and not loaded.emulate_properties and loaded.emulated_gpu is gpus.lookup("L4")
    assert settings.load({settings.EMULATE_PROPERTIES: "sometimes"}).problem_of(settings.EMULATE_PROPERTIES) == (
        "SMEMGUARD_EMULATE_PROPERTIES='sometimes' ignored: neither on nor off; accepted: 1 | on | true | yes | 0 | "
        "off | false | no. Using the default.")
    with fake_gpu("H100", torch_device=True):
        install_guard(**emulating("L4"), emulate_properties=False)
        assert torch.cuda.get_device_properties(0).shared_memory_per_block_optin == 232448
        assert not torch_device_properties.PATCH.is_patched()


def test_properties_smemguard_cannot_read_are_returned_as_torch_gave_them(install_guard, monkeypatch, caplog):
    odd = object()
    with fake_gpu("H100", torch_device=True):
        monkeypatch.setattr(torch.cuda, "_get_device_properties", lambda index: odd)
        install_guard(**emulating("L4"))
        with caplog.at_level(logging.WARNING):
            assert torch.cuda.get_device_properties(0) is odd
    assert "could not emulate torch's device properties; they stay the device's" in caplog.text


# -- SGLang 0.5.23: the fused-MoE FP8 default below 128 KiB -------------------------------------------------------


def sglang_moe_config(monkeypatch):
    """SGLang's own ``fused_moe_triton_config`` module, loaded from its file: its package's ``__init__`` imports the
    model configs, which need transformers and torchvision (no CPU build of the latter). Its ``get_exec()`` (SGLang's
    published server configuration, none in a test) answers as SGLang's defaults do: no deterministic inference."""
    sglang = pytest.importorskip("sglang", reason="SGLang is not installed (CI stage '1b' installs it)")
    path = Path(sglang.__file__).parent / "srt/layers/moe/moe_runner/triton_utils/fused_moe_triton_config.py"
    spec = importlib.util.spec_from_file_location("sglang_fused_moe_triton_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    defaults = types.SimpleNamespace(deterministic=types.SimpleNamespace(enable_deterministic_inference=False))
    monkeypatch.setattr(module, "get_exec", lambda: defaults)
    return module


#: SGLang 0.5.23's FP8 (per-tensor) defaults for more tokens than experts: the H100's, and the one below 128 KiB.
SGLANG_BIG = {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 32, "num_warps": 8,
              "num_stages": 4}
SGLANG_SMALL = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 256, "GROUP_SIZE_M": 64, "num_warps": 4,
                "num_stages": 2}


@pytest.mark.sglang
@pytest.mark.parametrize("emulated", ["L40S", "L4"])
def test_sglangs_fused_moe_fp8_default_is_its_small_gpu_one_under_an_emulated_gpu(emulated, install_guard,
                                                                                   monkeypatch):
    shape = dict(M=4096, E=8, N=14336, K=4096, topk=2, dtype="fp8_w8a8", is_marlin=False)
    with fake_gpu("H100", torch_device=True):
        assert sglang_moe_config(monkeypatch).get_default_config(**shape) == SGLANG_BIG
        install_guard(**emulating(emulated))
        assert sglang_moe_config(monkeypatch).get_default_config(**shape) == SGLANG_SMALL


# -- vLLM 0.34: the Triton prefill attention fits its tile to the device's shared memory -----------------------------


@pytest.fixture
def vllm_on_an_h100(monkeypatch):
    """vLLM's platform (none on this machine) reporting the CUDA H100 the stand-in is, as the prefill asks it."""
    pytest.importorskip("vllm", reason="vLLM is not installed (CI stage 3 installs it)")
    prefill = importlib.import_module("vllm.v1.attention.ops.triton_prefill_attention")
    if not hasattr(prefill, "_fit_block_to_shared_memory"):
        pytest.skip("this vLLM's prefill attention does not fit its tile to the device (vLLM 0.34 does)")
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    platform = type(current_platform)
    monkeypatch.setattr(platform, "get_device_capability",
                        classmethod(lambda cls, device_id=0: DeviceCapability(9, 0)))
    monkeypatch.setattr(platform, "is_cuda_alike", lambda self: True)
    monkeypatch.setattr(platform, "is_cuda", lambda self: True)
    # vLLM caches the tile per shape class for the process; a process emulating a GPU computes it under the emulation.
    prefill._fit_block_to_shared_memory.cache_clear()
    yield prefill
    prefill._fit_block_to_shared_memory.cache_clear()


def encode(prefill, head_size, seqs=2, seq_len=256, heads=4):
    """vLLM's context_attention_fwd as the Triton backend calls it for an encoder (bidirectional), in bf16."""
    q = torch.randn(seqs * seq_len, heads, head_size, dtype=torch.bfloat16)
    prefill.context_attention_fwd(q, torch.randn_like(q), torch.randn_like(q), torch.empty_like(q),
                                  torch.arange(0, seqs * seq_len, seq_len, dtype=torch.int32),
                                  torch.full((seqs,), seq_len, dtype=torch.int32), seq_len, is_causal=False)


@pytest.mark.vllm
def test_vllms_prefill_fits_its_tile_to_the_emulated_l4_itself(vllm_on_an_h100, install_guard, incident_log,
                                                                triton_cache):
    """Head size 256 in bf16: 128-row tiles need 163840 B, which an H100 has and an L4 (101376 B) has not; vLLM
    halves its tile to 64 (73728 B) when the device says it has less."""
    with fake_gpu("H100", cache_dir=triton_cache, torch_device=True) as h100:
        encode(vllm_on_an_h100, 256)
    assert h100.launches[-1].grid[2] == 256 // 128, "on the H100 vLLM keeps its 128-row tile"
    vllm_on_an_h100._fit_block_to_shared_memory.cache_clear()
    install_guard(**emulating("L4"))
    assert vllm_shared_memory.PATCH.is_patched()
    with fake_gpu("H100", cache_dir=triton_cache, torch_device=True) as device, load_check_failures() as overflows:
        encode(vllm_on_an_h100, 256)
    assert device.launches[-1].grid[2] == 256 // 64 and device.launches[-1].shared <= 101376
    assert overflows == [] and records(incident_log) == [], "vLLM chose the L4's tile: nothing overflowed"
    smemguard.uninstall()
    assert not vllm_shared_memory.PATCH.is_patched()
    assert vllm_on_an_h100.get_max_shared_memory_bytes is importlib.import_module(
        "vllm.utils.mem_utils").get_max_shared_memory_bytes, "vLLM's own function again where it was imported"
