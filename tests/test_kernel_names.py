"""A kernel a library built from a template, as triton_kernels 3.6 builds every kernel (``specialize.define_kernel``:
a template function's code under new globals, renamed, its source replaced with ``JITFunction._unsafe_update_src``):
its records and decisions name it by the name the library gave it, not the template's qualname
``define_kernel.<locals>._empty_fn`` (seen in triton_kernels' records on the H200, 2026-12-04), and its loops are
read from the source Triton compiles, not from the template's lines (which read as "no loop to pipeline" and left a
kernel that fewer stages fit unrecovered: found by this test)."""

import inspect
import textwrap
import types

import torch
import triton

from smemguard import examples
from smemguard.kernels import introspect
from smemguard.testing import fake_gpu

from conftest import records


def built_from_a_template(source_of, module_name: str) -> triton.JITFunction:
    """A JIT function made as triton_kernels 3.6 makes its kernels: a template function's code object under new
    globals, renamed, its source replaced."""
    def _empty_fn():
        pass

    source = textwrap.dedent(inspect.getsource(source_of))
    source = source[source.find("def "):]
    name = source[4:].split("(")[0].strip()
    namespace = dict(vars(examples))
    exec(source, namespace)
    function = types.FunctionType(_empty_fn.__code__, namespace)
    function.__module__, function.__name__ = module_name, name
    function.__signature__ = inspect.signature(namespace[name])
    jit = triton.JITFunction(function)
    jit._unsafe_update_src(source)
    return jit


def test_a_kernel_renamed_once_made_is_named_by_its_name():
    jit = built_from_a_template(examples.matmul_kernel.fn, "matmul_ogsdflt_dflt")
    assert jit.fn.__qualname__.endswith("<locals>._empty_fn"), "the template's qualname, as in triton_kernels"
    assert introspect.kernel_name(jit) == "matmul_ogsdflt_dflt:matmul_kernel"
    assert introspect.kernel_name(examples.matmul_kernel) == "smemguard.examples:matmul_kernel"
    assert introspect.kernel_name(lambda: None).endswith(":test_a_kernel_renamed_once_made_is_named_by_its_name."
                                                         "<locals>.<lambda>")


def test_its_incident_record_names_it(install_guard, incident_log, tmp_path, triton_cache):
    install_guard(core=True, cache_dir=tmp_path / "decisions")
    jit = built_from_a_template(examples.matmul_kernel.fn, "matmul_ogsdflt_dflt")
    operands = [torch.empty(256, 256, dtype=torch.float16) for _ in range(3)]
    with fake_gpu("L4", max_shared=60000, cache_dir=triton_cache) as gpu:
        jit[(4, 4)](*examples.matmul_args(*operands), BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_stages=5)
    assert gpu.launches[-1].num_stages == 4
    [record] = records(incident_log)
    assert (record["kernel"], record["action"]) == ("matmul_ogsdflt_dflt:matmul_kernel", "stages_reduced")
