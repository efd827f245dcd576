"""The vLLM entry point: found by its group, re-entrant, never raising into the host process."""

import importlib.metadata

from conftest import run_python


def test_entry_point_is_registered_in_the_vllm_group():
    [entry] = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "smemguard"]
    assert entry.value == "vllm_plugin:register"
    assert callable(entry.load())


def test_register_twice_installs_once_and_says_so_once():
    result = run_python("""
        def layers(obj):
            n = 0
            while getattr(obj, "_self_wrapper", None) is not None:
                n, obj = n + 1, obj.__wrapped__
            return n

        import importlib.metadata, triton
        from triton.runtime.autotuner import Autotuner
        [entry] = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "smemguard"]
        register = entry.load()
        register()
        register()
        import smemguard
        print(smemguard.is_installed(), layers(Autotuner.__dict__["_bench"]))
    """, env={"SMEMGUARD_MAX_SHARED": "L20"})
    assert result.stdout.split() == ["True", "1"]
    info = [line for line in result.stderr.splitlines() if "[smemguard]" in line]
    assert len(info) == 1, result.stderr
    assert info[0].startswith("INFO") and "smemguard 0.1.0 guarding Triton" in info[0]
    assert "mode=on" in info[0] and "emulated at 101376 B (SMEMGUARD_MAX_SHARED=L20)" in info[0]


def test_register_before_triton_is_imported_installs_on_import():
    result = run_python("""
        import sys, vllm_plugin
        vllm_plugin.register()
        assert "triton" not in sys.modules
        import triton, smemguard
        print(smemguard.is_installed())
    """)
    assert result.stdout.split() == ["True"]


def test_register_with_triton_import_broken_on_purpose(tmp_path):
    broken = tmp_path / "triton"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise RuntimeError('this triton is broken')\n")
    result = run_python("""
        import vllm_plugin, smemguard
        vllm_plugin.register()
        try:
            import triton
        except RuntimeError as error:
            print("user sees:", error)
        print("alive", smemguard.is_installed())
    """, env={"PYTHONPATH": str(tmp_path)})
    assert result.stdout.splitlines() == ["user sees: this triton is broken", "alive False"]


def test_register_with_the_patch_target_broken_on_purpose():
    result = run_python("""
        import triton
        from triton.runtime import jit
        del jit.KernelInterface.__getitem__
        import vllm_plugin, smemguard
        vllm_plugin.register()
        print("alive", smemguard.is_installed(), hasattr(triton.runtime.autotuner.Autotuner._bench, "_self_wrapper"))
    """)
    assert result.stdout.split() == ["alive", "False", "True"], \
        "the broken target's patch is rolled back alone: the launch guard is off, the others still apply"
    [line] = [line for line in result.stderr.splitlines() if "[smemguard]" in line and "WARNING" in line]
    assert "could not patch Triton" in line and "kernel_interface (KeyError" in line
    [installed] = [line for line in result.stderr.splitlines() if "guarding Triton" in line]
    assert "kernel_interface" not in installed and "autotuner_bench" in installed, "the install line says what applied"


def test_register_with_a_malformed_setting_keeps_going_with_the_default():
    result = run_python("""
        import triton, vllm_plugin, smemguard
        vllm_plugin.register()
        print("alive", smemguard.is_installed())
    """, env={"SMEMGUARD_MAX_SHARED": "abc", "SMEMGUARD_LGO": "/tmp/x"})
    assert result.stdout.split() == ["alive", "True"]
    lines = [line for line in result.stderr.splitlines() if "[smemguard]" in line]
    assert sum("SMEMGUARD_MAX_SHARED='abc' ignored" in line for line in lines) == 1
    assert sum("SMEMGUARD_LGO is not a smemguard setting (did you mean SMEMGUARD_LOG?)" in line for line in lines) == 1
    assert any("shared-memory limit from the device" in line for line in lines)


def test_strict_mode_stops_the_process_on_a_malformed_setting():
    result = run_python("""
        import triton, vllm_plugin
        vllm_plugin.register()
        print("alive")
    """, env={"SMEMGUARD": "strict", "SMEMGUARD_MAX_SHARED": "abc"}, check=False)
    assert result.returncode != 0 and "alive" not in result.stdout
    assert "SettingsError" in result.stderr and "SMEMGUARD_MAX_SHARED='abc'" in result.stderr


def test_off_registers_nothing():
    result = run_python("""
        import triton, vllm_plugin, smemguard
        vllm_plugin.register()
        print(smemguard.is_installed())
    """, env={"SMEMGUARD": "off"})
    assert result.stdout.split() == ["False"]
