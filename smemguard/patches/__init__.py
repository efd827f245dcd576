"""One module per patched target, each with ``patch()``, ``unpatch()`` and ``is_patched()``.

Every module names the Triton versions it was checked against; :func:`triton_supported`
gates them all before anything is touched, because the targets are private Triton
internals whose shape can change in any release.
"""

from __future__ import annotations

import importlib

import wrapt

#: Triton releases whose internals the patches were read and tested against: [3.4, 3.10).
SUPPORTED_TRITON = ((3, 4), (3, 10))


def triton_version() -> str:
    import triton

    return getattr(triton, "__version__", "unknown")


def triton_supported(version: str, supported: tuple = SUPPORTED_TRITON) -> bool:
    """Whether ``version`` ("3.6.0") lies in ``supported``: [(major, minor), (major, minor))."""
    try:
        major_minor = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    low, high = supported
    return low <= major_minor < high


def supported_range() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_TRITON
    return f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"


def wrap(module_name: str, name: str, wrapper) -> None:
    """Wrap ``module.name`` (a dotted name: "Autotuner._bench") with a wrapt function wrapper."""
    wrapt.wrap_function_wrapper(module_name, name, wrapper)


def _owner_and_attr(module_name: str, name: str):
    owner = importlib.import_module(module_name)
    *parents, attr = name.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner, attr


def _layers(module_name: str, name: str):
    """The objects at ``module.name``, outermost first, following ``__wrapped__``."""
    owner, attr = _owner_and_attr(module_name, name)
    layer = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
    while layer is not None:
        yield layer
        layer = getattr(layer, "__wrapped__", None)


def _is_wrapt_layer(obj, wrapper=None) -> bool:
    ours = getattr(obj, "_self_wrapper", None)
    return ours is not None if wrapper is None else ours is wrapper


def find_wrapper(module_name: str, name: str, wrapper):
    """Our wrapt layer on ``module.name``, wherever it sits in a chain of wrappers, or None."""
    return next((layer for layer in _layers(module_name, name) if _is_wrapt_layer(layer, wrapper)), None)


def unwrap(module_name: str, name: str, wrapper) -> bool:
    """Remove only our layer from ``module.name``: the outermost one, or one under another tool's.

    Returns False when our layer is not there (never patched, or already removed), or when
    the layer above ours is not a wrapt wrapper and so cannot be re-pointed.
    """
    owner, attr = _owner_and_attr(module_name, name)
    above = None
    for layer in _layers(module_name, name):
        if _is_wrapt_layer(layer, wrapper):
            if above is None:
                setattr(owner, attr, layer.__wrapped__)
                return True
            if _is_wrapt_layer(above):  # another tool wrapped on top of us: splice our layer out
                above.__wrapped__ = layer.__wrapped__
                return True
            return False
        above = layer
    return False
