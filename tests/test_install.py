"""install()/uninstall() and the patch modules: idempotent, exact restore, never raising into the host."""

import logging

import pytest
import wrapt

import smemguard
from smemguard import patches
from smemguard.patches.triton_seams import autotuner_bench, kernel_interface, max_shared_mem
from smemguard.facts.settings import Settings, SettingsError

from conftest import ROOT, records, run_python


def originals():
    import triton
    import triton.compiler
    from triton.compiler import compiler
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface

    return (KernelInterface.__dict__["__getitem__"], compiler.max_shared_mem, Autotuner.__dict__["_bench"],
            compiler.compile, triton.compiler.compile, triton.compile)


def test_install_uninstall_restores_exactly_the_originals():
    before = originals()
    assert smemguard.install(Settings(max_shared=101376))
    assert smemguard.is_installed()
    assert all(module.PATCH.is_patched() for module in (kernel_interface, max_shared_mem, autotuner_bench))
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
        from smemguard.facts.settings import Settings

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
        assert not max_shared_mem.PATCH.is_patched()
    finally:
        compiler.max_shared_mem = original


def test_a_triton_older_than_the_oldest_read_is_left_untouched(monkeypatch, caplog):
    import triton

    before = originals()
    monkeypatch.setattr(triton, "__version__", "3.3.1")
    with caplog.at_level(logging.WARNING, logger="smemguard"):
        assert smemguard.install(Settings()) is False
    assert not smemguard.is_installed()
    assert all(a is b for a, b in zip(before, originals()))
    [line] = [r.getMessage() for r in caplog.records]
    assert "Triton 3.3.1 is older than the oldest release read, 3.4" in line and "upgrade Triton" in line
    smemguard.uninstall()
    with pytest.raises(SettingsError, match="older than the oldest release read"):
        smemguard.install(Settings(mode="strict"))


def test_a_triton_newer_than_the_newest_checked_is_guarded_unverified(monkeypatch, caplog, install_guard,
                                                                      incident_log, triton_cache):
    """Above the newest release checked, the patches apply when their own checks pass: one line says so, the
    records carry verified: false; strict mode refuses them and leaves Triton untouched."""
    import torch
    import triton

    from kernels import matmul_args, matmul_kernel
    from smemguard.testing import fake_gpu

    before = originals()
    monkeypatch.setattr(triton, "__version__", "3.99.0")
    with caplog.at_level(logging.INFO, logger="smemguard"):
        install_guard(core=True)
    assert smemguard.is_installed()
    [line] = [r.getMessage() for r in caplog.records if "guarding Triton" in r.getMessage()]
    assert "Triton 3.99.0 (unverified): max_shared_mem" not in line, "no emulated limit: not applied"
    assert "Triton 3.99.0 (unverified): autotuner_bench, " in line and "kernel_interface" in line
    a, b, c = (torch.empty(256, 256, dtype=torch.float16) for _ in range(3))
    with fake_gpu("L4", cache_dir=triton_cache):
        matmul_kernel[(4, 4)](*matmul_args(a, b, c), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=5)
    [record] = records(incident_log)
    assert record["verified"] is False and "triton_compile (Triton 3.99.0)" in record["unverified"]
    smemguard.uninstall()
    assert all(x is y for x, y in zip(before, originals()))
    with pytest.raises(SettingsError, match="newer than the newest release checked, 3.9"):
        smemguard.install(Settings(mode="strict"))
    assert all(x is y for x, y in zip(before, originals())), "strict: Triton left untouched"


def test_a_failing_patch_is_rolled_back_alone(monkeypatch, caplog):
    from triton.runtime import jit

    before = originals()

    def broken(context):
        raise AttributeError("KernelInterface has changed")

    monkeypatch.setattr(kernel_interface.PATCH, "patch", broken)
    with caplog.at_level(logging.WARNING, logger="smemguard"):
        assert smemguard.install(Settings(max_shared=65536)) is True
    assert jit.KernelInterface.__dict__["__getitem__"] is before[0], "the failing patch leaves its target untouched"
    assert max_shared_mem.PATCH.is_patched(), "one failing patch never switches off another"
    [line] = [r.getMessage() for r in caplog.records]
    assert "could not patch Triton" in line and "KernelInterface has changed" in line and "untouched" in line
    smemguard.uninstall()
    assert all(a is b for a, b in zip(before, originals()))


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

    from smemguard.facts import settings as settings_module

    settings = settings_module.load({"SMEMGUARD_DISABLE": " autotuner_bench,max_shared_mem ,",
                                     "SMEMGUARD_MAX_SHARED": "L4"})
    assert settings.disabled == ("autotuner_bench", "max_shared_mem") and not settings.problems
    with caplog.at_level(logging.INFO, logger="smemguard"):
        assert smemguard.install(settings)
    try:
        assert kernel_interface.PATCH.is_patched(), "the other patches still apply"
        assert not autotuner_bench.PATCH.is_patched() and not max_shared_mem.PATCH.is_patched()
        [line] = [r.getMessage() for r in caplog.records if "SMEMGUARD_DISABLE" in r.getMessage()]
        assert line == ("smemguard: autotuner_bench, max_shared_mem left off by SMEMGUARD_DISABLE; their targets "
                        "are untouched")
    finally:
        smemguard.uninstall()


def test_the_readmes_versions_table_is_generated_from_the_patches_data():
    """The README's table of supported versions is `smemguard versions --markdown`, from the data the installer
    checks (regenerate it with that command when a patch's versions change)."""
    from smemguard import patches
    from smemguard.facts import versions

    readme = (ROOT / "README.md").read_text()
    begin, end = "<!-- versions table: begin -->\n", "\n<!-- versions table: end -->"
    table = versions.markdown(versions.patch_versions(patches.all_patches()))
    assert readme[readme.index(begin) + len(begin):readme.index(end)] == table


def test_smemguard_versions_says_what_applies_here_without_importing_the_targets():
    result = run_python("""
        import sys
        from smemguard import cli
        status = cli.main(["versions"])
        print("imported:", sorted(name for name in ("vllm", "flag_gems", "torch._inductor") if name in sys.modules))
        sys.exit(status)
    """)
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["patch", "package", "oldest", "newest", "checked", "installed", "status"]
    rows = {line.split()[0]: line.split() for line in lines[1:-1]}
    assert set(rows) == set(patches.NAMES)
    assert rows["triton_compile"][1:4] == ["Triton", "3.4", "3.9"] and rows["triton_compile"][-1] in (
        "verified", "unverified")
    assert lines[-1] == "imported: []", "reading versions imports none of the patched packages"


def test_the_readme_names_every_patch_smemguard_disable_accepts():
    from smemguard.patches import NAMES

    readme = (ROOT / "README.md").read_text()
    [row] = [line for line in readme.splitlines() if line.startswith("| `SMEMGUARD_DISABLE` |")]
    named = row[row.index("(`") + 1:row.index("`)") + 1]
    assert sorted(name.strip(" `") for name in named.split(",")) == sorted(NAMES)


def test_uninstall_forgets_what_the_patches_decided(install_guard):
    from smemguard import guard

    install_guard()
    engine = guard.installed_engine()
    engine.memory.table("a patch")["a case"] = "its decision"
    smemguard.uninstall()
    assert engine.closed and engine.memory.table("a patch") == {}
