"""A variant the decision cache holds a config switch for is refused before it is compiled (Triton 3.5 and
later, ``JITFunction._do_compile``): the launch guard switches the tuner to the stored config, the autotuner's
benchmark counts the variant as failing, and anything that cannot use the switch gets the variant compiled as
asked. Stand-in GPU: 30000 B on sm_89, where 128x128x64 fp16 at 3 stages overflows and 64x64x64 at 2 fits."""

import logging
import pickle

import pytest
import torch
import triton
from triton import knobs
from triton.runtime.errors import OutOfResources

import smemguard
from smemguard.engine import recall
from smemguard.patches.triton_seams import jit_compile
from smemguard.testing import fake_gpu

from conftest import records
from kernels import autotuned, config, matmul_args, matmul_kernel, tiled_grid

pytestmark = pytest.mark.skipif(not jit_compile.PATCH.supported.admits(triton.__version__),
                                reason="Triton 3.4 compiles inline in run(): no compile-time refusal there")

BIG, SMALL = config(128, 128, 64, 3), config(64, 64, 64, 4)
KEY = (256, 256, 256, "torch.float16", "torch.float16", "torch.float16")


def operands():
    return tuple(torch.empty(256, 256, dtype=torch.float16) for _ in range(3))


def tuned_elsewhere(configs):
    """An autotuner over ``configs`` whose choice for the 256^3 key, the first config, was made on a bigger GPU."""
    tuned = autotuned(configs)
    tuned.cache[KEY] = configs[0]
    return tuned


class Compiles:
    """(BLOCK_M, num_stages) of every variant Triton's JIT compiles (its own hook, on each JIT cache miss)."""

    def __enter__(self):
        self.seen = []
        block_m = (matmul_kernel.arg_names.index("BLOCK_M"),)
        knobs.runtime.jit_cache_hook = lambda **kw: self.seen.append(
            (kw["compile"]["constants"].get(block_m), kw["compile"]["num_stages"])) and False
        return self

    def __exit__(self, *exc):
        knobs.runtime.jit_cache_hook = None


@pytest.fixture
def stored(install_guard, tmp_path, triton_cache):
    """Install with a decision cache in which this process learned, on the stand-in, that BIG switches to
    SMALL at 2 stages; the stand-in session ends, so its compiled kernels are gone."""
    install_guard(cache_dir=tmp_path / "cache")
    with fake_gpu("L4", max_shared=30000, cache_dir=triton_cache):
        tuned_elsewhere([BIG, SMALL])[tiled_grid(256, 256)](*matmul_args(*operands()))
    [learned] = records(tmp_path / "incidents.jsonl")
    assert learned["action"] == "config_changed" and learned["remembered"] is False
    (tmp_path / "incidents.jsonl").unlink()
    return tmp_path / "incidents.jsonl"


def test_the_switch_compiles_only_the_stored_config(stored, triton_cache):
    with fake_gpu("L4", max_shared=30000, cache_dir=triton_cache) as gpu, Compiles() as compiles:
        tuned_elsewhere([BIG, SMALL])[tiled_grid(256, 256)](*matmul_args(*operands()))
    assert compiles.seen == [(64, 2)], "the config in force never compiled"
    assert (gpu.launches[-1].num_stages, gpu.launches[-1].shared) == (2, 16384)
    assert records(stored) == [], "decided before: no incident"


def test_the_autotuners_benchmark_counts_the_stored_variant_as_failing_uncompiled(stored, triton_cache):
    with fake_gpu("L4", max_shared=30000, cache_dir=triton_cache) as gpu, Compiles() as compiles:
        autotuned([BIG, SMALL])[tiled_grid(256, 256)](*matmul_args(*operands()))
    # BIG refused in the benchmark and at the launch; SMALL at 4 stages benchmarked (it fails too), then the
    # stored switch compiled
    assert compiles.seen == [(64, 4), (64, 2)]
    assert gpu.launches[-1].shared <= 30000 and records(stored) == []


def test_a_launch_outside_the_guard_gets_tritons_error_with_a_note(stored, triton_cache):
    """``kernel.run(..., warmup=False)`` bypasses ``kernel[grid]``: the error is the one the variant's launch
    raises, with a note saying why it came before compiling; it pickles as Triton's own."""
    a, b, c = operands()
    with fake_gpu("L4", max_shared=30000, cache_dir=triton_cache), Compiles() as compiles:
        with pytest.raises(OutOfResources) as raised:
            matmul_kernel.run(*matmul_args(a, b, c), grid=tiled_grid(256, 256), warmup=False,
                              **BIG.all_kwargs())
        assert compiles.seen == []
        error = raised.value
        assert (error.required, error.limit, error.name) == (65536, 30000, "shared memory")
        assert "refused before compiling" in "\n".join(error.__notes__)
        assert type(pickle.loads(pickle.dumps(error))) is OutOfResources
        # a warm-up compiles what it is asked for: its launch would decide
        matmul_kernel.run(*matmul_args(a, b, c), grid=tiled_grid(256, 256), warmup=True, **BIG.all_kwargs())
        assert compiles.seen == [(128, 3)]


def test_a_switch_this_launch_does_not_allow_compiles_the_variant_and_recovers_it(stored, triton_cache, caplog):
    """Another tuner of the same kernel without the stored config: the variant is compiled as asked, fails,
    and the ladder decides among this tuner's own configs (the stored entry ignored with a warning)."""
    other = config(32, 32, 32, 2)
    with fake_gpu("L4", max_shared=30000, cache_dir=triton_cache) as gpu, Compiles() as compiles, \
            caplog.at_level(logging.WARNING, logger="smemguard"):
        tuned_elsewhere([BIG, other])[tiled_grid(256, 256)](*matmul_args(*operands()))
    [record] = records(stored)
    assert record["remembered"] is False and record["action"] == "config_changed" and "BLOCK_M=32" in record["final"]
    assert compiles.seen[0] == (128, 3), "compiled as asked once the switch did not apply"
    assert gpu.launches[-1].shared <= 30000
    assert "not one of the kernel's own" in caplog.text


def test_an_internal_error_applying_the_switch_leaves_the_launch_recovered(stored, triton_cache, monkeypatch):
    def broken(*args):
        raise RuntimeError("a bug in smemguard")

    monkeypatch.setattr(recall, "switch", broken)
    with fake_gpu("L4", max_shared=30000, cache_dir=triton_cache) as gpu:
        tuned_elsewhere([BIG, SMALL])[tiled_grid(256, 256)](*matmul_args(*operands()))
    [record] = records(stored)
    assert record["action"] == "config_changed" and gpu.launches[-1].shared <= 30000


def test_uninstalled_nothing_is_refused(stored, triton_cache):
    smemguard.uninstall()
    with fake_gpu("L4", max_shared=30000, cache_dir=triton_cache), Compiles() as compiles:
        with pytest.raises(OutOfResources):
            tuned_elsewhere([BIG, SMALL])[tiled_grid(256, 256)](*matmul_args(*operands()))
    assert compiles.seen == [(128, 3)]
