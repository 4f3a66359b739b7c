"""Fitting the tiny model's MTP module to the main model's own greedy continuations, so
that its drafts are often right and the demo shows real acceptance."""

from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from npu_worker.models.launch import LaunchInputs
from npu_worker.models.llama.config import LlamaConfig
from npu_worker.models.llama.model import CausalLM
from npu_worker.runner import LaunchRunner
from npu_worker.startup import ReportProgress, no_progress
from npu_worker.weights.loader import load_model
from schemas.control import PrefillChunk
from schemas.registry import LaunchShapes

SEQUENCES, PROMPT_LEN, LENGTH, STEPS = 64, 8, 64, 100
FITTING = "building the tiny model: fitting its MTP module"


def fit_mtp(
    path: Path, corpus: list[str], seed: int = 0, progress: ReportProgress = no_progress
) -> dict[str, torch.Tensor]:
    """Train fresh `mtp.*` weights against the main model in `path`; returns them."""
    with torch.enable_grad():  # callers (a worker) may have turned autograd off
        return _fit(path, corpus, seed, progress)


def _fit(
    path: Path, corpus: list[str], seed: int, progress: ReportProgress
) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    config = LlamaConfig.from_dir(path)
    model = CausalLM(config, max_positions=LENGTH, with_mtp=True)
    weights = {k: v for k, v in _load(path).items()}
    model.load_state_dict(weights, strict=False)
    _init_mtp(model, config)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    progress(FITTING, 0, STEPS + 1)
    sequences, hidden = _greedy_data(path, config, tokenizer, corpus, seed)
    optimizer = torch.optim.Adam(model.mtp.parameters(), lr=6e-3)  # type: ignore[union-attr]
    positions = torch.arange(LENGTH).expand(SEQUENCES, LENGTH)
    cos, sin = model.rope(positions)
    launch = LaunchInputs(
        sequences,
        positions,
        torch.arange(SEQUENCES),
        torch.zeros(SEQUENCES, 1, dtype=torch.long),
        LENGTH,
        0,
    )
    for step in range(STEPS):
        progress(FITTING, step + 1, STEPS + 1)
        next_tokens = torch.roll(sequences, -1, dims=1)
        embedded = model.model.embed_tokens(next_tokens).detach()
        out = model.mtp(hidden, embedded, cos, sin, launch, None)  # type: ignore[misc]
        logits = model.lm_head(out[:, : LENGTH - 2])
        loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), sequences[:, 2:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {f"mtp.{k}": v.detach().clone().contiguous() for k, v in model.mtp.state_dict().items()}  # type: ignore[union-attr]


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _init_mtp(model: CausalLM, config: LlamaConfig) -> None:
    for name, param in model.mtp.named_parameters():  # type: ignore[union-attr]
        if name.endswith("weight") and param.dim() == 2:
            torch.nn.init.normal_(param, std=param.shape[1] ** -0.5)
    for param in [*model.model.parameters(), *model.lm_head.parameters()]:
        param.requires_grad_(False)


def _greedy_data(
    path: Path, config: LlamaConfig, tokenizer: Tokenizer, corpus: list[str], seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy continuations of text and random prompts, and their final hidden states, as a
    rank on this CPU computes them (its layer kit; the model being fitted has torch's
    layers, since fitting needs autograd)."""
    rng = random.Random(seed)
    model = load_model(path, "float32", torch.device("cpu"), LENGTH).model
    shapes = LaunchShapes(
        decode_batch=SEQUENCES,
        prefill_chunk=LENGTH,
        prefill_segments=1,
        num_slots=SEQUENCES,
        max_kv_len=LENGTH,
        mtp=False,
    )
    runner = LaunchRunner(model, shapes)
    prompts = []
    for i in range(SEQUENCES):
        if i % 2:
            ids = tokenizer.encode(rng.choice(corpus)).ids[:PROMPT_LEN]
        else:
            ids = [rng.randrange(2, config.vocab_size) for _ in range(PROMPT_LEN)]
        prompts.append((ids + [rng.randrange(2, config.vocab_size)] * PROMPT_LEN)[:PROMPT_LEN])
    tokens = [list(p) for p in prompts]
    last = [
        int(runner.prefill([PrefillChunk(slot, 0, len(p))], [p]).logits.argmax())
        for slot, p in enumerate(prompts)
    ]
    for step in range(LENGTH - PROMPT_LEN):
        for seq, token in zip(tokens, last):
            seq.append(token)
        if step == LENGTH - PROMPT_LEN - 1:
            break
        positions = [len(seq) - 1 for seq in tokens]
        last = runner.decode(list(range(SEQUENCES)), last, positions).argmax(-1).tolist()
    sequences = torch.tensor(tokens)
    hidden = torch.cat(
        [
            runner.prefill([PrefillChunk(slot, 0, len(seq))], [seq]).hidden
            for slot, seq in enumerate(tokens)
        ]
    )
    return sequences, hidden.detach()
