"""Finding kernels: the Triton kernels a target names, their configs, argument types and
specializations, and the same JIT function again in a worker process."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import importlib.util
import logging
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

from ..kernels import introspect
from . import source
from .model import (
    ALIGNED,
    BY_LAYOUT,
    BY_ORDER,
    INT_TYPES,
    MISALIGNED,
    NON_UNIT,
    CheckedKernel,
    Specialization,
    TargetError,
    Variant,
)

log = logging.getLogger(__name__)

#: What a module's ``SMEMGUARD_PREFLIGHT`` entry (or the command line) can say about a kernel.
_HINT_KEYS = ("dtype", "signature", "constants", "configs", "ones", "unit")

#: An import still running after this long gets one line saying so: a package's first import (torch's
#: included) takes seconds, a wait that never ends looks the same until the bound.
SLOW_IMPORT = 30.0
#: An import interrupted at its bound that has not unwound after as long again (at most this) caught the
#: interruption, or sits in C code: then the process ends, as nothing else would end it.
HARD_STOP_AFTER = 10.0
#: What a compile worker's import failing says: the check's own process imported the same module.
IN_WORKER = "in a compile worker, although this process imported it"


class ImportTimeout(BaseException):
    """Raised into an import that outlived its bound: no Exception, so that the imported code's own
    ``except Exception`` does not take it for one of its errors."""


@contextlib.contextmanager
def bounded_import(name: str, seconds: float | None, in_worker: bool = False):
    """Let the import of ``name`` run for ``seconds`` at most, then raise :class:`TargetError` (or end the
    process, see :data:`HARD_STOP_AFTER`). Unbounded with ``seconds`` None or outside the main thread (an API
    caller's thread), which signals cannot interrupt."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    if in_worker:
        why = (f"{name!r} did not finish importing in {seconds:g} s (--timeout) {IN_WORKER}: does its import wait "
               "for something this process holds? (--jobs 1 compiles without workers)")
        ends = "no report", "this compile worker ends, its compiles fail"
    else:
        why = (f"{name!r} did not finish importing in {seconds:g} s (--timeout): an endless loop at import, or a "
               "wait for something that never comes")
        ends = "nothing checked", "nothing checked"

    def interrupt(signum, frame):
        raise ImportTimeout

    finished = threading.Event()
    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    what = f"{name!r} in a compile worker" if in_worker else repr(name)
    threading.Thread(target=_stop_if_stuck, args=(what, seconds, f"{why}; {ends[1]}", finished), daemon=True).start()
    try:
        yield
    except ImportTimeout:
        raise TargetError(f"{why}; {ends[0]}") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        finished.set()


def _stop_if_stuck(what: str, seconds: float, line: str, finished: threading.Event) -> None:
    started = time.monotonic()
    if SLOW_IMPORT < seconds and not finished.wait(SLOW_IMPORT):
        log.warning("smemguard check: still importing %s after %g s (stopped at %g s: --timeout)", what, SLOW_IMPORT,
                    seconds)
    if not finished.wait(seconds + min(seconds, HARD_STOP_AFTER) - (time.monotonic() - started)):
        os.write(2, f"smemguard check: {line}\n".encode())
        os._exit(2)


def _triton_classes():
    from triton.runtime.autotuner import Autotuner, Heuristics
    from triton.runtime.jit import JITFunction

    return JITFunction, Autotuner, Heuristics


def _is_kernel(obj) -> bool:
    return isinstance(obj, _triton_classes())


def is_device_function(obj) -> bool:
    """Whether ``obj`` is a ``@triton.jit`` function that returns a value: a device function that kernels
    call (vLLM's ``fast_exp``, ``softplus``), never launched (a kernel returns nothing)."""
    return type(obj) is _triton_classes()[0] and source.returns_a_value(obj)


def _load_file(path: Path) -> ModuleType:
    """Import a kernel file as the module its stem names, as a program beside it imports it (``kernels.py``:
    ``kernels``), so that its kernels carry the names they have at run time and ``--decisions`` keys them so.
    A stem that is not a module name, or names a module already imported from elsewhere (a file called
    ``triton.py`` must not shadow Triton), gets a name of its own; its decisions then apply only to a program
    that loads it under that name, and one line says so."""
    stem = path.stem
    loaded = sys.modules.get(stem)
    if loaded is not None and getattr(loaded, "__file__", None) and Path(loaded.__file__).resolve() == path:
        return loaded
    if stem.isidentifier() and loaded is None and _only_this_file(stem, path):
        name = stem
    else:
        name = (f"smemguard_check_{re.sub(r'[^0-9A-Za-z_]', '_', stem)}"
                f"_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}")
        if name in sys.modules:
            return sys.modules[name]
        log.warning("smemguard check: %s is loaded as %s (%r is %s): decisions written for its kernels apply "
                    "to a program that imports it under that name only", path, name, stem,
                    "not a module name" if not stem.isidentifier() else "another module")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise TargetError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    # Kernel files import their neighbours like scripts do.
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _only_this_file(name: str, path: Path) -> bool:
    """Whether importing ``name`` finds nothing, or ``path`` itself."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    return spec is None or (spec.origin is not None and Path(spec.origin).resolve() == path)


def _import(module_name: str, file: str | None) -> ModuleType:
    if file is not None:
        return _load_file(Path(file))
    return importlib.import_module(module_name)


def _split_target(target: str) -> tuple[str, str | None]:
    """``"pkg.mod:kernel"`` -> ("pkg.mod", "kernel"); ``"kernels.py"`` -> ("kernels.py", None)."""
    match = re.fullmatch(r"(.+):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)", target)
    return (match.group(1), match.group(2)) if match else (target, None)


def _open_target(target: str, import_timeout: float | None) -> tuple[ModuleType, str | None, str | None]:
    """The module named or pointed at by ``target``, the attribute asked for, and the file if a path."""
    where, attribute = _split_target(target)
    looks_like_path = where.endswith(".py") or os.sep in where or Path(where).is_file()
    try:
        if looks_like_path:
            path = Path(where).expanduser().resolve()
            if not path.is_file():  # a FIFO is never opened: it would wait for a writer
                raise TargetError(f"{target!r}: " + ("a directory, not a kernel file" if path.is_dir() else
                                                      "not a regular file" if path.exists() else "no such file"))
            with bounded_import(where, import_timeout):
                return _load_file(path), attribute, str(path)
        with bounded_import(where, import_timeout):
            return importlib.import_module(where), attribute, None
    except TargetError:
        raise
    except (Exception, SystemExit) as error:  # a module calling sys.exit() at import must not pick our exit status
        raise TargetError(f"{target!r} could not be imported: {type(error).__name__}: {error}") from None


def _resolve_attribute(module: ModuleType, attribute: str):
    obj: Any = module
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj


def _innermost(obj):
    """The JIT function under autotuner/heuristics layers, the autotuner, and the heuristics values."""
    JITFunction, Autotuner, Heuristics = _triton_classes()
    autotuner, heuristics = None, []
    for layer in introspect.chain(obj):
        if isinstance(layer, JITFunction):
            return layer, autotuner, heuristics
        if isinstance(layer, Autotuner) and autotuner is None:
            autotuner = layer
        elif isinstance(layer, Heuristics):
            heuristics.append(dict(layer.values))
    raise TargetError(f"{type(obj).__name__} is not a Triton kernel")


def jit_from_locator(locator: tuple[str, str, str | None], import_timeout: float | None = None):
    """The JIT function ``locator`` names, imported again in a compile worker; :class:`TargetError` when the
    import fails or outlives ``import_timeout`` there."""
    module_name, attribute, file = locator
    name = file or module_name
    with bounded_import(name, import_timeout, in_worker=True):
        try:
            module = _import(module_name, file)
        except (Exception, SystemExit) as error:  # neither a traceback nor the target's exit status
            raise TargetError(f"{name!r} could not be imported {IN_WORKER}: {introspect.error_summary(error)} "
                              "(--jobs 1 compiles without workers); no report") from None
    return _innermost(_resolve_attribute(module, attribute))[0]


def discover(targets: Sequence[str], examples: bool = False, overrides: dict | None = None,
             import_timeout: float | None = None) -> list[CheckedKernel]:
    """The kernels named by ``targets`` (modules, ``module:kernel``, files) and, with ``examples``,
    smemguard's own example kernels. ``overrides`` are hints (see :data:`_HINT_KEYS`) that win over
    those a module declares in ``SMEMGUARD_PREFLIGHT``. Importing a target runs its code; each import
    may take ``import_timeout`` seconds (None: unbounded). Raises :class:`TargetError`."""
    overrides = overrides or {}
    found: list[tuple[str, ModuleType, str, str | None, Any, bool]] = []
    names = list(targets) + (["smemguard.examples"] if examples else [])
    if not names:
        raise TargetError("nothing to check: name a module, module:kernel or file, or pass --examples")
    for target in names:
        module, attribute, file = _open_target(target, import_timeout)
        label = Path(file).name if file else module.__name__
        if attribute is not None:
            try:
                obj = _resolve_attribute(module, attribute)
            except AttributeError:
                raise TargetError(f"{target!r}: {label} has no attribute {attribute!r}") from None
            if not _is_kernel(obj):
                raise TargetError(f"{target!r} is a {type(obj).__name__}, not a Triton kernel "
                                  "(@triton.jit, triton.autotune or triton.heuristics)")
            if is_device_function(obj):
                raise TargetError(f"{target!r} is a device function (it returns a value): kernels call it, nothing "
                                  "launches it; check the kernels that call it")
            found.append((f"{label}:{attribute}", module, attribute, file, obj, True))
            continue
        before = len(found)
        package = hasattr(module, "__path__") and file is None
        # A package: the kernels each of its modules defines (they import each other's).
        for member in [module, *_package_modules(module, import_timeout)] if package else [module]:
            found.extend(_module_kernels(member, member.__name__ if package else label, file, defined_here=package))
        if len(found) == before:
            raise TargetError(f"{target!r} defines no Triton kernel" + (", nor does any module of the package"
                                                                       if package else ""))

    kernels = []
    for name, module, attribute, file, obj, explicit in found:
        hints = {**getattr(module, "SMEMGUARD_PREFLIGHT", {}).get(attribute, {})}
        for key, value in overrides.items():
            hints[key] = {**hints.get(key, {}), **value} if key in ("signature", "constants") else value
        kernel = _make_kernel(name, obj, hints, locator_from=(module, attribute, file))
        if kernel is None:
            if explicit:
                raise TargetError(f"{name}: no config to check: it is a plain @triton.jit kernel with constexprs "
                                  "that have no default; give them with --meta NAME=VALUE,... (one --meta per config)")
            if not _called_by_a_kernel_of(module, attribute):  # a helper is checked in its callers' compiles
                log.warning("smemguard check: skipping %s: a plain @triton.jit kernel whose constexprs have no "
                            "default (name it as module:kernel with --meta to check it)", name)
            continue
        if all(kernel.name != known.name for known in kernels):
            kernels.append(kernel)
    if not kernels:
        raise TargetError("no kernel to check: the kernels found need --meta to give their constexprs")
    return kernels


def files_read(kernels: Sequence[CheckedKernel]) -> set[str]:
    """The files a check of ``kernels`` has read: each kernel's source, and every module imported so far (the
    targets, their packages, what they import). ``--decisions`` must never replace one of them."""
    read = {kernel.jit.fn.__code__.co_filename for kernel in kernels}
    read.update(file for module in list(sys.modules.values())
                if isinstance(file := getattr(module, "__file__", None), str))
    return read


def _module_kernels(module: ModuleType, label: str, file: str | None, defined_here: bool) -> list[tuple]:
    """(name, module, attribute, file, kernel, False) for the kernels in ``module``'s namespace (with
    ``defined_here``, only those whose function it defines: a package's modules import each other's)."""
    in_module = [(name, obj) for name, obj in vars(module).items() if _is_kernel(obj) and not is_device_function(obj)
                 and (not defined_here or getattr(_innermost(obj)[0], "__module__", None) == module.__name__)]
    hints = getattr(module, "SMEMGUARD_PREFLIGHT", {})
    wrapped = {id(_innermost(obj)[0]) for _, obj in in_module if not isinstance(obj, _triton_classes()[0])}
    seen: set[int] = set()
    found = []
    for name, obj in in_module:
        # A JIT function an autotuner of the same module wraps is checked through it, with its configs.
        if id(obj) in seen or (id(obj) in wrapped and name not in hints):
            continue
        seen.add(id(obj))
        found.append((f"{label}:{name}", module, name, file, obj, False))
    return found


def _called_by_a_kernel_of(module: ModuleType, attribute: str) -> bool:
    """Whether another Triton function of ``module`` calls ``attribute`` (``smemguard.examples._matmul_tile``, which
    both matmul kernels call): a helper compiled into its callers, never launched alone."""
    return any(source.calls(_innermost(obj)[0]) >= {attribute} for name, obj in vars(module).items()
               if name != attribute and _is_kernel(obj) and _innermost(obj)[0] is not None)


def _package_modules(package: ModuleType, import_timeout: float | None) -> list[ModuleType]:
    """Every module of ``package``, its subpackages' too, in name order. One that cannot be imported (a
    module calling ``sys.exit()`` at import included: it must neither pick the check's exit status nor hide
    the package's other modules) is skipped with one warning line: the package was named, not that module.
    One that outlives ``import_timeout`` stops the check instead: skipped, its kernels would pass unchecked."""
    modules = {}

    def walk(package_path, prefix: str) -> None:
        import pkgutil

        for info in sorted(pkgutil.iter_modules(package_path, prefix), key=lambda info: info.name):
            module = _import_or_skip(info.name, import_timeout)
            if module is None:
                continue
            modules[info.name] = module
            if info.ispkg and hasattr(module, "__path__"):
                walk(module.__path__, f"{info.name}.")

    walk(package.__path__, f"{package.__name__}.")
    return [modules[name] for name in sorted(modules)]


def _import_or_skip(name: str, import_timeout: float | None) -> ModuleType | None:
    with bounded_import(name, import_timeout):  # outside the try: a timeout stops the check, never skips
        try:
            return importlib.import_module(name)
        except (Exception, SystemExit) as error:
            why = (f"it calls sys.exit({error.code!r}) at import" if isinstance(error, SystemExit)
                   else f"it cannot be imported ({introspect.error_summary(error)})")
            log.warning("smemguard check: skipping %s: %s", name, why)
            return None


def _make_kernel(name: str, obj, hints: dict, locator_from: tuple) -> CheckedKernel | None:
    unknown = sorted(set(hints) - set(_HINT_KEYS))
    if unknown:
        raise TargetError(f"{name}: unknown preflight hints {unknown}; known: {', '.join(_HINT_KEYS)}")
    jit, autotuner, heuristics = _innermost(obj)
    runtime_names = [p.name for p in jit.params if not p.is_constexpr]
    constants = dict(hints.get("constants", {}))
    if hints.get("configs"):
        variants = [Variant.of(config) for config in hints["configs"]]
    elif autotuner is not None:
        variants = [Variant.of(config) for config in autotuner.configs]
    else:
        missing = [p.name for p in jit.params if p.is_constexpr and not p.has_default and p.name not in constants
                   and not any(p.name in values for values in heuristics)]
        if missing:
            return None
        variants = [Variant(())]

    for label, names in (("--const", constants), ("signature", hints.get("signature", {}))):
        strangers = sorted(set(names) - set(jit.arg_names))
        if strangers:
            raise TargetError(f"{name}: {label} names {strangers}, which are not parameters of {jit.fn.__name__}")
    types = _argument_types(jit, hints.get("dtype", "fp16"), hints.get("signature", {}))
    unit, guesses = _unit_args(jit, types, hints.get("unit", "auto"), name)
    ones_lists = [tuple(ones) for ones in hints.get("ones", [])]
    for ones in ones_lists:
        wrong = [arg for arg in ones if arg not in runtime_names]
        if wrong:
            raise TargetError(f"{name}: --one names {wrong}, which are not integer parameters of {jit.fn.__name__} "
                              f"(those are: {', '.join(runtime_names)})")
    launches = [Specialization(ALIGNED, True), Specialization(MISALIGNED, False)]
    launches += [Specialization(f"{ones[0]}=1", True, ones) for ones in ones_lists]
    # Unsure strides: every launch once per reading of the source; a config fits when it fits in all.
    specializations = [dataclasses.replace(spec, name=spec.name if guess == BY_ORDER else f"{spec.name} {guess}",
                                           unit_guess=guess, guessed_ones=guessed)
                       for guess, guessed in guesses for spec in launches] or launches
    unsure = tuple(arg for arg in runtime_names if any(arg in guessed for _, guessed in guesses))

    module, attribute, file = locator_from
    # How a worker process finds the same JIT function; it cannot import one defined in __main__.
    locator = None if module.__name__ == "__main__" else (module.__name__, attribute, file)
    return CheckedKernel(name, jit, variants, types, constants, unit, specializations, heuristics, locator, unsure,
                         obj)


def _unit_args(jit, types: dict[str, str], unit, kernel_name: str):
    """Integer arguments equal to 1 in every launch, and the readings of the strides the source leaves
    unsure, ``[(BY_ORDER, args), (BY_LAYOUT, args), (NON_UNIT, ())]`` (those that differ; none when it
    is sure): named (``unit``), none, or ``auto``: read from the source (:mod:`.source`)."""
    if unit == "none":
        return (), []
    if unit != "auto":
        names = tuple(unit)
        wrong = [arg for arg in names if arg not in types]
        if wrong:
            raise TargetError(f"{kernel_name}: --unit names {wrong}, which are not runtime parameters")
        return names, []
    specializable = {p.name for p in jit.params if not p.is_constexpr and not p.do_not_specialize}
    integers = {name for name, ty in types.items() if ty in INT_TYPES and name in specializable}
    found = source.unit_strides(jit, {name for name, ty in types.items() if ty.startswith("*")}, integers)
    sure = tuple(name for name in types if name in found.sure)
    if not found.unsure:
        return sure, []
    readings: dict[tuple[str, ...], str] = {}
    for guess, guessed in ((BY_ORDER, found.by_order), (BY_LAYOUT, found.by_layout), (NON_UNIT, set())):
        if guessed or guess != BY_LAYOUT:  # an empty tile-layout reading is the non-unit one
            readings.setdefault(tuple(name for name in types if name in guessed), guess)
    return sure, [(guess, guessed) for guessed, guess in readings.items()]


def _argument_types(jit, dtype: str, explicit: dict[str, str]) -> dict[str, str]:
    """Triton type of each runtime parameter: given, annotated, or inferred (pointer to ``dtype``, else i32)."""
    pointers = source.pointer_parameters(jit)
    types = {}
    for param in jit.params:
        if param.is_constexpr:
            continue
        annotation = param.annotation_type if isinstance(param.annotation_type, str) else ""
        if param.name in explicit:
            types[param.name] = explicit[param.name]
        elif annotation:
            types[param.name] = annotation
        elif param.name in pointers:
            types[param.name] = f"*{dtype}"
        else:
            types[param.name] = "i32"
    return types
