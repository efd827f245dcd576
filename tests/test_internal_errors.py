"""An error inside smemguard never replaces the user's: every step of recovery runs under one guard
(smemguard.engine.steps.Steps). Each test breaks one step (smemguard's own code, never Triton's) and checks
what the caller sees: their own OutOfResources where recovery cannot go on without the step, the
recovered launch where the step only saved work; and that the record counts the internal error."""

import pytest
import torch
from triton.runtime.errors import OutOfResources

from smemguard.store import decision_cache
from smemguard import guard
from smemguard.engine import ladder, recall, recovery
from smemguard.kernels import launch, variants
from smemguard.testing import fake_gpu

from conftest import records
from kernels import autotuned, config, matmul_args, matmul_kernel, tiled_grid

N = 256


def failing_once(original):
    """``original``, except that its first call raises as a bug of smemguard's would."""
    calls = []

    def broken(*args, **kwargs):
        if not calls:
            calls.append(1)
            raise KeyError("smemguard bug (planted by the test)")
        return original(*args, **kwargs)

    return broken


def always_failing(original):
    """For the decision store's functions, which the compile-time patch calls too (and survives)."""

    def broken(*args, **kwargs):
        raise KeyError("smemguard bug (planted by the test)")

    return broken


def aligned_operands():
    return tuple(torch.empty(N, N, dtype=torch.float16) for _ in range(3))


# (step as the record names it, the owner of the function that does it, its name, how it breaks, what the
# caller gets)
PLAIN_KERNEL_STEPS = [
    ("resolve the launch", recovery, "resolve", failing_once, "raised"),
    ("compile the failing launch", launch.Launch, "compile", failing_once, "raised"),
    ("check the kernel in the JIT cache", recovery, "check", failing_once, "recovered"),
    ("find the case", recovery.Decided, "case_for", failing_once, "recovered"),
    ("describe the arguments", recovery, "described_args", failing_once, "recovered"),
    ("open the decision store", decision_cache, "store", always_failing, "recovered"),
    ("key the stored decisions", variants, "cases_for", always_failing, "recovered"),
    ("decide", ladder, "decide", failing_once, "raised"),
    ("store the decision", recall, "remember", always_failing, "recovered"),
    ("replace in the JIT cache", recovery, "replace_in_jit_cache", failing_once, "raised"),
]


@pytest.mark.parametrize("step, owner, name, breaks, outcome", PLAIN_KERNEL_STEPS,
                         ids=[s[0] for s in PLAIN_KERNEL_STEPS])
def test_a_failing_step_leaves_the_user_their_error_or_the_recovered_launch(step, owner, name, breaks, outcome,
                                                                          install_guard, incident_log, triton_cache,
                                                                          tmp_path, monkeypatch):
    a, b, c = aligned_operands()
    install_guard(cache_dir=tmp_path / "cache")
    monkeypatch.setattr(owner, name, breaks(getattr(owner, name)))
    with fake_gpu("L4", max_shared=40000, cache_dir=triton_cache) as gpu:
        launch_it = lambda: matmul_kernel[(4, 4)](*matmul_args(a, b, c), BLOCK_M=64, BLOCK_N=64,  # noqa: E731
                                                   BLOCK_K=64, num_stages=4)
        if outcome == "raised":
            with pytest.raises(OutOfResources) as caught:
                launch_it()
            assert caught.value.required == 49152 and caught.value.__context__ is None, "the user's own error"
            assert not gpu.launches
        else:
            launch_it()
            assert (gpu.launches[-1].num_stages, gpu.launches[-1].shared) == (3, 32768), "recovered"
    last = records(incident_log)[-1]
    assert last["internal_errors"] == 1 and last["internal_steps"] == [step]
    assert last["action"] == ("reraised" if outcome == "raised" else "stages_reduced")


def test_a_failing_recall_still_recovers_by_deciding_again(install_guard, incident_log, triton_cache, tmp_path,
                                                          monkeypatch):
    """The decision another process stored cannot be read back: the ladder decides instead. (The compile-time
    patch, which would apply the stored decision before anything fails, is left off.)"""
    a, b, c = aligned_operands()
    launch_it = lambda: matmul_kernel[(4, 4)](*matmul_args(a, b, c), BLOCK_M=64, BLOCK_N=64,  # noqa: E731
                                               BLOCK_K=64, num_stages=4)
    install_guard(cache_dir=tmp_path / "cache", disabled=("jit_compile",))
    with fake_gpu("L4", max_shared=40000, cache_dir=triton_cache):
        launch_it()
    guard.installed_engine().decided.clear()  # a new process: nothing decided here yet
    guard.installed_engine().notes.drop_replacements()
    monkeypatch.setattr(recall, "recall", always_failing(recall.recall))
    with fake_gpu("L4", max_shared=40000, cache_dir=triton_cache) as gpu:
        launch_it()
        assert gpu.launches[-1].num_stages == 3
    last = records(incident_log)[-1]
    assert last["internal_steps"] == ["recall a stored decision"] and last["action"] == "stages_reduced"


def test_a_failing_switch_to_another_config_raises_the_users_error(install_guard, incident_log, triton_cache,
                                                                   monkeypatch):
    a, b, c = aligned_operands()
    tuned = autotuned([config(128, 128, 64, 3), config(64, 64, 64, 4)])
    install_guard()
    monkeypatch.setattr(recovery, "with_config", failing_once(recovery.with_config))
    with fake_gpu("L4", max_shared=30000, cache_dir=triton_cache), pytest.raises(OutOfResources) as caught:
        tuned[tiled_grid(N, N)](*matmul_args(a, b, c))
    assert caught.value.__context__ is None
    decided, raised = records(incident_log)
    assert decided["action"] == "config_changed", "the decision was taken and recorded"
    assert raised["action"] == "reraised" and raised["internal_steps"] == ["launch with the new config"]


def test_a_failing_binding_for_the_fallback_raises_the_users_error(install_guard, incident_log, triton_cache,
                                                                  monkeypatch):
    import smemguard

    a, b, c = aligned_operands()
    ran = []
    smemguard.register_fallback(matmul_kernel, lambda **named: ran.append(named))
    try:
        install_guard()
        monkeypatch.setattr(recovery, "_fallback_arguments", failing_once(recovery._fallback_arguments))
        with fake_gpu("L4", max_shared=8000, cache_dir=triton_cache), pytest.raises(OutOfResources):
            matmul_kernel[(4, 4)](*matmul_args(a, b, c), BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_stages=4)
    finally:
        smemguard.unregister_fallback(matmul_kernel)
    assert not ran
    assert records(incident_log)[-1]["internal_steps"] == ["bind the fallback's arguments"]


def test_an_unexpected_error_anywhere_in_handling_still_raises_the_users_error(install_guard, incident_log,
                                                                               triton_cache, monkeypatch):
    a, b, c = aligned_operands()
    install_guard()
    monkeypatch.setattr(recovery, "_decide", failing_once(recovery._decide))
    with fake_gpu("L4", max_shared=40000, cache_dir=triton_cache), pytest.raises(OutOfResources) as caught:
        matmul_kernel[(4, 4)](*matmul_args(a, b, c), BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_stages=4)
    assert caught.value.required == 49152 and caught.value.__context__ is None
    assert records(incident_log)[-1]["internal_steps"] == ["handle the failure"]


def test_a_step_block_counts_our_error_once_and_lets_interrupts_through():
    from smemguard.engine.steps import StepFailed, Steps

    steps = Steps("a kernel")
    with steps.skippable("save work"):
        raise KeyError("smemguard bug (planted by the test)")
    with pytest.raises(StepFailed) as failed, steps.skippable("outer"), steps.required("inner"):
        raise KeyError("smemguard bug (planted by the test)")
    assert failed.value.step == "inner" and failed.value.__suppress_context__
    assert steps.failed == ["save work", "inner"], "the inner failure is noted once, not again by the outer block"
    with pytest.raises(KeyboardInterrupt), steps.required("interrupted"):
        raise KeyboardInterrupt
    assert steps.failed == ["save work", "inner"], "an interrupt is not smemguard's bug"


def test_a_declared_wrapper_recovers_in_the_process_when_the_stored_tiles_cannot_be_read(
        install_guard, incident_log, tmp_path, triton_cache, monkeypatch):
    """Reading the decision cache's tiles fails (smemguard's bug, or a cache it cannot read): the declared wrapper still
    runs again with a halved tile, as with no cache, and learns it for the process."""
    from smemguard.engine import wrapper_outcomes
    from test_wrapper_tiles import LIMIT, matmul, operands

    install_guard(cache_dir=tmp_path / "decisions")
    monkeypatch.setattr(wrapper_outcomes, "stored_tiles", always_failing(wrapper_outcomes.stored_tiles))
    with fake_gpu("L4", max_shared=LIMIT, cache_dir=triton_cache) as gpu:
        assert matmul(*operands()) == 64
        assert [launch.shared for launch in gpu.launches] == [24576], "one launch, at the halved tile"
        assert matmul(*operands()) == 64 and len(gpu.launches) == 2, "the next call chooses it at once"
    assert [record["action"] for record in records(incident_log)] == ["tiles_reduced"]
