"""Every patch module keeps one contract: declared data, idempotent patch, exact unpatch, an
``is_patched`` read from the target; checked in a fresh process per module, over stand-ins of the
libraries (which shadow installed ones: the libraries' own behaviour is tested in their test files)."""

import importlib
import json
import textwrap
from pathlib import Path

import pytest

from smemguard import patches
from smemguard.facts.versions import Supported, parse

from conftest import run_python

# A kernel body that sizes its blocks with its tiles and masks every access they index: what the packs' safety
# arguments read of the libraries' kernels (patches.Kernels).
_TILED = """
    offs = tl.arange(0, {m})[:, None] * {n} + tl.arange(0, {n})[None, :]
    tl.store({ptr} + offs, tl.load({ptr} + offs, mask=offs < 1), mask=offs < 1)
"""


def _tiled(m: str, n: str, ptr: str) -> str:
    return _TILED.format(m=m, n=n, ptr=ptr).strip("\n")


# Packages with the module paths and parameters each library patch reads (not the libraries' code).
STAND_INS = {
    "vllm/__init__.py": "__version__ = '0.33.0'\n",
    "vllm/model_executor/__init__.py": "",
    "vllm/model_executor/determinism/__init__.py": "",
    "vllm/model_executor/determinism/batch_invariant.py":
        "from kernels import vllm_style_persistent_matmul as matmul_kernel_persistent\n",
    "vllm/utils/__init__.py": "",
    "vllm/utils/mem_utils.py": textwrap.dedent("""
        import functools

        @functools.cache
        def get_max_shared_memory_bytes(gpu=0):
            return 232448
        """),
    "vllm/utils/deep_gemm.py":
        "def get_paged_mqa_logits_metadata(context_lens, block_size, num_sms, indices=None):\n    return None\n",
    "vllm/v1/__init__.py": "",
    "vllm/v1/attention/__init__.py": "",
    "vllm/v1/attention/ops/__init__.py": "",
    "vllm/v1/attention/ops/triton_unified_attention.py": textwrap.dedent("""
        import triton
        import triton.language as tl

        @triton.jit
        def kernel_unified_attention(output_ptr, query_ptr, TILE_SIZE: triton.language.constexpr,
                                     HEAD_SIZE: triton.language.constexpr, SLIDING_WINDOW: triton.language.constexpr,
                                     IS_3D: triton.language.constexpr):
        """) + _tiled("TILE_SIZE", "HEAD_SIZE", "query_ptr") + textwrap.dedent("""

        def _get_tile_size(head_size, sliding_window, element_size, is_prefill):
            return 32

        def unified_attention(q, k, v, out, *args, **kwargs):
            pass
        """),
    "vllm/v1/attention/ops/triton_prefill_attention.py": textwrap.dedent("""
        import triton
        import triton.language as tl

        @triton.jit
        def _fwd_kernel(Q, Out, BLOCK_M: triton.language.constexpr, BLOCK_N: triton.language.constexpr,
                        Lk: triton.language.constexpr):
        """) + _tiled("BLOCK_M", "BLOCK_N", "Q") + textwrap.dedent("""

        def get_block_size(dtype):
            return 64

        def context_attention_fwd(q, k, v, o, *args, **kwargs):
            BLOCK = get_block_size(q.dtype)
            return BLOCK, _fwd_kernel
        """),
    "vllm/v1/attention/backends/__init__.py": "",
    "vllm/v1/attention/backends/triton_attn.py":
        "from vllm.v1.attention.ops.triton_unified_attention import unified_attention\n"
        "from vllm.v1.attention.ops.triton_prefill_attention import context_attention_fwd\n",
    "vllm/v1/attention/ops/prefix_prefill.py": textwrap.dedent("""
        import triton
        import triton.language as tl

        @triton.jit
        def _fwd_kernel(Q, Out, BLOCK_M: triton.language.constexpr, BLOCK_N: triton.language.constexpr,
                        BLOCK_SIZE: triton.language.constexpr):
        """) + _tiled("BLOCK_M", "BLOCK_N", "Q"),
    "sglang/__init__.py": "__version__ = '0.5.23'\n",
    "sglang/kernels/__init__.py": "",
    "sglang/kernels/ops/__init__.py": "",
    "sglang/kernels/ops/attention/__init__.py": "",
    "sglang/kernels/ops/attention/extend_attention.py": textwrap.dedent("""
        import triton
        import triton.language as tl
        from triton.language import constexpr

        @triton.jit
        def _fwd_kernel(Q, qo_indptr, kv_indptr, IS_CAUSAL: constexpr, SLIDING_WINDOW_SIZE: constexpr,
                        USE_CUSTOM_MASK: constexpr, BLOCK_M: constexpr, BLOCK_N: constexpr):
        """) + _tiled("BLOCK_M", "BLOCK_N", "Q") + textwrap.dedent("""

        @triton.jit
        def _fwd_kernel_unified(Q, qo_indptr, kv_indptr, IS_CAUSAL: constexpr, SLIDING_WINDOW_SIZE: constexpr,
                                USE_CUSTOM_MASK: constexpr, BLOCK_M: constexpr, BLOCK_N: constexpr):
        """) + _tiled("BLOCK_M", "BLOCK_N", "Q") + textwrap.dedent("""

        def _get_block_sizes_for_extend_attention(Lq, Lv):
            return 512, 64, 512, 32, 64, 8

        def extend_attention_fwd(q, *args, **kwargs):
            BLOCK_M = _get_block_sizes_for_extend_attention(q.shape[-1], q.shape[-1])[3]
            return BLOCK_M

        def extend_attention_fwd_unified(q, *args, **kwargs):
            BLOCK_M = _get_block_sizes_for_extend_attention(q.shape[-1], q.shape[-1])[3]
            return BLOCK_M
        """),
    "sglang/kernels/ops/attention/prefill_attention.py": textwrap.dedent("""
        import triton
        import triton.language as tl
        from triton.language import constexpr

        @triton.jit
        def _fwd_kernel(Q, Out, B_Start_Loc, B_Seqlen, IS_CAUSAL: constexpr, BLOCK_M: constexpr, BLOCK_N: constexpr,
                        Lk: constexpr):
        """) + _tiled("BLOCK_M", "BLOCK_N", "Q") + textwrap.dedent("""

        def context_attention_fwd(q, k, v, o, *args, **kwargs):
            BLOCK = 128
            return BLOCK, _fwd_kernel
        """),
    "flag_gems/__init__.py": "__version__ = '5.0.2'\n",
    "flag_gems/utils/__init__.py": "",
    "flag_gems/utils/libentry.py": textwrap.dedent("""
        from triton.runtime.autotuner import Autotuner

        class LibTuner(Autotuner):
            def get_key(self, args):
                return tuple(args.values())

            def run(self, *args, **kwargs):
                return Autotuner.run(self, *args, **kwargs)

        class LibEntry:
            def __init__(self, fn):
                self.fn = fn

            def run(self, *args, **kwargs):
                return self.fn.run(*args, **kwargs)
        """),
    "lmdeploy/__init__.py": "__version__ = '0.18.0'\n",
    "lmdeploy/pytorch/__init__.py": "",
    "lmdeploy/pytorch/kernels/__init__.py": "",
    "lmdeploy/pytorch/kernels/cuda/__init__.py": "",
    "lmdeploy/pytorch/kernels/cuda/flashattention.py": textwrap.dedent("""
        import triton
        from triton.language import constexpr

        import triton.language as tl

        @triton.jit
        def _flash_prefill_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, causal: constexpr, window_size: constexpr,
                                      shared_kv: constexpr, BLOCK_M: constexpr, BLOCK_N: constexpr,
                                      BLOCK_DK: constexpr, BLOCK_DK1: constexpr, BLOCK_DV: constexpr):
        """) + _tiled("BLOCK_M", "BLOCK_N", "q_ptr"),
    "flag_gems/ops/__init__.py": "",
    "flag_gems/ops/mm.py": "from kernels import matmul_kernel as mm_kernel_general\n",
}

STEPS = ["patch", "patch", "unpatch", "unpatch", "patch", "unpatch", "patch", "patch", "unpatch"]


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    root = tmp_path_factory.mktemp("stand-ins")
    for relative, text in STAND_INS.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_registry_lists_every_patch_module_once():
    import pkgutil

    found_here = {info.name: info.ispkg for info in pkgutil.iter_modules(patches.__path__)}
    folders = sorted(name for name, folder in found_here.items() if folder)
    assert folders == ["contrib", "torch_seams", "triton_seams"] and set(found_here) - set(folders) == {"layers"}, \
        "patches/ holds the contract, the layer mechanism and the folders of patch modules"
    found = {f"{folder}.{info.name}" for folder in folders
             for info in pkgutil.iter_modules([str(Path(patches.__file__).parent / folder)])
             if not info.name.startswith("_")}
    assert sorted(patches.MODULES) == sorted(found) and len(set(patches.NAMES)) == len(patches.MODULES)


@pytest.mark.parametrize("name", patches.MODULES)
def test_the_module_declares_the_contract(name):
    module_path, name = name, name.rpartition(".")[2]
    module = importlib.import_module(f"smemguard.patches.{module_path}")
    patch = module.PATCH
    assert isinstance(patch, patches.Patch) and patch.name == name
    assert isinstance(patch.target, str) and patch.target.count(".") >= 2
    assert patch.modules and all(isinstance(target, str) for target in patch.modules)
    assert isinstance(patch.supported, Supported) and patch.supported.low <= patch.supported.newest
    assert isinstance(patch.observe_safe, bool)
    # The releases read are data: the newest checked is the newest the range admits as verified, the oldest is
    # at or above its low bound.
    releases = [parse(version) for version in patch.checked]
    assert releases and None not in releases and releases == sorted(releases), patch.checked
    assert releases[-1] == patch.supported.newest and releases[0] >= patch.supported.low, patch.checked
    assert "Checked against" not in module.__doc__, "the versions read are PATCH.checked, not docstring text"
    assert "Why" in module.__doc__ or "What" in module.__doc__


#: Modules that register with the engine (fallbacks, alternatives, tuner descriptions) and layer nothing.
REGISTERS_ONLY = ("flaggems", "vllm_batch_invariant", "vllm_prefix_prefill", "lmdeploy_flash_attention")
#: Modules whose target is a setting (a value): nothing, theirs or another tool's, can layer over it.
SETTINGS = ("inductor_cache_key",)


@pytest.mark.parametrize("name", patches.MODULES)
def test_patch_unpatch_permutations_leave_the_target_as_it_was(name, stand_ins):
    module_path, name = name, name.rpartition(".")[2]
    import triton

    patch = importlib.import_module(f"smemguard.patches.{module_path}").PATCH
    if patch.supported.package == "triton" and not patch.supported.admits(triton.__version__):
        pytest.skip(f"{name} needs Triton {patch.supported}; the installer does not apply it to {triton.__version__}")
    result = run_python(f"""
        import importlib, json, sys
        sys.path.insert(0, {str(stand_ins)!r})
        import triton
        from smemguard.engine.core import Engine
        import smemguard.patches.{module_path} as module
        from smemguard.facts.settings import Settings

        patch = module.PATCH

        for target in patch.modules:
            try:
                importlib.import_module(target)
            except ImportError:
                pass

        # A target that moved between releases is named once per release (TARGETS, a pack's targets, one per home):
        # the one imported here.
        TARGET = next((name for name in getattr(module, "TARGETS", ()) if name.rsplit(".", 2)[0] in sys.modules),
                      next((name for name, home in zip(patch.targets, patch.modules) if home in sys.modules),
                           patch.target))

        def target_object():
            path = TARGET.split(".")
            for split in range(len(path) - 1, 0, -1):
                try:
                    owner = importlib.import_module(".".join(path[:split]))
                except ImportError:
                    continue
                for attribute in path[split:-1]:
                    owner = getattr(owner, attribute)
                return owner.__dict__.get(path[-1]) if isinstance(owner, type) else getattr(owner, path[-1])

        engine = Engine(Settings(max_shared=65536))
        before = target_object()
        seen = []
        for step in {STEPS!r}:
            patch.patch(engine) if step == "patch" else patch.unpatch()
            seen.append(patch.is_patched())
        print(json.dumps({{"seen": seen, "restored": target_object() is before,
                          "changed_when_patched": None}}))
        patch.patch(engine)
        changed = target_object() is not before
        patch.unpatch()
        print(json.dumps({{"changed_when_patched": changed, "restored_again": target_object() is before}}))
    """)
    first, second = (json.loads(line) for line in result.stdout.splitlines()[-2:])
    assert first["seen"] == [step == "patch" for step in STEPS], "is_patched must follow patch/unpatch exactly"
    assert first["restored"] and second["restored_again"], f"{name} did not leave {patch.target} as it was"
    # A patch that wraps its target replaces the object; one that describes a library (FlagGems' tuner,
    # fallbacks of vLLM kernels) leaves it and registers with the engine instead.
    assert second["changed_when_patched"] is (name not in REGISTERS_ONLY)


# How each module's target is reached, so that a layer another tool put there can be seen being called.
# The Triton targets all run in one small autotuned launch on the CPU harness (a new size each time, so that
# Triton compiles and tunes again) and one warm-up; the vLLM wrappers are called with stand-in arguments.
_TRITON_EXERCISE = """
    import torch
    from kernels import autotuned, config, matmul_args, tiled_grid
    from smemguard.testing import fake_gpu

    def exercise(round_):
        size = 16 * (round_ + 1)
        a, b, c = (torch.empty(size, size, dtype=torch.float16) for _ in range(3))
        tuned = autotuned([config(16, 16, 16, 1), config(16, 16, 32, 1)])
        with fake_gpu("L4", cache_dir=CACHE):
            tuned[tiled_grid(size, size)](*matmul_args(a, b, c))
            tuned.fn.warmup(*matmul_args(a, b, c), BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, grid=(1,))
"""
_SHAPE = "type('Tensor', (), {'shape': (1, 64), 'dtype': None})()"
EXERCISE = {
    **{name: _TRITON_EXERCISE for name in ("max_shared_mem", "autotuner_bench", "jit_compile", "kernel_interface",
                                           "kernel_warmup")},
    "deepgemm_metadata": """
        def exercise(round_):
            import vllm.utils.deep_gemm as module
            module.get_paged_mqa_logits_metadata(None, 64, 132)
    """,
    "torch_device_properties": """
        import torch
        from smemguard.testing import fake_gpu

        def exercise(round_):
            with fake_gpu("L4", cache_dir=CACHE, torch_device=True):
                torch.cuda.get_device_properties(0)
    """,
    "vllm_shared_memory": """
        def exercise(round_):
            import vllm.utils.mem_utils as module
            module.get_max_shared_memory_bytes()
    """,
    "vllm_unified_attention": """
        def exercise(round_):
            import vllm.v1.attention.backends.triton_attn as backend
            backend.unified_attention(None, None, None, None)
    """,
    "inductor_launchers": """
        import pytest
        from inductor_kernels import inductor_gpu, template_matmul

        def exercise(round_):
            with inductor_gpu(pytest.MonkeyPatch(), "L4", cache_dir=CACHE):
                template_matmul("L4", num_stages=2 + round_).precompile()
    """,
    "inductor_autotune": """
        import os, tempfile
        import pytest
        from torch._inductor.autotune_process import TritonBenchmarkRequest
        from inductor_kernels import inductor_gpu
        MODULE = os.path.join(tempfile.mkdtemp(), "choice.py")
        with open(MODULE, "w") as out:
            out.write("from inductor_kernels import template_matmul\\nkernel = template_matmul('L4', num_stages=2)\\n")

        def exercise(round_):
            request = object.__new__(TritonBenchmarkRequest)  # a choice max-autotune precompiles
            request.__dict__.update(module_cache_key=f"choice{round_}", module_path=MODULE, kernel_name="kernel",
                                    input_tensor_meta=[], output_tensor_meta=None, _benchmark_module=None)
            with inductor_gpu(pytest.MonkeyPatch(), "L4", cache_dir=CACHE):
                request.precompile()
    """,
    "inductor_flex_configs": """
        import torch
        from smemguard.testing import fake_gpu
        torch.cuda.get_device_capability = lambda device=None: (8, 9)

        def exercise(round_):
            from torch._inductor.template_heuristics.triton import CUDAConfigHeuristic
            with fake_gpu("L4", cache_dir=CACHE):
                heuristic = CUDAConfigHeuristic().get_flex_attn_fwd_configs
                extra = {"seq_len": 1024} if "seq_len" in __import__("inspect").signature(heuristic).parameters else {}
                heuristic(head_dim=64, dtype=torch.float16, **extra)  # torch 2.14 added seq_len before dtype
    """,
    "inductor_static_launcher": """
        def exercise(round_):
            from torch._inductor.runtime.static_triton_launcher import StaticallyLaunchedCudaKernel
            loaded = StaticallyLaunchedCudaKernel.__new__(StaticallyLaunchedCudaKernel)
            loaded.function, loaded.shared, loaded.name = object(), 0, "loaded"
            loaded.device_agnostic = False  # torch 2.14's per-device path, off as Inductor leaves it by default
            loaded.load_kernel(0)  # loaded already: Inductor's loader returns at once
    """,
    "sglang_extend_attention": f"""
        def exercise(round_):
            import sglang.kernels.ops.attention.extend_attention as module
            module.extend_attention_fwd({_SHAPE})
    """,
    "sglang_prefill_attention": f"""
        def exercise(round_):
            import sglang.kernels.ops.attention.prefill_attention as module
            module.context_attention_fwd({_SHAPE}, None, None, None)
    """,
    "vllm_prefill_attention": f"""
        def exercise(round_):
            import vllm.v1.attention.backends.triton_attn as backend
            backend.context_attention_fwd({_SHAPE}, {_SHAPE}, None, None)
    """,
}


@pytest.mark.parametrize("name", patches.MODULES)
def test_another_tools_layers_above_and_below_survive_and_are_called(name, stand_ins, triton_cache):
    """Another tool (OpenTelemetry, ddtrace) wraps the target with wrapt before install and again after it:
    uninstall and re-install keep both of its layers in place, and they keep being called."""
    module_path, name = name, name.rpartition(".")[2]
    import triton

    patch = importlib.import_module(f"smemguard.patches.{module_path}").PATCH
    if patch.supported.package == "triton" and not patch.supported.admits(triton.__version__):
        pytest.skip(f"{name} needs Triton {patch.supported}; the installer does not apply it to {triton.__version__}")
    if name in SETTINGS:
        pytest.skip(f"{patch.target} is a setting, not a function: no tool layers over it (see test_inductor)")
    exercise = textwrap.dedent(EXERCISE.get(name, "def exercise(round_):\n    pass\n"))
    result = run_python(f"""
        import importlib, json, sys
        sys.path.insert(0, {str(stand_ins)!r})
        import triton, wrapt
        from smemguard.engine.core import Engine
        import smemguard.patches.{module_path} as module
        from smemguard.facts.settings import Settings

        patch = module.PATCH

        CACHE = {triton_cache!r}
        for target in patch.modules:
            try:
                importlib.import_module(target)
            except ImportError:
                pass

        # A target that moved between releases is named once per release (TARGETS, a pack's targets, one per home):
        # the one imported here.
        TARGET = next((name for name in getattr(module, "TARGETS", ()) if name.rsplit(".", 2)[0] in sys.modules),
                      next((name for name, home in zip(patch.targets, patch.modules) if home in sys.modules),
                           patch.target))

        def owner_and_path():
            path = TARGET.split(".")
            for split in range(len(path) - 1, 0, -1):
                if ".".join(path[:split]) in sys.modules:
                    return ".".join(path[:split]), ".".join(path[split:])

        def chain():
            owner_name, path = owner_and_path()
            owner = sys.modules[owner_name]
            *parents, attr = path.split(".")
            for parent in parents:
                owner = getattr(owner, parent)
            layer = (next((vars(cls)[attr] for cls in owner.__mro__ if attr in vars(cls)), None)
                     if isinstance(owner, type) else getattr(owner, attr))
            found = []
            while layer is not None:
                found.append(layer)
                layer = getattr(layer, "__wrapped__", None)
            return found

        calls = {{"below": 0, "above": 0}}

        def counting(where):
            def wrapper(wrapped, instance, args, kwargs):
                calls[where] += 1
                return wrapped(*args, **kwargs)
            return wrapper

{textwrap.indent(exercise, " " * 8)}
        engine = Engine(Settings(max_shared=65536))
        original, base = chain()[-1], len(chain())
        wrapt.wrap_function_wrapper(*owner_and_path(), counting("below"))
        below = chain()[0]
        patch.patch(engine)
        patched = patch.is_patched()
        wrapt.wrap_function_wrapper(*owner_and_path(), counting("above"))
        above = chain()[0]
        steps = []
        for step in ("unpatch", "patch", "unpatch"):
            patch.patch(engine) if step == "patch" else patch.unpatch()
            layers = chain()
            exercise(len(steps))
            steps.append({{"step": step, "is_patched": patch.is_patched(), "above_kept": above in layers,
                          "below_kept": below in layers, "original_last": layers[-1] is original,
                          "layers": len(layers) - base, "calls": dict(calls)}})
        print(json.dumps({{"patched": patched, "steps": steps}}))
    """)
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen["patched"], f"{name} did not patch under another tool's layer"
    for step in seen["steps"]:
        assert step["is_patched"] is (step["step"] == "patch"), f"is_patched must read the target: {step}"
        assert step["above_kept"] and step["below_kept"] and step["original_last"], f"a foreign layer was lost: {step}"
        own = 1 if step["step"] == "patch" and name not in REGISTERS_ONLY else 0
        assert step["layers"] == 2 + own, \
            f"exactly the two foreign layers over the target, and ours when patched: {step}"
    if name in EXERCISE:
        counts = [step["calls"] for step in seen["steps"]]
        assert all(later["below"] > earlier["below"] and later["above"] > earlier["above"]
                   for earlier, later in zip([{"below": 0, "above": 0}, *counts], counts)), \
            f"the other tool's layers must be called after every step: {counts}"
