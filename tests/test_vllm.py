"""Through vLLM's own plugin loader (runs where vLLM is installed: the second stage of .ci/run)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT, run_python

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

import smemguard  # noqa: E402
import triton  # noqa: E402

LOAD_THEN_IMPORT_TRITON = """
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    import triton, smemguard
    from smemguard.facts import process
    print("installed", smemguard.is_installed(), process.installed_engine() is not None)
"""


@pytest.mark.parametrize("plugins, loaded", [
    ("smemguard", True),
    (None, True),  # unset: vLLM loads every plugin
    ("other", False),
    ("", False),
    ("other, smemguard", False),  # an exact list: " smemguard" is another name
    ("other,smemguard", True),
    ("SmemGuard", False),
])
def test_vllm_plugins_allowlist(plugins, loaded):
    env = {} if plugins is None else {"VLLM_PLUGINS": plugins}
    result = run_python(LOAD_THEN_IMPORT_TRITON, env=env)
    assert result.stdout.split() == ["installed", str(loaded), str(loaded)]


def test_a_broken_setting_does_not_stop_vllm():
    result = run_python(LOAD_THEN_IMPORT_TRITON, env={"VLLM_PLUGINS": "smemguard", "SMEMGUARD_MAX_SHARED": "abc",
                                                      "SMEMGUARD_LOG": "/etc/hostname/x.jsonl"})
    assert result.stdout.split() == ["installed", "True", "True"]
    assert "SMEMGUARD_MAX_SHARED='abc' ignored" in result.stderr
    assert "SMEMGUARD_LOG='/etc/hostname/x.jsonl' ignored" in result.stderr


def tiny_llama(directory: Path) -> str:
    """A randomly initialised 2-layer Llama (``load_format="dummy"``: no weights), runnable on vLLM's CPU backend."""
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
        "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 512,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1,
        "eos_token_id": 2, "tie_word_embeddings": False}))
    return str(directory)


def test_tiny_llama_generates_with_the_plugin_in_every_process(tmp_path):
    """Front end, engine core and worker each load the plugin."""
    result = run_python(f"""
        if __name__ == "__main__":
            from vllm import LLM, SamplingParams
            llm = LLM(model={tiny_llama(tmp_path)!r}, load_format="dummy", skip_tokenizer_init=True, max_model_len=128,
                      enforce_eager=True, dtype="float32", max_num_seqs=2, gpu_memory_utilization=0.3)
            out = llm.generate([{{"prompt_token_ids": [1, 5, 7, 9]}}],
                               SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False))
            print("tokens", len(out[0].outputs[0].token_ids))
    """, env={"VLLM_PLUGINS": "smemguard", "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert "tokens 4" in result.stdout
    guarded = [line for line in result.stderr.splitlines() if "smemguard 0.1.0 guarding Triton" in line]
    assert len(guarded) >= 2, "the plugin loads in the front end and in the engine's processes"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def test_the_api_server_shows_smemguard_at_metrics_with_prometheus_multiproc_dir(tmp_path):
    """vLLM's OpenAI server, as ``vllm serve`` runs it with one API server, on 127.0.0.1 with
    PROMETHEUS_MULTIPROC_DIR set: its /metrics adds up every process's files, smemguard's among them.

    Started as ``python -m vllm.entrypoints.openai.api_server``, the module ``vllm serve`` calls for a
    single API server (``run_server``): vllm-cpu 0.32's ``vllm`` script stops before parsing its
    arguments, asking for the version of a distribution named "vllm" (vllm-cpu's is "vllm-cpu").
    """
    directory = tmp_path / "prometheus"
    directory.mkdir()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SMEMGUARD", "PROMETHEUS", "VLLM"))}
    env.update(VLLM_PLUGINS="smemguard", VLLM_CPU_KVCACHE_SPACE="1", PROMETHEUS_MULTIPROC_DIR=str(directory),
               PYTHONPATH=str(ROOT))
    log = tmp_path / "server.log"
    with open(log, "w") as output:
        server = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_llama(tmp_path / "model"),
             "--load-format", "dummy", "--skip-tokenizer-init", "--max-model-len", "128", "--enforce-eager",
             "--dtype", "float32", "--max-num-seqs", "2", "--host", "127.0.0.1", "--port", str(port)],
            env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 420
        while True:
            assert server.poll() is None, f"the server exited ({server.returncode}):\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"the server was not up in 420 s:\n{log.read_text()[-4000:]}"
            try:
                get(f"http://127.0.0.1:{port}/health")
                break
            except OSError:  # refused while it starts, or 503
                time.sleep(1)
        body = get(f"http://127.0.0.1:{port}/metrics")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    from prometheus_client.parser import text_string_to_metric_families

    [info] = [s for family in text_string_to_metric_families(body) for s in family.samples
              if s.name == "smemguard_info"]
    assert info.value == 1 and info.labels["mode"] == "on" and info.labels["limit"] == "device"
    assert info.labels["version"] == smemguard.__version__ and info.labels["triton"] == triton.__version__
    assert "vllm:" in body, "vLLM's own series are there too"
    assert list(directory.glob("gauge_livemax_*.db")), "written by the processes into PROMETHEUS_MULTIPROC_DIR"


#: A user's own sitecustomize, which smemguard's (of ``smemguard run``) chains to: each process that imports Triton
#: says whether its launches are guarded then (this hook runs after smemguard's, registered first).
TRITON_IMPORT_PROBE = """\
import os, wrapt

def _probe(module):
    import smemguard
    with open(os.environ["PROBE_FILE"], "a") as out:
        out.write("%d %s\\n" % (os.getpid(), smemguard.is_installed()))

wrapt.register_post_import_hook(_probe, "triton")
"""


def test_smemguard_run_guards_every_vllm_process_without_the_plugin(tmp_path):
    """No plugin (VLLM_PLUGINS empty), spawned processes: the front end, the engine core and the worker are guarded."""
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "sitecustomize.py").write_text(TRITON_IMPORT_PROBE)
    program = tmp_path / "generate.py"
    program.write_text(f"""if __name__ == "__main__":
    import os
    from vllm import LLM, SamplingParams
    llm = LLM(model={tiny_llama(tmp_path / "model")!r}, load_format="dummy", skip_tokenizer_init=True,
              max_model_len=128, enforce_eager=True, dtype="float32", max_num_seqs=2, gpu_memory_utilization=0.3)
    out = llm.generate([{{"prompt_token_ids": [1, 5, 7, 9]}}],
                       SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False))
    print("front end", os.getpid(), "tokens", len(out[0].outputs[0].token_ids))
""")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SMEMGUARD", "VLLM", "PYTHON"))}
    env.update(VLLM_PLUGINS="", VLLM_WORKER_MULTIPROC_METHOD="spawn", VLLM_CPU_KVCACHE_SPACE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path / "probe")]), PROBE_FILE=str(tmp_path / "probe.txt"))
    done = subprocess.run([sys.executable, "-m", "smemguard.cli", "run", "--", sys.executable, str(program)], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    [front_end] = [line.split()[2] for line in done.stdout.splitlines() if line.endswith("tokens 4")]
    guarded = dict(line.split() for line in (tmp_path / "probe.txt").read_text().splitlines())
    assert set(guarded.values()) == {"True"}, guarded
    assert front_end in guarded and len(guarded) >= 3, "the front end, the engine core and its worker imported Triton"
    assert f"smemguard {smemguard.__version__} guarding Triton" not in done.stderr, \
        "no plugin loaded: the guard is run's"
