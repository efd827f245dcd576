"""Through vLLM's own plugin loader (runs where vLLM is installed: the second stage of .ci/run)."""

import json

import pytest

from conftest import run_python

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

LOAD_THEN_IMPORT_TRITON = """
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    import triton, smemguard
    from smemguard import guard
    print("installed", smemguard.is_installed(), guard.active_settings() is not None)
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


def test_tiny_llama_generates_with_the_plugin_in_every_process(tmp_path):
    """A randomly initialised 2-layer Llama on vLLM's CPU backend: front end, engine core and worker each load it."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
        "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 512,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1,
        "eos_token_id": 2, "tie_word_embeddings": False}))
    result = run_python(f"""
        if __name__ == "__main__":
            from vllm import LLM, SamplingParams
            llm = LLM(model={str(tmp_path)!r}, load_format="dummy", skip_tokenizer_init=True, max_model_len=128,
                      enforce_eager=True, dtype="float32", max_num_seqs=2, gpu_memory_utilization=0.3)
            out = llm.generate([{{"prompt_token_ids": [1, 5, 7, 9]}}],
                               SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False))
            print("tokens", len(out[0].outputs[0].token_ids))
    """, env={"VLLM_PLUGINS": "smemguard", "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert "tokens 4" in result.stdout
    guarded = [line for line in result.stderr.splitlines() if "smemguard 0.1.0 guarding Triton" in line]
    assert len(guarded) >= 2, "the plugin loads in the front end and in the engine's processes"
