"""vLLM general plugin entry point: ``VLLM_PLUGINS=smemguard`` calls :func:`register`.

vLLM calls it once in every process it starts (front end, engine core, each worker), before
the model is loaded, and does not catch what it raises. So ``register()`` is cheap, touches
no GPU, and never raises: a failure is logged once and the process runs unguarded. The one
exception is ``SMEMGUARD=strict``, where a misconfiguration stops the process on purpose.
"""

from __future__ import annotations

import logging

_LOG_FORMAT = "%(levelname)s %(asctime)s [smemguard] %(message)s"


def _make_logs_visible() -> None:
    """vLLM configures only its own loggers; without a handler our INFO/WARNING lines would vanish."""
    logger = logging.getLogger("smemguard")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_LOG_FORMAT, "%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def register() -> None:
    try:
        _make_logs_visible()
        from smemguard import guard
        from smemguard.facts.settings import SettingsError
    except Exception:
        logging.getLogger("smemguard").warning("smemguard: plugin failed to load; running unguarded", exc_info=True)
        return
    try:
        guard.install()
    except SettingsError:
        raise
    except Exception:
        logging.getLogger("smemguard").warning("smemguard: install failed; running unguarded", exc_info=True)
