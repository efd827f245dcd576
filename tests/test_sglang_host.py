"""``smemguard run -- python -m sglang.launch_server``: SGLang 0.5.23's own server, on a CPU-only host.

SGLang starts its server (the HTTP server and tokenizer manager, exec'd by ``smemguard run``: its process id) and,
through multiprocessing's spawn, the scheduler (``sglang::scheduler``, the TP worker: the model and the Triton
attention backend) and the detokenizer (``sglang::detokenizer``); the resource tracker is a spawned interpreter too.
Each imports Triton but the resource tracker, and each that does must have smemguard installed, the scheduler with
the SGLang packs applied. A user ``sitecustomize``, chained by smemguard's bootstrap as any user's, records every
process; in the scheduler it also puts Triton on smemguard's stand-in L4 (``smemguard.testing.fake_gpu``, launches
execute nothing) with 2048 B of shared memory, where the extend attention's tiles (4096 B) do not fit.

On CPU, SGLang 0.5.23 runs as far as this: ``--device cpu`` without ``SGLANG_USE_CPU_ENGINE=1`` builds the model
with torch-native layers and the Triton attention backend. With the CPU engine it needs sgl-kernel's CPU build
(``from sgl_kernel import copy_all_layer_kv_cache_cpu``; built from source only: the PyPI ``sglang-kernel`` is a
CUDA build), and without it rotary models import ``vllm._custom_ops`` (``RotaryEmbedding``): the model here is a
tiny GPT-2 (no rotary embedding) with random weights and a word-level tokenizer, written offline.

Needs SGLang 0.5.23 installed with the packages its server imports (``--help``: huggingface-hub; the server:
transformers, fastapi, uvicorn, xgrammar, torchvision whose Python part imports beside the CPU torch, and more);
skipped without them."""

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

from conftest import records, run_python
from test_run import NOT_INSTALLED, smemguard_run

pytestmark = pytest.mark.sglang

SGLANG_HOST = "SGLang 0.5.23 with the packages its server imports is not installed"


def needs(*modules):
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"{SGLANG_HOST}: no {', '.join(missing)}")


#: Chained by smemguard's bootstrap in every Python process: one JSON line per process start, per change seen
#: (polled: nothing here imports Triton or smemguard) and at exit.
OBSERVER = '''
    import atexit, json, os, sys, threading, time

    LOG = os.environ["OBSERVE_LOG"]
    PACKS = ("sglang_extend_attention", "sglang_prefill_attention")
    fake = []


    def state(event):
        guard = sys.modules.get("smemguard")
        title = sys.modules["setproctitle"].getproctitle() if "setproctitle" in sys.modules else None
        now = {"event": event, "pid": os.getpid(), "argv": sys.argv[1:2], "title": title,
               "triton": "triton" in sys.modules, "installed": bool(guard and guard.is_installed())}
        for pack in PACKS:
            module = sys.modules.get(f"smemguard.patches.contrib.{pack}")
            now[pack] = bool(module and module.PATCH.is_patched())
        if fake:
            now["launches"] = [[launch.kernel, launch.shared] for launch in fake[0][1].launches]
        return now


    def write(event):
        with open(LOG, "a") as log:
            log.write(json.dumps(state(event)) + "\\n")


    def on_a_fake_gpu(now):
        """The scheduler's Triton on a stand-in L4 with 2048 B, before its first launch (the first request's)."""
        if not fake and now["installed"] and (now["title"] or "").startswith("sglang::scheduler"):
            from smemguard.testing import fake_gpu

            context = fake_gpu("L4", max_shared=2048, cache_dir=os.environ["OBSERVE_TRITON_CACHE"])
            fake.append((context, context.__enter__()))
            write("fake_gpu")


    def watch():
        last = None
        while True:
            time.sleep(0.1)
            now = state("watch")
            on_a_fake_gpu(now)
            if {**now, "event": None} != last:
                last = {**now, "event": None}
                write("watch")


    write("start")
    atexit.register(write, "exit")
    threading.Thread(target=watch, daemon=True).start()
'''

#: A tiny GPT-2 with random weights and a word-level tokenizer, written without the network.
TINY_GPT2 = """
    import sys, torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", *"hello world the a of to and is in it".split()]
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(sys.argv[1])
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=256, n_embd=64, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2)
    GPT2LMHeadModel(config).to(torch.bfloat16).save_pretrained(sys.argv[1])
"""


def observed(tmp_path, **env):
    """``smemguard run``'s environment with the observer's sitecustomize after the user's ``PYTHONPATH``."""
    (tmp_path / "observer").mkdir()
    (tmp_path / "observer" / "sitecustomize.py").write_text(textwrap.dedent(OBSERVER))
    log = tmp_path / "observed.jsonl"
    pythonpath = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(tmp_path / "observer")]))
    return log, {"PYTHONPATH": pythonpath, "OBSERVE_LOG": str(log), "HF_HUB_OFFLINE": "1", **env}


def processes(log) -> dict[int, list[dict]]:
    """What the observer wrote, by process id, in order."""
    seen: dict[int, list[dict]] = {}
    for line in log.read_text().splitlines():
        state = json.loads(line)
        seen.setdefault(state["pid"], []).append(state)
    return seen


def test_launch_server_help_runs_guarded(tmp_path):
    needs("sglang", "huggingface_hub")
    log, env = observed(tmp_path)
    process = smemguard_run(sys.executable, "-m", "sglang.launch_server", "--help", env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    assert out.startswith("usage: sglang serve [-h] --model-path MODEL_PATH") and "--attention-backend" in out
    assert NOT_INSTALLED not in err
    [states] = processes(log).values()  # exec'd: smemguard run's process is SGLang's, and it starts no other
    assert states[-1]["event"] == "exit" and states[-1]["pid"] == process.pid
    assert (states[-1]["triton"], states[-1]["installed"]) == (True, True), "SGLang imports Triton, guarded"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for(condition, process, output, timeout=300):
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            pytest.fail(f"the server exited ({process.returncode}):\n{output.read_text()[-6000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"not ready in {timeout} s:\n{output.read_text()[-6000:]}")
        time.sleep(0.2)


def generate(port: int, text: str, tokens: int) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/generate", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"text": text, "sampling_params": {
                                         "max_new_tokens": tokens, "temperature": 0}}).encode())
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never a proxy for 127.0.0.1
    with direct.open(request, timeout=300) as response:
        return json.load(response)


@pytest.mark.slow
def test_every_sglang_server_process_that_imports_triton_is_guarded_and_the_scheduler_recovers(
        tmp_path, triton_cache):
    needs("sglang", "huggingface_hub", "transformers", "tokenizers", "safetensors", "fastapi", "uvicorn", "xgrammar",
          "torchvision", "tvm_ffi", "compressed_tensors", "openai", "setproctitle", "soundfile")
    model = tmp_path / "tiny-gpt2"
    run_python(TINY_GPT2.replace("sys.argv[1]", repr(str(model))))
    incidents = tmp_path / "incidents.jsonl"
    log, env = observed(tmp_path, OBSERVE_TRITON_CACHE=triton_cache, SMEMGUARD_LOG=str(incidents),
                        SMEMGUARD_CACHE_DIR="off")
    port, output = free_port(), tmp_path / "server.log"
    with open(output, "w") as sink:
        server = smemguard_run(sys.executable, "-m", "sglang.launch_server", "--model-path", model,
                               "--device", "cpu", "--attention-backend", "triton", "--host", "127.0.0.1",
                               "--port", port, "--skip-server-warmup", "--max-total-tokens", 2048,
                               env={**env, "SGLANG_USE_CPU_ENGINE": "0"},  # its CPU engine: sgl-kernel's CPU build
                               stdout=sink, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "The server is fired up and ready to roll!" in output.read_text(), server, output)
        wait_for(lambda: any(state["event"] == "fake_gpu" for states in processes(log).values() for state in states),
                 server, output, timeout=30)
        answer = generate(port, "hello world the", 4)
        assert answer["meta_info"]["completion_tokens"] == 4, "the request went through prefill and decode"
        time.sleep(0.5)  # the observer's next look at the scheduler's launches
    finally:
        server.send_signal(signal.SIGTERM)  # SGLang's own shutdown ends its children
        try:
            server.wait(timeout=60)
        finally:
            server.kill()
            for pid in processes(log) if log.exists() else ():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    seen = processes(log)
    last = {pid: states[-1] for pid, states in seen.items()}
    spawned = {pid for pid, states in seen.items() if "--multiprocessing-fork" in states[0]["argv"]}
    by_title = {state["title"]: pid for pid, state in last.items()}
    scheduler, detokenizer = by_title["sglang::scheduler"], by_title["sglang::detokenizer"]
    assert {scheduler, detokenizer} <= spawned, "fresh interpreters (spawn): the bootstrap came through PYTHONPATH"
    assert server.pid in last and last[server.pid]["installed"], "the server itself (exec'd by smemguard run)"
    for pid in (server.pid, scheduler, detokenizer):
        assert (last[pid]["triton"], last[pid]["installed"]) == (True, True), last[pid]
    assert all(state["installed"] for state in last.values() if state["triton"]), "every process with Triton"
    assert [state for state in last.values() if not state["triton"]], "the resource tracker pays nothing"
    assert (last[scheduler]["sglang_extend_attention"], last[scheduler]["sglang_prefill_attention"]) == (True, True)

    [tiles] = [record for record in records(incidents) if record["action"] == "tiles_reduced"]
    assert {record["pid"] for record in records(incidents)} == {scheduler}
    assert (tiles["kernel"], tiles["launched_as"]) == ("sglang.kernels.ops.attention.extend_attention:_fwd_kernel",
                                                       "sglang.kernels.ops.attention.extend_attention:extend_attention_fwd")
    assert (tiles["config"], tiles["final"], tiles["required"], tiles["limit_hit"]) == (
        "BLOCK_M=64 BLOCK_N=64", "BLOCK_M=32 BLOCK_N=32", 4096, 2048)
    assert tiles["shape_class"] == {"Lq": 16, "Lv": 16}
    extends = [shared for kernel, shared in last[scheduler]["launches"] if kernel == "_fwd_kernel"]
    assert extends and all(shared <= 2048 for shared in extends), "every layer's extend launched with the tiles"
    assert "chooses BLOCK_M=32 BLOCK_N=32 for this shape class from now on" in output.read_text()
