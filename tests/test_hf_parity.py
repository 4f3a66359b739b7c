"""Real checkpoints: tiny random Llama (with Llama 3 RoPE scaling), Mistral and Qwen2 models
written by `transformers` are served by the pool with the tokens of `transformers`' own
greedy `generate` (docs/architecture.md §7, tie-tolerant)."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from npu_worker.weights.tiny import ensure_tiny_model
from producer.client import Client
from tests.helpers import TIE_TOLERANCE, check_stream, random_prompt
from tests.reference import first_divergence, hf_greedy

transformers = pytest.importorskip("transformers")

COMMON = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "initializer_range": 0.2,
    "eos_token_id": 1,
    "bos_token_id": 0,
}
ARCHITECTURES = {
    "llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4096}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
}


def build_checkpoint(kind: str, out: Path) -> torch.nn.Module:
    """A random model of `kind` saved by transformers (Qwen2 sharded, with an index)."""
    config_name, model_name, extra = ARCHITECTURES[kind]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**COMMON, **extra)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # biases start at zero; make Qwen2's QKV bias count
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_(0.0, 0.5)
    shard = "60KB" if kind == "qwen2" else "1GB"
    model.save_pretrained(out, safe_serialization=True, max_shard_size=shard)
    shutil.copy(ensure_tiny_model() / "tokenizer.json", out / "tokenizer.json")
    return model


@pytest.mark.parametrize("kind", sorted(ARCHITECTURES))
def test_pool_serves_a_transformers_checkpoint_with_its_greedy_tokens(
    kind: str, start_pool, client: Client, tmp_path: Path
) -> None:
    model = build_checkpoint(kind, tmp_path / kind)
    if kind == "qwen2":
        assert (tmp_path / kind / "model.safetensors.index.json").exists()
    start_pool(model=str(tmp_path / kind), ranks=2, decode_batch=4, max_model_len=512)
    rng = random.Random(5)
    cases = [
        (random_prompt(rng, n, 512), m)
        for n, m in [(1, 20), (9, 30), (70, 25), (129, 12), (200, 16), (33, 40), (5, 8), (150, 20)]
    ]
    ids = [client.submit(prompt_token_ids=p, max_tokens=m, ignore_eos=True) for p, m in cases]
    for request_id, (prompt, max_tokens) in zip(ids, cases):
        tokens = check_stream(list(client.stream(request_id, timeout_s=120)))
        want = hf_greedy(model, prompt, max_tokens)
        problem = first_divergence(tokens, want, TIE_TOLERANCE)
        assert problem is None, f"{kind}, prompt of {len(prompt)}: {problem}"
