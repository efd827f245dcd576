"""Pins (issue 47): an operator's num_stages / num_warps for a kernel on a GPU, applied at ``triton.compile`` before
Triton compiles (Triton's real compiles for a stand-in GPU, Triton's own load check): no exception, no compile
wasted, one ``pinned`` record; refused with one line where the pinned variant would not fit or the kernel computes
with the option's namesake parameter; kept in the decision cache by ``smemguard pin``, declared in the file
``SMEMGUARD_PINS`` names, both read as untrusted input; shown by ``smemguard check``."""

import json
import logging
import os

import pytest
import torch
import triton
import triton.language as tl

import smemguard
from smemguard.cli import commands
from smemguard.facts import settings as settings_module
from smemguard.facts.pins import Pin
from smemguard.facts.settings import PINS, Settings
from smemguard.store import decision_cache
from smemguard.testing import fake_gpu, load_check_failures as load_checks

from conftest import records
from kernels import autotuned, config, depth_parameter_matmul, matmul_args, matmul_kernel

MATMUL = "smemguard.examples:matmul_kernel"


def operands():
    return [torch.empty(256, 256, dtype=torch.float16) for _ in range(3)]


def five_stages(kernel=matmul_kernel, **options):
    """131072 B at 5 stages on sm_89, 98304 at 4, 65536 at 3, 32768 at 2: an L4's 101376 B takes 4 unpinned."""
    kernel[(4, 4)](*matmul_args(*operands()), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, **{"num_stages": 5, **options})


def pinned(kernel=MATMUL, gpu="sm_89", **options) -> Pin:
    return Pin(kernel, gpu, options.get("num_stages"), options.get("num_warps"), origin=PINS)


def warnings_about(caplog, text: str) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.levelno >= logging.WARNING and text in record.getMessage()]


def test_a_pin_compiles_the_kernel_at_its_stages_before_anything_overflows(install_guard, incident_log, tmp_path,
                                                                           triton_cache):
    """5 stages asked for under an L4, pinned to 2: compiled directly at 2 (no fewer-stage search, no OutOfResources,
    not even a caught one), every launch of it runs that, one ``pinned`` record naming the compile as asked and the
    launch behind it, and nothing stored as a decision (a pin is the operator's, not smemguard's)."""
    install_guard(core=True, cache_dir=tmp_path / "decisions", pins=(pinned(num_stages=2),))
    with load_checks() as raised, fake_gpu("L4", cache_dir=triton_cache) as gpu:
        five_stages()
        five_stages()
    assert raised == []
    assert [(launch.num_stages, launch.shared) for launch in gpu.launches] == [(2, 32768)] * 2
    [record] = records(incident_log)
    assert (record["action"], record["phase"], record["launched_as"]) == ("pinned", "compile", "triton.compile")
    assert (record["final"], record["required"], record["limit_hit"], record["compiles"]) == ("num_stages=2", 32768,
                                                                                             101376, 1)
    assert record["config"] == "BLOCK_M=128 BLOCK_N=128 BLOCK_K=64 num_warps=4 num_stages=5", "the compile as asked"
    assert record["grid"] == [4, 4] and record["args"]["a_ptr"]["shape"] == [256, 256], "the launch behind it"
    assert record["reason"] == f"pinned by {PINS}: {MATMUL} on sm_89: num_stages=2"
    stored = tmp_path / "decisions" / decision_cache.FILE_NAME
    assert not stored.exists() or json.loads(stored.read_text())["compile"] == {}


def test_replay_compiles_what_a_pin_chose(install_guard, incident_log, triton_cache, capsys):
    install_guard(core=True, pins=(pinned(num_stages=2),))
    with fake_gpu("L4", cache_dir=triton_cache):
        five_stages()
    smemguard.uninstall()
    assert commands.main(["replay", str(incident_log)]) == 0
    assert "it needs 32768 B and fits 101376 B (as recorded)" in capsys.readouterr().out
    assert commands.main(["replay", str(incident_log), "--limit", "30000"]) == 1
    assert "it needs 32768 B, over 30000 B: the pin would be refused here" in capsys.readouterr().out


def test_a_pipeline_depth_parameter_is_lowered_with_a_pinned_option_and_warps_are_pinned_too(
        install_guard, incident_log, triton_cache):
    install_guard(core=True, pins=(pinned("*:depth_parameter_matmul", num_stages=2, num_warps=2),))
    with fake_gpu("L4", cache_dir=triton_cache) as gpu:
        depth_parameter_matmul[(4, 4)](*matmul_args(*operands()), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64,
                                       NUM_STAGES=5, num_stages=5)
    assert (gpu.launches[-1].num_stages, gpu.launches[-1].num_warps) == (2, 2)
    [record] = records(incident_log)
    assert record["final"] == "num_stages=2, num_warps=2, NUM_STAGES=2"
    assert record["constexprs"]["NUM_STAGES"] == 5, "the compile as asked"


def test_an_autotuner_times_each_config_as_pinned_and_one_record_says_so(install_guard, incident_log, triton_cache):
    """The 5-stage config is timed (and would run) as its pinned 2-stage variant, the 2-stage one as asked: nothing
    raises inside the benchmark, and one record for the kernel, not one per config."""
    kernel = autotuned([config(128, 128, 64, 5), config(128, 128, 64, 3, num_warps=8)])
    install_guard(core=True, pins=(pinned(num_stages=2),))
    with load_checks() as raised, fake_gpu("L4", cache_dir=triton_cache) as gpu:
        gpu.bench_ms = iter([1.0, 2.0] * 100).__next__  # the first config's variant times fastest
        kernel[lambda meta: (2, 2)](*matmul_args(*operands()))
    assert raised == [] and (gpu.launches[-1].num_stages, gpu.launches[-1].num_warps) == (2, 4)
    assert [(record["action"], record["num_stages"]) for record in records(incident_log)] == [("pinned", 5)]


def test_a_pin_by_amd_arch_applies_on_an_mi300x(install_guard, incident_log, triton_cache):
    """gfx942 keeps (S-1) stages in LDS: 128x128x64 at 5 stages needs 131072 B of the MI300X's 65536."""
    install_guard(core=True, pins=(pinned(gpu="gfx942", num_stages=2),))
    with load_checks() as raised, fake_gpu("MI300X", cache_dir=triton_cache) as gpu:
        five_stages()
    assert raised == [] and gpu.launches[-1].num_stages == 2 and gpu.launches[-1].shared <= 65536
    [record] = records(incident_log)
    assert record["action"] == "pinned" and record["device"]["arch"] == "gfx942"


@pytest.mark.parametrize("gpu, stand_in, emulated, stages", [
    ("L4", "H100", "L4", 2),  # by name: the GPU the process emulates (else torch's name of the device)
    ("sm_89", "L4", None, 2),
    ("101376", "L4", None, 2),
    ("T4", "L4", None, 4),  # another GPU's pin: the core fits it as without
    ("sm_90", "L4", None, 4),
    ("65536", "L4", None, 4)])
def test_a_pin_names_its_gpu_by_name_arch_or_limit(install_guard, incident_log, triton_cache, gpu, stand_in,
                                                   emulated, stages):
    limit = {"max_shared": 101376, "max_shared_label": emulated} if emulated else {}
    install_guard(core=True, pins=(pinned(gpu=gpu, num_stages=2),), **limit)
    with load_checks() as raised, fake_gpu(stand_in, cache_dir=triton_cache) as launched:
        five_stages()
    assert raised == [] and launched.launches[-1].num_stages == stages
    [record] = records(incident_log)
    assert record["action"] == ("pinned" if stages == 2 else "stages_reduced")


def test_the_most_specific_pin_applies_and_a_glob_matches_by_module_and_name(install_guard, incident_log,
                                                                            triton_cache):
    install_guard(core=True, pins=(pinned("smemguard.exam*:matmul_*", num_stages=2),
                                   pinned(MATMUL, gpu="101376", num_stages=3),
                                   pinned("*:another_kernel", num_stages=1)))
    with fake_gpu("L4", cache_dir=triton_cache) as gpu:
        five_stages()
    assert gpu.launches[-1].num_stages == 3, "an exact name before a glob, whatever names the GPU"
    [record] = records(incident_log)
    assert record["reason"].endswith(f"{MATMUL} on 101376: num_stages=3")


def test_a_pin_that_would_not_fit_is_refused_in_one_line_and_the_kernel_recovered_as_without_it(
        install_guard, incident_log, triton_cache, caplog):
    """Pinned to 4 stages (98304 B) under 65536 B: refused, and the kernel compiled as asked is fitted by the core
    (3 stages, as without the pin); nothing raised."""
    install_guard(core=True, pins=(pinned(num_stages=4),))
    with caplog.at_level(logging.INFO), load_checks() as raised, \
            fake_gpu("L4", max_shared=65536, cache_dir=triton_cache) as gpu:
        five_stages()
        five_stages()
    assert raised == [] and [launch.num_stages for launch in gpu.launches] == [3, 3]
    [line] = warnings_about(caplog, "refused")
    assert line == (f"smemguard: the pin {MATMUL} on sm_89: num_stages=4 ({PINS}) is refused for {MATMUL}: its "
                    "variant needs 98304 B, over the 65536 B limit here; compiled as without it")
    [record] = records(incident_log)
    assert (record["action"], record["final"]) == ("stages_reduced", "num_stages=3")


@triton.jit
def matmul_computing_with_its_stages(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                                     stride_cm, stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                     BLOCK_K: tl.constexpr, num_stages: tl.constexpr, num_warps: tl.constexpr):
    """Liger-Kernel's convention (the launch options are parameters too), with a result that depends on the one
    named num_stages: changing the option would change the answer."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rm[:, None] * stride_am + (k + rk)[None, :] * stride_ak)
        b = tl.load(b_ptr + (k + rk)[:, None] * stride_bk + rn[None, :] * stride_bn)
        acc += tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, (acc * num_stages).to(tl.float16))


def test_a_pin_of_an_option_the_kernel_computes_with_is_refused_in_one_line(install_guard, incident_log,
                                                                            triton_cache, caplog):
    install_guard(core=True, pins=(pinned("*:matmul_computing_with_its_stages", num_stages=2),))
    with caplog.at_level(logging.INFO), fake_gpu("L4", cache_dir=triton_cache) as gpu:
        matmul_computing_with_its_stages[(1, 1)](*matmul_args(*operands()), 128, 128, 64, 5, 4)
    assert gpu.launches[-1].num_stages == 3, "Triton's default options, compiled as asked (65536 B fit)"
    [line] = warnings_about(caplog, "refused")
    assert "num_stages is also a parameter the kernel uses" in line
    assert records(incident_log) == []


def test_pin_add_list_and_remove_and_the_next_process_compiles_the_pinned_stages(install_guard, incident_log,
                                                                                tmp_path, triton_cache, capsys):
    cache = tmp_path / "cache"
    assert commands.main(["pin", "add", "smemguard.examples:matmul_*", "--gpu", "nvidia l4", "--num-stages", "2",
                          "--dir", str(cache)]) == 0
    assert capsys.readouterr().out == (f"pinned smemguard.examples:matmul_* on L4: num_stages=2 in "
                                       f"{cache / decision_cache.FILE_NAME}\n")
    assert commands.main(["pin", "add", "vllm.*:fused_moe_kernel", "--gpu", "sm_89", "--num-warps", "4",
                          "--dir", str(cache)]) == 0
    assert commands.main(["pin", "add", "vllm.*:fused_moe_kernel", "--gpu", "sm_89", "--num-stages", "3",
                          "--dir", str(cache)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith(", replacing num_warps=4")
    assert commands.main(["pin", "list", "--dir", str(cache)]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0] == "2 pins in force:" and "  vllm.*:fused_moe_kernel on sm_89: num_stages=3  (" in listed[2]
    assert commands.main(["pin", "remove", "vllm.*:fused_moe_kernel", "--gpu", "SM_89", "--dir", str(cache)]) == 0
    assert commands.main(["pin", "remove", "vllm.*:fused_moe_kernel", "--gpu", "sm_89", "--dir", str(cache)]) == 2
    assert capsys.readouterr().err.count("\n") == 1, "one line: no such pin"
    assert commands.main(["cache", "clear", "--dir", str(cache)]) == 0, "decisions are forgotten, pins stay"
    assert commands.main(["pin", "list", "--json", "--dir", str(cache)]) == 0
    assert json.loads(capsys.readouterr().out.split("\n", 1)[1]) == {
        "pins": [{"kernel": "smemguard.examples:matmul_*", "gpu": "L4", "num_stages": 2}]}

    install_guard(core=True, cache_dir=cache, max_shared=101376, max_shared_label="L4")
    with load_checks() as raised, fake_gpu("H100", cache_dir=triton_cache) as gpu:
        five_stages()
    assert raised == [] and gpu.launches[-1].num_stages == 2
    assert [record["action"] for record in records(incident_log)] == ["pinned"]


@pytest.mark.parametrize("argv, problem", [
    (["add", "matmul_kernel", "--gpu", "L4", "--num-stages", "2"], "expected a kernel's module:name"),
    (["add", MATMUL, "--gpu", "L5", "--num-stages", "2"], "'gpu' is \"L5\", expected a GPU of 'smemguard gpus'"),
    (["add", MATMUL, "--gpu", "L4"], "neither num_stages nor num_warps"),
    (["add", MATMUL, "--gpu", "L4", "--num-warps", "3"], "'num_warps' is 3, expected a power of two from 1 to 32"),
    (["add", MATMUL, "--gpu", "L4", "--num-stages", "0"], "'num_stages' is 0, expected an integer from 1 to 32"),
    (["remove", MATMUL, "--gpu", "0"], "'gpu' is \"0\"")])
def test_a_pin_that_is_not_one_is_refused_in_one_line(tmp_path, capsys, argv, problem):
    assert commands.main(["pin", *argv, "--dir", str(tmp_path / "cache")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and problem in err, err
    assert not (tmp_path / "cache").exists(), "nothing written"


def test_pin_commands_refuse_a_cache_that_is_off_or_not_smemguards(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(settings_module.CACHE_DIR, "off")
    assert commands.main(["pin", "add", MATMUL, "--gpu", "L4", "--num-stages", "2"]) == 2
    assert "the decision cache is off" in capsys.readouterr().err
    foreign = tmp_path / "cache"
    foreign.mkdir(mode=0o700)
    (foreign / decision_cache.FILE_NAME).write_text('{"not": "a decision file"}')
    assert commands.main(["pin", "add", MATMUL, "--gpu", "L4", "--num-stages", "2", "--dir", str(foreign)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a smemguard decision file" in err
    assert (foreign / decision_cache.FILE_NAME).read_text() == '{"not": "a decision file"}', "untouched"


GOOD = {"kernel": MATMUL, "gpu": "L4", "num_stages": 2}


@pytest.mark.parametrize("content, problem", [
    (b"[", "not JSON"),
    (b'{"pins": 3}', "holds no pins"),
    (b"\xff\xfe", "not UTF-8 text"),
    (json.dumps({"pins": [{**GOOD, "BLOCK_M": 64}]}).encode(), '"BLOCK_M" cannot be pinned: a pin sets num_stages and '
                                                             "num_warps only"),
    (json.dumps({"pins": [{**GOOD, "num_warps": 48}]}).encode(), "'num_warps' is 48"),
    (json.dumps({"pins": [GOOD] * 2000}).encode(), "2000 pins, more than the 1000"),
    (b" " * (2**20 + 1), "is larger than 1 MiB"),
    (json.dumps({"pins": [GOOD, {**GOOD, "num_stages": 3}]}).encode(), "pin 2: the same kernel and GPU as pin 1"),
    (json.dumps({"pins": [{**GOOD, "kernel": "a\nb:c"}]}).encode(), "'kernel' is \"a\\nb:c\""),
    ("directory", "is a directory"),
    ("fifo", "FIFO"),
    ("writable by others", "can be written by others"),
    ("missing", "No such file")])
def test_a_hostile_pins_file_is_one_settings_line(tmp_path, content, problem):
    path = tmp_path / "pins.json"
    if content == "directory":
        path.mkdir()
    elif content == "fifo":
        os.mkfifo(path)
    elif content == "writable by others":
        path.write_text(json.dumps({"pins": [GOOD]}))
        path.chmod(0o666)
    elif content != "missing":
        path.write_bytes(content)
    loaded = settings_module.load({PINS: str(path)})
    [line] = loaded.problems
    assert line.startswith(f"{PINS}=") and problem in line and "\n" not in line, line
    kept = [pin.key for pin in loaded.pins]
    assert kept == ([(MATMUL, "L4")] if "the same kernel" in problem else []), "a pin left out is no pin"


def test_a_hostile_pins_entry_of_the_decision_cache_is_one_line_and_the_others_apply(
        install_guard, incident_log, tmp_path, triton_cache, capsys, caplog):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    table = {f"{MATMUL} on sm_89": {**GOOD, "gpu": "sm_89", "action": "pinned"},
             "a:b on L4": {"kernel": "a:b", "gpu": "L4", "num_warps": 3, "action": "pinned"},
             "a:c on L4": {"kernel": "a:c", "gpu": "L4", "num_stages": 2, "BLOCK_N": 16, "action": "pinned"},
             "elsewhere": {"kernel": "a:d", "gpu": "L4", "num_stages": 2, "action": "pinned"}}
    (cache / decision_cache.FILE_NAME).write_text(json.dumps({"schema": 1, "compile": {}, "launch": {}, "pins": table}))
    (cache / decision_cache.FILE_NAME).chmod(0o600)
    assert commands.main(["pin", "list", "--dir", str(cache)]) == 2
    out, err = capsys.readouterr()
    assert out.splitlines()[:2] == ["1 pins in force:", f"  {MATMUL} on sm_89: num_stages=2  (the decision cache, "
                                                        f"{cache / decision_cache.FILE_NAME})"]
    lines = err.splitlines()
    assert len(lines) == 3 and all(f'pins entry "{key}": ' in line for key, line in zip(list(table)[1:], lines))
    assert "'num_warps' is 3" in lines[0] and '"BLOCK_N" cannot be pinned' in lines[1] and "its key is not" in lines[2]
    install_guard(core=True, cache_dir=cache)
    with caplog.at_level(logging.INFO), fake_gpu("L4", cache_dir=triton_cache) as gpu:
        five_stages()
    assert gpu.launches[-1].num_stages == 2
    [line] = warnings_about(caplog, "entries smemguard cannot apply")
    assert "3 entries" in line


def test_the_file_pin_wins_over_the_caches_for_the_same_kernel_and_gpu(install_guard, incident_log, tmp_path,
                                                                       triton_cache, capsys, monkeypatch):
    cache = tmp_path / "cache"
    assert commands.main(["pin", "add", MATMUL, "--gpu", "L4", "--num-stages", "3", "--dir", str(cache)]) == 0
    capsys.readouterr()
    path = tmp_path / "pins.json"
    path.write_text(json.dumps({"pins": [GOOD]}))
    monkeypatch.setenv(PINS, str(path))
    assert commands.main(["pin", "list", "--dir", str(cache)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == f"  {MATMUL} on L4: num_stages=2  ({PINS}={path})"
    assert out[2].startswith(f"  overridden by {PINS}: {MATMUL} on L4: num_stages=3")
    install_guard(core=True, cache_dir=cache, pins=settings_module.load().pins, max_shared=101376,
                  max_shared_label="L4")
    with fake_gpu("H100", cache_dir=triton_cache) as gpu:
        five_stages()
    assert gpu.launches[-1].num_stages == 2


def test_check_shows_what_each_pin_does_on_each_gpu(tmp_path, capsys, monkeypatch):
    """Two configs under an L4 and a T4: the pin by limit (every 101376 B GPU) applies to the 128x128 config (98304 B
    at 4 stages) and is refused for the 128x256 one (147456 B); the T4's pin applies to both, where Triton
    pipelines nothing (32768 and 49152 B whatever the stages)."""
    path = tmp_path / "pins.json"
    path.write_text(json.dumps({"pins": [{"kernel": "*:matmul_kernel", "gpu": "101376", "num_stages": 4},
                                         {"kernel": MATMUL, "gpu": "T4", "num_stages": 1}]}))
    monkeypatch.setenv(PINS, str(path))
    monkeypatch.setenv(settings_module.CACHE_DIR, str(tmp_path / "cache"))
    status = commands.main(["check", MATMUL, "--gpu", "L4,T4", "--meta", "BLOCK_M=128,BLOCK_N=128,BLOCK_K=64,"
                            "num_stages=5", "--meta", "BLOCK_M=128,BLOCK_N=256,BLOCK_K=64,num_stages=5", "--jobs", "1",
                            "--exact", "--quiet", "--json"])
    assert status == 1, "the 128x256 config fits no L4 at 5 stages: the check's own finding"
    shown = {(outcome["pin"]["gpu"], outcome["gpu"]): [(config["outcome"], config["shared"])
                                                       for config in outcome["configs"]]
             for outcome in json.loads(capsys.readouterr().out)["pins"]}
    assert shown[("101376", "L4")] == [("applies", 98304), ("refused", 147456)]
    assert [outcome for outcome, _ in shown[("T4", "T4")]] == ["applies", "applies"]
    assert set(shown) == {("101376", "L4"), ("T4", "T4")}


def test_an_uninstall_takes_the_pinned_kernel_out_of_the_jit_cache(triton_cache):
    """Under 200000 B the 5 stages fit: pinned, they launch at 2; uninstalled, as asked."""
    assert smemguard.install(Settings(pins=(pinned(num_stages=2),)))
    try:
        with fake_gpu("L4", max_shared=200000, cache_dir=triton_cache) as gpu:
            five_stages()
            smemguard.uninstall()
            five_stages()
    finally:
        smemguard.uninstall()
    assert [launch.num_stages for launch in gpu.launches] == [2, 5]
