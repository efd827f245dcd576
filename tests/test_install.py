"""install()/uninstall() and the patch modules: idempotent, exact restore, never raising into the host."""

import logging

import pytest
import wrapt

import smemguard
from smemguard.patches import autotuner_bench, kernel_interface, max_shared_mem
from smemguard.settings import Settings, SettingsError

from conftest import run_python


def originals():
    from triton.compiler import compiler
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface

    return (KernelInterface.__dict__["__getitem__"], compiler.max_shared_mem, Autotuner.__dict__["_bench"])


def test_install_uninstall_restores_exactly_the_originals():
    before = originals()
    assert smemguard.install(Settings(max_shared=101376))
    assert smemguard.is_installed()
    assert kernel_interface.is_patched() and max_shared_mem.is_patched() and autotuner_bench.is_patched()
    assert all(a is not b for a, b in zip(before, originals()))
    smemguard.uninstall()
    assert not smemguard.is_installed()
    assert all(a is b for a, b in zip(before, originals()))
    smemguard.uninstall()  # twice is fine
    assert all(a is b for a, b in zip(before, originals()))


def test_no_emulation_leaves_max_shared_mem_alone():
    before = originals()
    assert smemguard.install(Settings())
    assert originals()[1] is before[1]
    smemguard.uninstall()


@pytest.mark.parametrize("steps", [
    "install install uninstall",
    "uninstall install uninstall install",
    "install uninstall install install",
    "install uninstall uninstall install uninstall",
])
def test_patch_unpatch_repatch_permutations_in_a_fresh_process(steps):
    result = run_python(f"""
        import triton, wrapt
        from triton.compiler import compiler
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import KernelInterface
        import smemguard
        from smemguard.settings import Settings

        original = (KernelInterface.__dict__["__getitem__"], compiler.max_shared_mem, Autotuner.__dict__["_bench"])
        for step in {steps.split()!r}:
            if step == "install":
                smemguard.install(Settings(max_shared=65536))
            else:
                smemguard.uninstall()
        installed = smemguard.is_installed()

        def depth(obj):
            n = 0
            while getattr(obj, "_self_wrapper", None) is not None:
                n, obj = n + 1, obj.__wrapped__
            return n

        print("installed", installed)
        print("layers", depth(compiler.max_shared_mem), depth(Autotuner.__dict__["_bench"]))
        print("restored", KernelInterface.__dict__["__getitem__"] is original[0],
              compiler.max_shared_mem is original[1], Autotuner.__dict__["_bench"] is original[2])
    """)
    installed = steps.split()[-1] == "install"
    lines = result.stdout.splitlines()
    assert lines[0] == f"installed {installed}"
    assert lines[1] == ("layers 1 1" if installed else "layers 0 0")  # never double-wrapped
    assert lines[2] == ("restored False False False" if installed else "restored True True True")


def test_uninstall_removes_only_our_layer_under_another_tools():
    from triton.compiler import compiler

    original = compiler.max_shared_mem
    assert smemguard.install(Settings(max_shared=65536))
    theirs = wrapt.FunctionWrapper(compiler.max_shared_mem, lambda wrapped, instance, args, kwargs: wrapped(*args) - 1)
    compiler.max_shared_mem = theirs
    try:
        smemguard.uninstall()
        assert compiler.max_shared_mem is theirs
        assert theirs.__wrapped__ is original
        assert not max_shared_mem.is_patched()
    finally:
        compiler.max_shared_mem = original


def test_unsupported_triton_version_leaves_triton_untouched(monkeypatch, caplog):
    import triton

    before = originals()
    monkeypatch.setattr(triton, "__version__", "4.1.0")
    with caplog.at_level(logging.WARNING, logger="smemguard"):
        assert smemguard.install(Settings()) is False
    assert not smemguard.is_installed()
    assert all(a is b for a, b in zip(before, originals()))
    [line] = [r.getMessage() for r in caplog.records]
    assert "Triton 4.1.0 is outside the checked range >=3.4,<3.10" in line and "upgrade smemguard" in line
    with pytest.raises(SettingsError, match="outside the checked range"):
        smemguard.install(Settings(mode="strict"))


def test_a_failing_patch_is_rolled_back(monkeypatch, caplog):
    from triton.runtime import jit

    before = originals()

    def broken(context):
        raise AttributeError("KernelInterface has changed")

    monkeypatch.setattr(kernel_interface, "patch", broken)
    with caplog.at_level(logging.WARNING, logger="smemguard"):
        assert smemguard.install(Settings(max_shared=65536)) is False
    assert all(a is b for a, b in zip(before, originals())), "partial patches must be rolled back"
    assert jit.KernelInterface.__dict__["__getitem__"] is before[0]
    [line] = [r.getMessage() for r in caplog.records]
    assert "could not patch Triton" in line and "KernelInterface has changed" in line and "untouched" in line


def test_install_before_triton_is_imported_waits_for_the_import():
    result = run_python("""
        import sys
        import smemguard
        assert "triton" not in sys.modules and "torch" not in sys.modules, "importing smemguard imported them"
        print(smemguard.install(), smemguard.is_installed(), "triton" in sys.modules)
        import triton
        print(smemguard.is_installed())
        smemguard.uninstall()
        print(smemguard.is_installed())
    """)
    assert result.stdout.split() == ["True", "False", "False", "True", "False"]


def test_uninstall_before_triton_import_cancels_the_pending_install():
    result = run_python("""
        import sys
        import smemguard
        smemguard.install()
        smemguard.uninstall()
        import triton
        from triton.runtime.jit import KernelInterface
        print(smemguard.is_installed(), getattr(KernelInterface.__getitem__, "__smemguard__", False))
    """)
    assert result.stdout.split() == ["False", "False"]


def test_uninstall_takes_the_replacement_kernels_out_of_tritons_jit_cache(triton_cache):
    """After uninstall() the launch behaves as if smemguard had never been there: it raises again."""
    import torch
    from triton.runtime.errors import OutOfResources

    from kernels import matmul_args, matmul_kernel
    from smemguard.testing import fake_gpu

    a, b, c = (torch.randn(128, 128, dtype=torch.float16) for _ in range(3))
    launch = lambda: matmul_kernel[(2, 2)](*matmul_args(a, b, c), BLOCK_M=64, BLOCK_N=64, BLOCK_K=64,  # noqa: E731
                                           num_stages=4)
    with fake_gpu("L4", max_shared=40000, cache_dir=triton_cache):
        assert smemguard.install(Settings(cache_dir=None))
        try:
            assert launch().metadata.num_stages == 3, "recovered: the replacement is in Triton's JIT cache"
        finally:
            smemguard.uninstall()
        with pytest.raises(OutOfResources):
            launch()


def test_smemguard_disable_leaves_the_named_patches_off_and_says_so_once(caplog):
    import triton  # noqa: F401  (installed now, not at a later import)

    from smemguard import settings as settings_module

    settings = settings_module.load({"SMEMGUARD_DISABLE": " autotuner_bench,max_shared_mem ,", "SMEMGUARD_MAX_SHARED": "L4"})
    assert settings.disabled == ("autotuner_bench", "max_shared_mem") and not settings.problems
    with caplog.at_level(logging.INFO, logger="smemguard"):
        assert smemguard.install(settings)
    try:
        assert kernel_interface.is_patched(), "the other patches still apply"
        assert not autotuner_bench.is_patched() and not max_shared_mem.is_patched()
        [line] = [r.getMessage() for r in caplog.records if "SMEMGUARD_DISABLE" in r.getMessage()]
        assert line == ("smemguard: autotuner_bench, max_shared_mem left off by SMEMGUARD_DISABLE; their targets "
                        "are untouched")
    finally:
        smemguard.uninstall()
