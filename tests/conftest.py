import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

# The run's caches live in a directory of its own, removed at the end: the tests never write the
# user's ~/.cache/smemguard or ~/.triton (subprocesses inherit these too). Set before Triton is imported.
# Under pytest-xdist the workers share the controller's Triton cache (Triton writes it atomically: a kernel
# one worker compiled is a cache hit for the other) and keep an XDG cache (smemguard's decisions) each.
_SHARED = "PYTEST_SMEMGUARD_CACHES"
_OWNER = _SHARED not in os.environ
_CACHES = os.environ.setdefault(_SHARED, tempfile.mkdtemp(prefix="smemguard-tests-"))
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="xdg-", dir=_CACHES)
os.environ["TRITON_HOME"] = _CACHES

import pytest  # noqa: E402

import smemguard  # noqa: E402
from smemguard.facts import process  # noqa: E402
from smemguard.engine.core import Engine  # noqa: E402
from smemguard.facts.settings import Settings  # noqa: E402


def pytest_unconfigure(config):
    if _OWNER:
        shutil.rmtree(_CACHES, ignore_errors=True)


TESTS = Path(__file__).parent
ROOT = TESTS.parent


@pytest.fixture(scope="session")
def triton_cache() -> str:
    """One Triton cache for the whole run, all workers: the same kernel compiles once, whichever test asks first."""
    path = os.path.join(_CACHES, "triton-cache")
    os.makedirs(path, exist_ok=True)
    return path


@pytest.fixture
def incident_log(tmp_path) -> Path:
    return tmp_path / "incidents.jsonl"


@pytest.fixture
def install_guard(incident_log):
    """Install smemguard with the given settings (incidents to ``incident_log``); uninstall afterwards.

    The compile-time core (``triton_compile``) is left off unless ``core=True``: these tests drive the launch
    guard, the ladder and the other layers, which stay for everything stages cannot fix (and run as tested
    under ``SMEMGUARD_DISABLE=triton_compile``); tests/test_compile_core.py drives the core itself."""

    def install(core: bool = False, **fields) -> Settings:
        if not core:
            fields["disabled"] = (*fields.get("disabled", ()), "triton_compile")
        fields.setdefault("log_path", incident_log)
        settings = Settings(**fields)
        assert smemguard.install(settings)
        return settings

    process.forget_warnings()
    yield install
    smemguard.uninstall()


@pytest.fixture(autouse=True)
def _never_leave_the_guard_installed():
    yield
    if process.installed_engine() is not None:
        smemguard.uninstall()
        pytest.fail("a test left smemguard installed")


def engine(settings: Settings | None = None) -> Engine:
    """The engine the installer hands a patch, for tests that apply one patch directly."""
    return Engine(settings or Settings())


def records(path: Path) -> list[dict]:
    """The incident records in ``path`` (a JSON-lines log), oldest first; none when it does not exist."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_python(code: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (with the tests folder importable) and return the result."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SMEMGUARD")}
    full_env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT), full_env.get("PYTHONPATH", "")])
    full_env.update(env or {})
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, capture_output=True,
                            text=True, timeout=600)
    if check and result.returncode != 0:
        raise AssertionError(f"subprocess failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


#: Sources whose records have no launch behind them (docs/INCIDENTS.md, "Fields by phase").
NO_LAUNCH = ("CachingAutotuner", "torch.compile")


@pytest.fixture
def records_name_their_launch(incident_log):
    """After the test: every record of a Triton kernel in ``incident_log`` names the launch behind it (``args`` and
    ``grid``) or, where no launch caused it, what the compile was given (``signature``): replayable."""
    yield
    for record in records(incident_log):
        if "device" in record and record["launched_as"] not in NO_LAUNCH:
            assert {"args", "grid"} <= set(record) or "signature" in record, record
