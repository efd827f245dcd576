"""What ``smemguard replay`` rebuilds from an incident record: the kernel (by the record's ``module:qualname``), its
arguments (fresh tensors of the recorded shapes, strides, dtypes and alignment; or, for a compile no launch caused,
stand-ins Triton specializes the same way as what the compile was given), and the configs to compile.

Every value comes from an untrusted file: each is bounded before anything is built (:data:`TENSOR`, the extents and
bytes below), and what cannot be rebuilt is one line saying why.
"""

from __future__ import annotations

import importlib

from ..facts import untrusted
from ..facts.untrusted import OBJECT, SCALAR, Expect, integer, printable, shown
from ..kernels import introspect


class ReplayError(Exception):
    """The record cannot be replayed here; the message says why and what to do."""


def kernel_name(value) -> bool:
    """``module:qualname``, or Inductor's name of a torch.compile kernel (an identifier)."""
    if isinstance(value, str) and value.isidentifier():
        return True
    module, _, qualname = value.partition(":") if isinstance(value, str) else ("", "", "")
    return all(part.isidentifier() for part in (*module.split("."), *qualname.split(".")))


def dtype_named(name: str):
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) else None


def bounded(most: int, least: int = 0) -> Expect:
    return Expect(f"an integer from {least} to {most}", lambda value: integer(least).test(value) and value <= most)


def bounded_list(most: int, least: int = 0, lengths: range = range(0, 9)) -> Expect:
    each = bounded(most, least)
    return Expect(f"a list of {lengths.start} to {lengths.stop - 1} integers from {least} to {most}", lambda value: (
        isinstance(value, list) and len(value) in lengths and all(each.test(v) for v in value)))


#: Bounds of what a record may ask replay to build: sizes and strides of a tensor (2**40), the
#: bytes it spans (16 GiB), a grid (CUDA's 2**31 - 1), stages and warps (as a stored decision).
MAX_EXTENT = 2**40
MAX_TENSOR_BYTES = 16 * 2**30
MAX_GRID = 2**31 - 1
MAX_INT = 2**63 - 1
#: Where tensors are built when the launch is only compiled: the meta device keeps shapes, strides, dtypes and the
#: recorded alignment (the pointers Triton specializes on), with no memory behind them, so a record of three
#: 16 GiB tensors replays in the memory of a small one.
COMPILING = "meta"

TENSOR = {"shape": bounded_list(MAX_EXTENT), "stride": bounded_list(MAX_EXTENT),
          "dtype": Expect("a torch dtype such as torch.float16", lambda value: dtype_named(value) is not None
                          and itemsize(dtype_named(value)) is not None),
          "ptr_mod_16": Expect("an integer from 0 to 15", lambda value: integer(0).test(value) and value < 16)}
DESCRIPTOR = {"base": OBJECT, "shape": bounded_list(MAX_EXTENT), "strides": bounded_list(MAX_EXTENT),
              "block_shape": bounded_list(2**16, 1)}
#: A constexpr or scalar argument: a number (64-bit integers), true/false, text or null.
SCALAR_VALUE = Expect("a number (a 64-bit integer), true/false, text or null", lambda value: SCALAR.test(value) and (
    not isinstance(value, int) or -MAX_INT - 1 <= value <= MAX_INT))
#: A compile's specialization of one int or pointer parameter, as records write it.
SPECIALIZATIONS = ("div16", "==1", "")


def itemsize(dtype) -> int | None:
    """Bytes per element of a dtype Triton takes (None for complex and other dtypes it has no type for)."""
    import torch

    if dtype.is_complex or dtype in (torch.quint8, torch.qint8, torch.qint32, torch.quint4x2, torch.quint2x4):
        return None
    return torch.empty((), dtype=dtype).element_size()


def _span(spec: dict) -> int:
    """Elements from the first to the last one a tensor view reaches."""
    shape, stride = spec["shape"], spec["stride"]
    return 1 + sum((size - 1) * step for size, step in zip(shape, stride)) if all(shape) else 0


def _tensor_problems(spec: dict, where: str) -> list[str]:
    found = untrusted.problems(spec, TENSOR, prefix=where + ".")
    if found:
        return found
    if len(spec["shape"]) != len(spec["stride"]):
        return [f"{where!r} has {len(spec['shape'])} sizes and {len(spec['stride'])} strides"]
    size = itemsize(dtype_named(spec["dtype"]))
    if spec["ptr_mod_16"] % size:
        return [f"{where!r}: a {printable(spec['dtype'])} tensor cannot start {spec['ptr_mod_16']} bytes past a "
                "16-byte boundary"]
    if _span(spec) * size > MAX_TENSOR_BYTES:
        return [f"{where!r} spans more than {MAX_TENSOR_BYTES // 2**30} GiB"]
    return []


def argument_problems(name: str, value) -> list[str]:
    """One line per problem of the recorded argument ``name`` (none: it can be rebuilt)."""
    where = f"args.{name}"
    if isinstance(value, dict) and value.get("descriptor"):
        found = untrusted.problems(value, DESCRIPTOR, prefix=where + ".")
        return found or _tensor_problems(value["base"], where + ".base")
    if isinstance(value, dict):
        return _tensor_problems(value, where)
    if isinstance(value, str):
        return [f"{where!r} is {shown(value)}: the record kept this argument as text (smemguard records objects "
                "it cannot describe that way), and replay cannot rebuild it"]
    if not SCALAR.test(value):
        return [f"{where!r} is {shown(value)}, expected a tensor {{shape, stride, dtype, ptr_mod_16}}, a TMA "
                "descriptor or a number"]
    return []


def specialization_problems(record: dict) -> list[str]:
    """One line per parameter of a compile-only record that replay cannot give a stand-in for."""
    found = []
    for name, kind in record["signature"].items():
        if kind == "constexpr":
            if name not in record["constexprs"] and record["specialization"].get(name) != "==1":
                found.append(f"'signature.{printable(name)}' is a constant the record gives no value for")
            continue
        if stand_in_problem(kind) is not None:
            found.append(f"'signature.{printable(name)}' is {shown(kind)}: {stand_in_problem(kind)}")
        elif record["specialization"].get(name, "") not in SPECIALIZATIONS:
            found.append(f"'specialization.{printable(name)}' is {shown(record['specialization'][name])}, expected "
                         "\"div16\", \"==1\" or \"\"")
    return found


def import_kernel(record: dict):
    """The object the record's kernel names and the JIT function under it: ``module:qualname`` imported, or a
    torch.compile kernel (Inductor's kernel name) from the generated module the record names."""
    name = record["kernel"]
    if ":" not in name:
        obj = getattr(_generated_module(record), name, None)
        jit = introspect.jit_function(obj)
        if jit is None:
            raise ReplayError(f"the generated module the record names has no Triton kernel {name!r}")
        return obj, jit
    module_name, _, qualname = name.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except (Exception, SystemExit) as error:
        raise ReplayError(f"cannot import module {module_name!r} named by the record's kernel {name!r} "
                          f"({type(error).__name__}: {printable(str(error))}). Run replay where that module is "
                          "importable (same environment, PYTHONPATH).") from None
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ReplayError(f"module {module_name!r} has no {qualname!r} (the record's kernel {name!r})")
    jit = introspect.jit_function(obj)
    if jit is None:
        raise ReplayError(f"{name!r} is a {type(obj).__name__}, not a Triton kernel")
    return obj, jit


#: A generated kernel module larger than this is not loaded (Inductor's are kilobytes).
GENERATED_SOURCE_LIMIT = 4 * 2**20


def _generated_module(record: dict):
    """The module Inductor generated for the record's kernel, loaded from the file the record names while
    Inductor's cache still holds it unchanged: the bytes hashed are the bytes run, only from Inductor's own cache
    directory (as Inductor itself loads them), never from a file that another user owns or can write."""
    import hashlib
    import types
    from pathlib import Path

    from ..facts import files

    generated = record.get("inductor") or {}
    path, digest = generated.get("source_file"), generated.get("source_sha256")
    rerun = "run the compiled program again under the recorded limit (SMEMGUARD_MAX_SHARED)"
    if not path or not digest:
        raise ReplayError(f"the record names no generated source of the torch.compile kernel (inductor.source_file, "
                          f"written since smemguard 0.2): {rerun}")
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    root = Path(cache_dir()).resolve()
    try:
        resolved = Path(path).resolve(strict=True)
    except OSError:
        raise ReplayError(f"the generated source {printable(path)} is no longer in Inductor's cache ({root}): "
                          f"{rerun}") from None
    if root not in resolved.parents:
        raise ReplayError(f"{printable(path)} is not in Inductor's cache ({root}, TORCHINDUCTOR_CACHE_DIR): replay "
                          "loads a generated kernel only from there")
    try:
        files.check_trusted(resolved, resolved.parent)
        data = files.read_bytes(resolved, GENERATED_SOURCE_LIMIT)
    except OSError as error:
        raise ReplayError(f"cannot load the generated source: {printable(str(error))}") from None
    if hashlib.sha256(data).hexdigest() != digest:
        raise ReplayError(f"{printable(path)} changed since the record was written (its SHA-256 differs): Inductor "
                          f"generated another kernel there; {rerun}")
    module = types.ModuleType(f"smemguard_replay_{digest[:16]}")
    module.__file__ = str(resolved)
    try:
        exec(compile(data, str(resolved), "exec"), module.__dict__)  # noqa: S102 (the bytes just checked)
    except Exception as error:
        raise ReplayError(f"the generated module {printable(path)} does not load here ({type(error).__name__}: "
                          f"{printable(str(error).splitlines()[0] if str(error) else '')[:200]}); replay needs the "
                          "torch and Triton it was generated with") from None
    return module


def parameter_problems(jit, record: dict, given: set) -> list[str]:
    """The record's parameter names ``given`` against the kernel's (the kernel may have changed since)."""
    unknown = sorted(given - set(jit.arg_names))
    missing = [param.name for param in jit.params if param.name not in given and not param.has_default]
    found = []
    if unknown:
        found.append(f"the record names {', '.join(map(shown, unknown))}, which the kernel has no parameter for")
    if missing:
        found.append(f"the record has no value for the kernel's {', '.join(missing)}")
    if found:
        found.append("the kernel's source is not the one the record was written for (source_hash "
                     f"{shown(record.get('source_hash'))}); replay it where that version is installed")
    return found


def _tensor(spec: dict, device: str, generator):
    import torch

    dtype = dtype_named(spec["dtype"])
    size = itemsize(dtype)
    span = _span(spec)
    offset = spec["ptr_mod_16"] // size
    base = torch.empty(span + offset + 16, dtype=dtype, device=device)
    skip = (-base.data_ptr() % 16) // size  # start from a 16-byte boundary, then add the recorded offset
    if generator is None:  # compiling only: the values are never read
        pass
    elif dtype.is_floating_point:
        base.uniform_(-1, 1, generator=generator)
    else:
        base.random_(0, 8, generator=generator)
    return base.as_strided(spec["shape"], spec["stride"], skip + offset)


def _descriptor(spec: dict, device: str, generator):
    """A host TMA descriptor over a fresh base tensor, with the block shape it had at the failure."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        raise ReplayError("the record has a TMA tensor descriptor, and this Triton has no "
                          "triton.tools.tensor_descriptor") from None
    return TensorDescriptor(_tensor(spec["base"], device, generator), spec["shape"], spec["strides"],
                            spec["block_shape"])


def arguments(recorded: dict, constexprs: dict, device: str, seed: int | None = 0) -> dict:
    """Every kernel parameter by name: fresh tensors (and TMA descriptors over them) as ``recorded``, scalars,
    ``constexprs``. Tensors hold random values from ``seed`` (same seed, same values); None leaves them unset."""
    import torch

    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    named = {}
    for name, value in recorded.items():
        if isinstance(value, dict):
            rebuild = _descriptor if value.get("descriptor") else _tensor
            try:
                named[name] = rebuild(value, device, generator)
            except ReplayError:
                raise
            except Exception as error:  # too large to allocate, a descriptor Triton refuses
                raise ReplayError(f"cannot rebuild argument {name!r} ({type(error).__name__}: "
                                  f"{printable(str(error).splitlines()[0] if str(error) else '')[:200]})") from None
        else:
            named[name] = value
    named.update(constexprs)
    return named


# -- a compile no launch caused: stand-ins Triton specializes as it did ---------------------------------------


def _triton_dtypes() -> dict:
    """Triton's type of a tensor's elements (``fp16``) -> the torch dtype, from Triton's own table."""
    import torch
    from triton.runtime.jit import type_canonicalisation_dict

    return {triton_type: dtype for name, triton_type in type_canonicalisation_dict.items()
            if isinstance(dtype := getattr(torch, name, None), torch.dtype)}


def stand_in_problem(kind: str) -> str | None:
    """Why no stand-in argument can be made for Triton's signature type ``kind`` (None: one can)."""
    if not isinstance(kind, str):
        return "not a type replay knows"
    if kind.startswith("*"):
        return None if kind[1:] in _triton_dtypes() else "a pointer to elements replay has no torch dtype for"
    if kind in ("i1", "fp16", "bf16", "fp32", "fp64") or kind[:1] in ("i", "u") and kind[1:].isdigit():
        return None
    return "a parameter type replay cannot make a stand-in for (a tuple, a tensor descriptor): record it at a launch"


def stand_ins(record: dict) -> dict:
    """The arguments of a compile-only record as a launch record keeps them: a 16-element tensor of the element
    type for each pointer (aligned or not as specialized), and per int the smallest value Triton specializes the
    same way (1, 16, or 17; past 2**31 for a 64-bit int). Nothing executes: only the compiled variant matters."""
    dtypes, recorded = _triton_dtypes(), {}
    for name, kind in record["signature"].items():
        spec = record["specialization"].get(name, "")
        if kind == "constexpr":
            if name not in record["constexprs"]:
                recorded[name] = 1  # an int equal to 1, folded into the kernel by Triton
        elif kind.startswith("*"):
            dtype = dtypes[kind[1:]]
            recorded[name] = {"shape": [16], "stride": [1], "dtype": str(dtype),
                              "ptr_mod_16": 0 if spec == "div16" else itemsize(dtype)}
        elif kind == "i1":
            recorded[name] = True
        elif kind[:1] in ("i", "u"):
            base = 2**32 if kind.endswith("64") else 0
            recorded[name] = 1 if spec == "==1" else base + (16 if spec == "div16" else 17)
        else:
            recorded[name] = 1.5
    return recorded


# -- the config a decision chose ---------------------------------------------------------------------------


def chosen_settings(final: str | None) -> dict | None:
    """The ``name=value`` settings of a record's ``final`` (``BLOCK_M=64 BLOCK_N=32 num_warps=4 num_stages=2``,
    ``num_stages=4, NUM_STAGES=2``), integers as integers; None when it names none (a fallback's name)."""
    if not isinstance(final, str):
        return None
    settings = {}
    for token in final.replace(",", " ").split():
        name, equals, value = token.partition("=")
        if not equals or not name.isidentifier():
            return None
        settings[name] = int(value) if value.lstrip("-").isdigit() and len(value) < 20 else value
    return settings or None
