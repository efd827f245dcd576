"""GemLite's real GEMM on the CPU harness: a pipeline depth passed as a parameter, under a pruner that pins one config.

GemLite (0.6.0.post2: a quantized-GEMM library, also a vLLM plugin) writes its loop's depth itself,
``for k in tl.range(num_pid_k, num_stages=NUM_STAGES, ...)``, and its autotuner's ``early_config_prune``
(a lambda over ``kernel_config_pruner``) yields the single config its per-GPU file names for the shape
(``gemlite/configs/h100.json``, tuned on an H100), with ``NUM_STAGES`` equal to ``num_stages``.

Needs gemlite (``pip install --no-deps gemlite==0.6.0.post2 numpy tqdm``; CI stage 1b). GemLite asks
torch for the CUDA device while it is imported (capability, name, SM count); during the import only,
torch's device layer answers as an H100's would. Everything else is GemLite's and Triton's own:
``GemLiteLinearTriton``'s packing and ``forward_manual``, its activation-quantization kernel, the
pruner reading the config file, the autotuner over ``triton.heuristics``, the compile, and
``OutOfResources`` from ``_init_handles``.
"""

import importlib.util
import json
import types
from pathlib import Path

import pytest
import torch
from triton.runtime.errors import OutOfResources

from smemguard.testing import fake_gpu

from conftest import records

pytestmark = pytest.mark.gemlite

H100 = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", multi_processor_count=132, major=9, minor=0)
PRUNER = "the tuner's pruner gemlite.triton_kernels.gemm_kernels:<lambda> line 277 pins"
# h100.json's GEMM entry for an int8 x int8 layer (type_id 408) of 3584x3584 at M=1536.
TILES = "BLOCK_SIZE_M=128 BLOCK_SIZE_N=128 BLOCK_SIZE_K=128 GROUP_SIZE_M=8"


@pytest.fixture(scope="module")
def gemlite(triton_cache):
    if importlib.util.find_spec("gemlite") is None:
        pytest.skip("gemlite is not installed (CI stage 1b installs it)")
    with pytest.MonkeyPatch.context() as device, fake_gpu(90, max_shared=232448, cache_dir=triton_cache):
        device.setattr(torch.cuda, "get_device_capability", lambda *args, **kwargs: (H100.major, H100.minor))
        device.setattr(torch.cuda, "get_device_properties", lambda *args, **kwargs: H100)
        import gemlite

    yield gemlite
    gemlite.reset_config()


def int8_layer(gemlite, n=3584, k=3584):
    """An int8 x int8 layer with per-token activation scaling (GemLite's A8W8 dynamic), as packed on a GPU."""
    from gemlite.core import DType, GemLiteLinearTriton

    layer = GemLiteLinearTriton(W_nbits=8, group_size=k, in_features=k, out_features=n, input_dtype=DType.INT8,
                                output_dtype=DType.FP16, scaled_activations=True)
    layer.pack(torch.randint(-127, 127, (n, k), dtype=torch.int8), scales=torch.ones(n, 1, dtype=torch.float16),
               zeros=None, bias=None)
    return layer


@pytest.fixture
def tuned_on_an_h100(gemlite):
    gemlite.reset_config()
    assert gemlite.load_config(str(Path(gemlite.__file__).parent / "configs" / "h100.json"))
    yield
    gemlite.reset_config()


# L4: sm_89 and its own limit. T4's limit on sm_90: the field run's (an H200 emulating a T4).
@pytest.mark.parametrize("gpu, limit, first_required, stages, shared", [
    ("L4", None, 131072, 4, 98304),
    (90, 65536, 163840, 2, 65536)])
def test_gemlite_gemm_pinned_by_its_h100_file_is_recovered_with_its_own_tiles(
        gemlite, tuned_on_an_h100, install_guard, incident_log, triton_cache, gpu, limit, first_required, stages,
        shared):
    layer = int8_layer(gemlite)
    x = torch.randn(1536, 3584, dtype=torch.float16)
    install_guard()
    with fake_gpu(gpu, max_shared=limit, cache_dir=triton_cache) as device:
        assert layer.forward_manual(x, "GEMM").shape == (1536, 3584)
        layer.forward_manual(x, "GEMM")  # decided once: the second call pays no incident
    (record,) = records(incident_log)
    assert record["kernel"] == "gemlite.triton_kernels.gemm_kernels:gemm_INT_kernel"
    assert record["action"] == "stages_reduced" and record["required"] == first_required
    assert f"{TILES} NUM_STAGES=5 A_load_order=2" in record["config"]
    assert record["config"].endswith("num_warps=8 num_stages=5")
    assert record["attempts"][-1]["changes"] == f"NUM_STAGES={stages} num_stages={stages}"
    assert f"{TILES} NUM_STAGES={stages} A_load_order=2" in record["final"], "the same tiles"
    assert record["final"].endswith(f"num_warps=8 num_stages={stages}")
    assert any(note.startswith("the other ") and f"{PRUNER} {TILES} A_load_order=2 NUM_STAGES=5" in note
               for note in record["skipped"])
    gemms = [launch for launch in device.launches if launch.kernel == "gemm_INT_kernel"]
    assert len(gemms) == 2 and {(launch.num_stages, launch.shared) for launch in gemms} == {(stages, shared)}


def test_gemlite_gemm_on_a_t4_gets_its_own_error_back_when_stages_cannot_help(
        gemlite, install_guard, incident_log, triton_cache, tmp_path):
    """sm_75: Triton pipelines nothing before sm_80, so NUM_STAGES changes no byte. A 4-bit layer's
    config filed by GemLite's ``cache_config`` on a bigger GPU (256x128x128) needs 131072 B at any depth."""
    from gemlite.core import DType, GemLiteLinearTriton

    m, n, k, group = 256, 4096, 4096, 128
    tuned = dict(BLOCK_SIZE_M=256, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, GROUP_SIZE_M=8, A_load_order=0, num_warps=8,
                 num_ctas=1, num_stages=4)
    (tmp_path / "tuned.json").write_text(json.dumps({"GEMM": {str((m, n, k, group, 8, 104)): tuned}}))
    gemlite.reset_config()
    assert gemlite.load_config(str(tmp_path / "tuned.json"))
    layer = GemLiteLinearTriton(W_nbits=4, group_size=group, in_features=k, out_features=n, input_dtype=DType.FP16,
                                output_dtype=DType.FP16)
    groups = n * k // group
    layer.pack(torch.randint(0, 15, (n, k), dtype=torch.uint8), scales=torch.ones(groups, 1, dtype=torch.float16),
               zeros=torch.full((groups, 1), 7, dtype=torch.float16), bias=None)
    install_guard()
    with fake_gpu("T4", cache_dir=triton_cache), pytest.raises(OutOfResources):
        layer.forward_manual(torch.randn(m, k, dtype=torch.float16), "GEMM")
    (record,) = records(incident_log)
    assert record["action"] == "reraised" and record["required"] == 131072
    assert len(record["attempts"]) == 1, "no futile compile"
    assert record["reason"].startswith("Triton pipelines nothing before sm_80, stages change no byte; " + PRUNER)
