"""Built-in model presets: deterministic random Llamas with a byte-level BPE tokenizer.

- `tiny` (~0.1M parameters, with an MTP module fitted to its own greedy continuations):
  what the demo and the tests run.
- `small` (~100M parameters, no MTP): a heavier model for benchmarks.

Each is written once as an ordinary Hugging Face-style directory under the cache dir and
loaded through the same loader as any other model.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from npu_worker.startup import ReportProgress, no_progress
from schemas.config import cache_dir

TINY_VERSION = "tiny-v3"
SMALL_VERSION = "small-v2"
BOS, EOS = "<|bos|>", "<|eos|>"
# A ChatML-style template over the presets' own special tokens, so chat requests work on them.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ bos_token }}{{ message['role'] }}\n"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant\n{% endif %}"
)
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "hidden_act": "silu",
}
SMALL_CONFIG = dict(
    TINY_CONFIG,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    head_dim=64,
)
SMALL_VOCAB = 16384
CORPUS = [
    "The pool reads requests from a stream and answers on another stream.",
    "Every request gets exactly one final chunk, and nothing accepted is lost.",
    "Decode comes first, then prefill chunks of one hundred and twenty-eight tokens.",
    "Hello, world! How are you today? Fine, thanks, and you?",
    "Once upon a time there was a small model that told short stories.",
    "def add(a, b):\n    return a + b\n",
    "Redis streams, consumer groups, fixed shapes, and greedy tokens that never change.",
    "Größe, naïve café, 東京, emoji 🙂 and other bytes decode without a split character.",
]


def ensure_tiny_model(root: Path | None = None) -> Path:
    """Path of the tiny model directory, building it first if it is not there yet."""
    return ensure_preset("tiny", root)


def ensure_preset(
    name: str, root: Path | None = None, progress: ReportProgress = no_progress
) -> Path:
    """Path of a preset model's directory (`tiny` or `small`), built once on first use."""
    version = {"tiny": TINY_VERSION, "small": SMALL_VERSION}[name]
    root = root or cache_dir() / "models"
    target = root / version
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{version}.lock", "w") as lock:
        progress(f"waiting for the {name} model build", 0, 1)
        fcntl.flock(lock, fcntl.LOCK_EX)  # ranks starting together build it once
        if not (target / "config.json").exists():
            staging = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=root))
            try:
                if name == "tiny":
                    build_tiny_model(staging, progress=progress)
                else:
                    build_small_model(staging, progress=progress)
                staging.rename(target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return target


def build_tiny_model(
    out: Path, vocab_size: int = 512, seed: int = 0, progress: ReportProgress = no_progress
) -> None:
    """Write config.json, generation_config.json, tokenizer.json and model.safetensors."""
    progress("building the tiny model: tokenizer", 0, 1)
    tokenizer = _train_tokenizer(vocab_size)
    _save_tokenizer(tokenizer, out)
    config = dict(
        TINY_CONFIG,
        vocab_size=tokenizer.get_vocab_size(),
        bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=tokenizer.token_to_id(EOS),
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})
    )
    weights = _random_weights(config, seed)
    save_file(weights, str(out / "model.safetensors"))
    from npu_worker.weights.tiny_mtp import fit_mtp  # needs the main weights on disk first

    weights |= fit_mtp(out, CORPUS, seed, progress)
    config["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, str(out / "model.safetensors"))


def build_small_model(out: Path, seed: int = 0, progress: ReportProgress = no_progress) -> None:
    """The ~100M-parameter preset: same tokenizer, a vocabulary padded to 16384 rows."""
    progress("building the small model", 0, 1)
    tokenizer = _train_tokenizer(512)
    _save_tokenizer(tokenizer, out)
    config = dict(
        SMALL_CONFIG,
        vocab_size=SMALL_VOCAB,
        bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=tokenizer.token_to_id(EOS),
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})
    )
    save_file(_random_weights(config, seed), str(out / "model.safetensors"))


def _save_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    """tokenizer.json, and tokenizer_config.json with the special tokens and chat template."""
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _train_tokenizer(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tokenizer


def _random_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Scaled normal weights: logits spread widely enough that greedy choices are clear."""
    generator = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads, head_dim = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    vocab = config["vocab_size"]

    def normal(*shape: int, fan_in: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) / fan_in**0.5

    weights = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=generator),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": normal(vocab, hidden, fan_in=hidden) * 4.0,
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": normal(heads * head_dim, hidden, fan_in=hidden),
            p + "self_attn.k_proj.weight": normal(kv_heads * head_dim, hidden, fan_in=hidden),
            p + "self_attn.v_proj.weight": normal(kv_heads * head_dim, hidden, fan_in=hidden),
            p + "self_attn.o_proj.weight": normal(
                hidden, heads * head_dim, fan_in=heads * head_dim
            ),
            p + "mlp.gate_proj.weight": normal(inter, hidden, fan_in=hidden),
            p + "mlp.up_proj.weight": normal(inter, hidden, fan_in=hidden),
            p + "mlp.down_proj.weight": normal(hidden, inter, fan_in=inter),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    return {name: tensor.contiguous() for name, tensor in weights.items()}
