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

The setting is ``torch/compiler/config.py``'s in every release checked (read by ``FxGraphHashDetails``,
``AutotuneCache`` and AOTAutograd's cache key; releases: docs/MEASURED.md).
"""

from __future__ import annotations

import importlib
import logging
import sys

from ...facts import process
from ...facts.versions import Supported
from .. import Patch

log = logging.getLogger(__name__)

_CONFIG = "torch.compiler.config"

_SEPARATOR = ","


def _config():
    return importlib.import_module(_CONFIG)


def _apply(engine) -> None:
    config = _config()
    if not isinstance(getattr(config, "cache_key_tag", None), str):
        process.warn_once(log, ("no cache key tag",), "smemguard: this PyTorch has no torch.compiler.config."
                          "cache_key_tag; under an emulated limit give torch.compile its own TORCHINDUCTOR_CACHE_DIR")
        return
    if _present():
        return
    own = f"smemguard-max-shared={engine.settings.max_shared}"
    found = config.cache_key_tag
    ours = _SEPARATOR.join(part for part in (found, own) if part)
    config.cache_key_tag = ours
    PATCH.memory()["tag"] = (found, ours)  # the tag before ours was added, and ours


def _remove() -> None:
    found, ours = PATCH.memory().pop("tag", (None, None))
    if ours is None:
        return
    config = _config()
    if config.cache_key_tag == ours:
        config.cache_key_tag = found


def _present() -> bool:
    config = sys.modules.get(_CONFIG)  # reading never imports torch
    ours = PATCH.memory().get("tag", (None, None))[1]
    return ours is not None and getattr(config, "cache_key_tag", None) == ours


PATCH = Patch(__name__, target=f"{_CONFIG}.cache_key_tag", modules=(_CONFIG,),
              supported=Supported("torch", (2, 8), (2, 15), label="PyTorch"),
              checked=("2.11.0", "2.13.0", "2.14.0", "2.15.0"),
              observe_safe=True,  # observe mode emulates the limit too: its compiles must not mix with the full GPU's
              wanted=lambda settings: settings.max_shared is not None, apply=_apply, remove=_remove, present=_present)
