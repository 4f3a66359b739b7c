"""The tokenizer a GGUF file describes, as a `tokenizers` byte-level BPE (`tokenizer.json`),
and its special tokens and chat template (`tokenizer_config.json`).

A GGUF stores the vocabulary, the merges, a type per token and the special token ids as
metadata (`tokenizer.ggml.*`). The text is split before BPE the way llama.cpp splits it for
the file's pre-tokenizer type (`tokenizer.ggml.pre`): the split the vocabulary was made with.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from npu_worker.models.config import UnsupportedModel
from npu_worker.weights.gguf.reader import metadata

# llama.cpp token types (`tokenizer.ggml.token_type`)
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4
# The split patterns of the Llama 3 and Qwen2 families (they differ in digit runs).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# llama.cpp's pre-tokenizer names (`tokenizer.ggml.pre`); an absent one or `default` gets
# GPT-2's split, as transformers reads such files.
GPT2_PRE_TYPES = {"default", "gpt-2", "mpt", "olmo", "jais", "exaone4"}
SPLIT_PRE_TYPES = {
    "llama-bpe": LLAMA3_SPLIT,
    "llama3": LLAMA3_SPLIT,
    "llama-v3": LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT,
}
# pre-tokenizer types that split every digit on its own before the GPT-2 split
DIGIT_PRE_TYPES = {
    "smollm",
    "starcoder",
    "refact",
    "command-r",
    "codeshell",
    "exaone",
    "minerva-7b",
}
SPECIAL_TOKEN_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def pre_type(reader: Any) -> str:
    """The file's pre-tokenizer type; raises UnsupportedModel for one this import lacks."""
    model = metadata(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise UnsupportedModel(
            f"GGUF tokenizer model {model!r} is not supported; only byte-level BPE ('gpt2')"
        )
    kind = str(metadata(reader, "tokenizer.ggml.pre", "default"))
    known = GPT2_PRE_TYPES | DIGIT_PRE_TYPES | set(SPLIT_PRE_TYPES)
    if kind not in known:
        raise UnsupportedModel(
            f"GGUF pre-tokenizer {kind!r} is not supported; supported: {sorted(known)}"
        )
    return kind


def _pre_tokenizer(kind: str, add_prefix_space: bool) -> pre_tokenizers.PreTokenizer:
    if kind in SPLIT_PRE_TYPES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(SPLIT_PRE_TYPES[kind]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    if kind in DIGIT_PRE_TYPES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _vocabulary(tokens: list[str], token_types: list[int]) -> dict[str, int]:
    """Token text -> id. Normal tokens are in the byte alphabet already; one that is not
    is respelled in it, as the BPE model sees text only after the byte-level mapping."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spell = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        kind = token_types[token_id] if token_id < len(token_types) else NORMAL
        if kind == NORMAL and not set(token) <= alphabet:
            token = "".join(piece for piece, _ in spell.pre_tokenize_str(token))
        vocab.setdefault(token, token_id)
    return vocab


def build_tokenizer(reader: Any) -> Tokenizer:
    """The byte-level BPE tokenizer of the file, with its control and user tokens whole."""
    kind = pre_type(reader)
    tokens = [str(t) for t in metadata(reader, "tokenizer.ggml.tokens", [])]
    if not tokens:
        raise UnsupportedModel("GGUF metadata lacks tokenizer.ggml.tokens")
    token_types = [int(t) for t in metadata(reader, "tokenizer.ggml.token_type", [])]
    merges = [tuple(m.split(" ", 1)) for m in metadata(reader, "tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(
        models.BPE(
            vocab=_vocabulary(tokens, token_types),
            merges=merges,
            fuse_unk=False,
            ignore_merges=kind in SPLIT_PRE_TYPES and SPLIT_PRE_TYPES[kind] == LLAMA3_SPLIT,
        )
    )
    add_prefix = bool(metadata(reader, "tokenizer.ggml.add_space_prefix", False))
    tokenizer.pre_tokenizer = _pre_tokenizer(kind, add_prefix)
    tokenizer.decoder = decoders.ByteLevel()
    by_type = list(zip(tokens, token_types))
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in by_type if k == CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in by_type if k == USER_DEFINED]
    )
    tokenizer.post_processor = _post_processor(reader, tokens)
    return tokenizer


def _post_processor(reader: Any, tokens: list[str]) -> processors.PostProcessor | None:
    """BOS / EOS around every encoded text when the file asks for them (llama.cpp's
    `add_bos_token` / `add_eos_token`; byte-level vocabularies add neither unless told)."""
    added: dict[str, tuple[str, int] | None] = {}
    for side in ("bos", "eos"):
        token_id = metadata(reader, f"tokenizer.ggml.{side}_token_id")
        wanted = metadata(reader, f"tokenizer.ggml.add_{side}_token", False)
        added[side] = (tokens[token_id], int(token_id)) if wanted and token_id is not None else None
    bos, eos = added["bos"], added["eos"]
    if bos is None and eos is None:
        return None
    single = [f"{t[0]}:0" for t in (bos,) if t] + ["$A:0"] + [f"{t[0]}:0" for t in (eos,) if t]
    special = [t for t in (bos, eos) if t is not None]
    return processors.TemplateProcessing(single=" ".join(single), special_tokens=special)


def tokenizer_config(reader: Any) -> dict[str, Any]:
    """`tokenizer_config.json`: special tokens by text, BOS/EOS flags and the chat template."""
    tokens = metadata(reader, "tokenizer.ggml.tokens", [])
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name, key in SPECIAL_TOKEN_IDS.items():
        token_id = metadata(reader, key)
        if token_id is not None and 0 <= token_id < len(tokens):
            config[name] = str(tokens[token_id])
    config["add_bos_token"] = bool(metadata(reader, "tokenizer.ggml.add_bos_token", False))
    config["add_eos_token"] = bool(metadata(reader, "tokenizer.ggml.add_eos_token", False))
    template = metadata(reader, "tokenizer.chat_template")
    if template:
        config["chat_template"] = str(template)
    return config
