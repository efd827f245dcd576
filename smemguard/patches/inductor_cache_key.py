"""Honest torch.compile caches under an emulated limit: extends ``torch.compiler.config.cache_key_tag``.

Why: Inductor keys its FX graph cache, its AOTAutograd cache and its autotune cache by the device's
name, never by a shared-memory limit. Under ``SMEMGUARD_MAX_SHARED`` what it compiles depends on the
emulated limit (FlexAttention tiles chosen to fit it, configs a load replaced and the autotuner then
kept), so without a key of its own a graph compiled for an emulated L4 would be served to a later run
of the full GPU from the same cache directory, and one compiled for the full GPU to a run emulating
the L4, which would then fail as the L4 never would.

What: while an emulated limit is set, ``smemguard-max-shared=<bytes>`` is appended to torch's cache-key
tag, the setting torch offers for this (``TORCH_COMPILE_CACHE_KEY_TAG``, "a tag to be included in the
cache key generation for all torch compile caching"), after the user's own tag. A run on the device's
own limit adds nothing, so its keys are torch's. This is a setting, not a function: no layer; removal
puts back the value found, unless something else has set the tag since: then theirs stands.

Checked against torch 2.11.0, 2.13.0, 2.14.0 and 2.15.0 (``torch/compiler/config.py``; read by ``FxGraphHashDetails``,
``AutotuneCache`` and AOTAutograd's cache key); read in 2.8 to 2.10.
"""

from __future__ import annotations

import importlib
import logging
import sys

from .. import runtime
from ..versions import Supported

log = logging.getLogger(__name__)

TARGET = "torch.compiler.config.cache_key_tag"
TARGET_MODULES = ("torch.compiler.config",)
SUPPORTED = Supported("torch", (2, 8), (2, 15), label="PyTorch")
OBSERVE_SAFE = True  # observe mode emulates the limit too: its compiles must not mix with the full GPU's

_SEPARATOR = ","
_found: str | None = None  # the tag before ours was added
_ours: str | None = None  # the tag we set


def applies(settings) -> bool:
    return settings.max_shared is not None


def _config():
    return importlib.import_module(TARGET_MODULES[0])


def patch(context) -> None:
    global _found, _ours
    config = _config()
    if not isinstance(getattr(config, "cache_key_tag", None), str):
        runtime.warn_once(log, ("no cache key tag",), "smemguard: this PyTorch has no torch.compiler.config."
                          "cache_key_tag; under an emulated limit give torch.compile its own TORCHINDUCTOR_CACHE_DIR")
        return
    if is_patched():
        return
    own = f"smemguard-max-shared={context.settings.max_shared}"
    _found = config.cache_key_tag
    _ours = _SEPARATOR.join(part for part in (_found, own) if part)
    config.cache_key_tag = _ours


def unpatch() -> None:
    global _found, _ours
    if _ours is None:
        return
    config = _config()
    if config.cache_key_tag == _ours:
        config.cache_key_tag = _found
    _found = _ours = None


def is_patched() -> bool:
    config = sys.modules.get(TARGET_MODULES[0])  # reading never imports torch
    return _ours is not None and getattr(config, "cache_key_tag", None) == _ours
