import logging
from pathlib import Path

import pytest

import smemguard
from smemguard.facts import gpus, settings
from smemguard.facts.settings import Settings, SettingsError


def test_defaults():
    s = settings.load({"HOME": "/home/op"})
    assert (s.mode, s.max_shared, s.log_path, s.problems) == ("on", None, None, ())
    assert s.cache_dir == Path("/home/op/.cache/smemguard")


@pytest.mark.parametrize("value, mode", [("on", "on"), ("OFF", "off"), (" observe ", "observe"), ("strict", "strict")])
def test_modes(value, mode):
    assert settings.load({"SMEMGUARD": value}).mode == mode


@pytest.mark.parametrize("value, limit, label", [("101376", 101376, "101376"), ("L20", 101376, "L20"),
                                                 ("rtx 4090", 101376, "RTX4090"), ("NVIDIA H100", 232448, "H100"),
                                                 ("t4", 65536, "T4"), ("MI300X", 65536, "MI300X")])
def test_max_shared(value, limit, label):
    s = settings.load({"SMEMGUARD_MAX_SHARED": value})
    assert (s.max_shared, s.max_shared_label, s.problems) == (limit, label, ())


@pytest.mark.parametrize("env, variable, value, accepted", [
    ({"SMEMGUARD": "maybe"}, "SMEMGUARD", "maybe", "on | off | observe | strict"),
    ({"SMEMGUARD_MAX_SHARED": "abc"}, "SMEMGUARD_MAX_SHARED", "abc", "a GPU name: V100"),
    ({"SMEMGUARD_MAX_SHARED": "L40X"}, "SMEMGUARD_MAX_SHARED", "L40X", "L4, L20"),
    ({"SMEMGUARD_MAX_SHARED": "-5"}, "SMEMGUARD_MAX_SHARED", "-5", "a byte count"),
    ({"SMEMGUARD_MAX_SHARED": "0"}, "SMEMGUARD_MAX_SHARED", "0", "a byte count"),
    ({"SMEMGUARD_LOG": "/etc/hostname/incidents.jsonl"}, "SMEMGUARD_LOG", "/etc/hostname/incidents.jsonl",
     "a writable file path"),
    ({"SMEMGUARD_CACHE_DIR": "/etc/hostname"}, "SMEMGUARD_CACHE_DIR", "/etc/hostname", "a writable directory, or off"),
])
def test_malformed_value_is_one_clear_line_and_the_default(env, variable, value, accepted):
    s = settings.load(env)
    assert len(s.problems) == 1
    line = s.problems[0]
    assert line.startswith(f"{variable}={value!r} ignored")
    assert accepted in line and "Using the default" in line
    assert "\n" not in line
    default = settings.load({})
    assert (s.mode, s.max_shared, s.log_path) == (default.mode, default.max_shared, default.log_path)


@pytest.mark.parametrize("value", ["1", "64", "1024", "49152", "65535"])
def test_a_limit_below_every_gpu_is_a_problem_line(value):
    """Issue 45: 1, 64 or 1024 bytes were accepted silently, and every kernel then failed; the smallest GPU of the
    table (65536 B: T4, MI300X) is the least a limit can be."""
    loaded = settings.load({"SMEMGUARD_MAX_SHARED": value})
    [problem] = loaded.problems
    assert loaded.max_shared is None
    assert problem.startswith(f"SMEMGUARD_MAX_SHARED={value!r} ignored: below the smallest GPU's limit (T4: 65536 B; "
                              "the value is bytes); accepted: a byte count such as 101376, or a GPU name: V100, T4")
    assert problem.endswith("Using the default.")
    assert settings.load({"SMEMGUARD_MAX_SHARED": "65536"}).problems == ()


def test_log_path_that_is_a_directory(tmp_path):
    s = settings.load({"SMEMGUARD_LOG": str(tmp_path)})
    assert s.log_path is None and "is a directory" in s.problems[0]


def test_log_path_in_a_directory_to_be_created(tmp_path):
    path = tmp_path / "new" / "dir" / "incidents.jsonl"
    assert settings.load({"SMEMGUARD_LOG": str(path)}).log_path == path


def test_cache_dir_off_and_xdg(tmp_path):
    assert settings.load({"SMEMGUARD_CACHE_DIR": "off"}).cache_dir is None
    assert settings.load({"XDG_CACHE_HOME": str(tmp_path)}).cache_dir == tmp_path / "smemguard"


def test_unknown_variable_is_named_with_a_suggestion():
    s = settings.load({"SMEMGUARD_MAX_SHARD": "L4", "SMEMGUARD_WHATEVER": "1"})
    assert s.max_shared is None
    assert any("SMEMGUARD_MAX_SHARD is not a smemguard setting (did you mean SMEMGUARD_MAX_SHARED?)" in p
               for p in s.problems)
    assert any(p.startswith("SMEMGUARD_WHATEVER is not a smemguard setting;") for p in s.problems)


def test_settings_are_frozen():
    with pytest.raises(AttributeError):
        settings.load({}).mode = "off"


def test_install_logs_each_problem_once_and_keeps_going(caplog):
    s = settings.load({"SMEMGUARD_MAX_SHARED": "abc", "SMEMGUARD_TYPO": "x"})
    with caplog.at_level(logging.WARNING, logger="smemguard"):
        assert smemguard.install(s)
        smemguard.uninstall()
        assert smemguard.install(s)
        smemguard.uninstall()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("SMEMGUARD_MAX_SHARED='abc'" in line for line in lines) == 1
    assert sum("SMEMGUARD_TYPO" in line for line in lines) == 1


def test_strict_mode_raises_on_a_problem():
    s = settings.load({"SMEMGUARD": "strict", "SMEMGUARD_MAX_SHARED": "L44"})
    with pytest.raises(SettingsError, match="SMEMGUARD_MAX_SHARED='L44'"):
        smemguard.install(s)
    assert not smemguard.is_installed()


def test_off_installs_nothing():
    assert smemguard.install(Settings(mode="off")) is False
    assert not smemguard.is_installed()


def test_every_gpu_name_and_alias_resolves_to_itself():
    for gpu in gpus.GPUS:
        for name in (gpu.name, *gpu.aliases):
            assert gpus.lookup(name) is gpu
    assert gpus.lookup("NVIDIA GeForce RTX 4090").name == "RTX4090"
    assert gpus.lookup("AMD Instinct MI300X").name == "MI300X"
    assert gpus.lookup("NVIDIA H100 80GB HBM3") is None or gpus.lookup("NVIDIA H100 80GB HBM3").name == "H100"
    assert gpus.lookup("L40X") is None


def test_smemguard_disable_is_bounded():
    import time

    from smemguard import guard
    from smemguard.facts import settings as settings_module

    started = time.perf_counter()
    huge = settings_module.load({"SMEMGUARD_DISABLE": "kernel_warmup," * 100_000})
    assert huge.disabled == () and len(huge.problems) == 1 and len(huge.problems[0]) < 400
    long_name = settings_module.load({"SMEMGUARD_DISABLE": "x" * 1_000_000})
    [line] = guard.settings_problems(long_name)
    assert len(line) < 1000 and time.perf_counter() - started < 5


# -- Settings as untrusted input (issue 33, item 9) ---------------------------------------------------------


@pytest.mark.parametrize("var", [settings.LOG, settings.METRICS_FILE, settings.CACHE_DIR])
def test_a_path_setting_with_a_newline_cannot_forge_a_log_line(tmp_path, var):
    loaded = settings.load({var: f"{tmp_path}/x\nWARNING smemguard: all is well"})
    [problem] = loaded.problems
    assert "\n" not in problem and "control character" in problem and "Using the default" in problem
    assert loaded.log_path is None and loaded.metrics_file is None


def test_a_huge_setting_is_not_echoed_whole():
    [problem] = settings.load({settings.MAX_SHARED: "x" * 130_000}).problems
    assert len(problem) < 1000 and "(130000 characters)" in problem, "cut at SHOWN_VALUE characters"


def test_thousands_of_unknown_variables_give_a_bounded_number_of_lines():
    environ = {f"SMEMGUARD_NOISE_{n}": "1" for n in range(3000)}
    problems = settings.load(environ).problems
    assert len(problems) == settings.MAX_UNKNOWN_NAMED + 1
    assert problems[-1].startswith(f"{3000 - settings.MAX_UNKNOWN_NAMED} more SMEMGUARD_ variables")


def test_non_ascii_digits_are_refused_for_what_they_are():
    [problem] = settings.load({settings.MAX_SHARED: "１０１３７６"}).problems
    assert "not ASCII digits" in problem and "must be positive" not in problem
