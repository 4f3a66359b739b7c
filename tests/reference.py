"""References for exactness checks, computed another way than the pool computes them: a lone
greedy request run straight on a rank's launches, and `transformers`' greedy generate."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from npu_worker.kernels import kit_for
from npu_worker.models.kit import LayerKit, TorchKit
from npu_worker.models.launch import LaunchModel
from npu_worker.runner import LaunchRunner
from npu_worker.weights.loader import load_model
from schemas.control import PrefillChunk
from schemas.registry import LaunchShapes


@dataclass(slots=True)
class ReferenceCompletion:
    """Greedy tokens of a request run alone, with the top-2 logit gap at each position."""

    token_ids: list[int]
    top2_gaps: list[float]


def launch_shapes(
    num_slots: int, max_kv_len: int, prefill_chunk: int, decode_batch: int, segments: int = 8
) -> LaunchShapes:
    """The shapes of a runner built by hand in a test (MTP follows the model)."""
    return LaunchShapes(
        decode_batch=decode_batch,
        prefill_chunk=prefill_chunk,
        prefill_segments=segments,
        num_slots=num_slots,
        max_kv_len=max_kv_len,
        mtp=False,
    )


def prefill_logits(
    runner: LaunchRunner, slot: int, token_ids: list[int], start: int
) -> torch.Tensor:
    """One prefill launch of `token_ids` from position `start` of `slot`: the [1, vocab]
    logits after its last token."""
    chunk = PrefillChunk(slot=slot, start=start, num_tokens=len(token_ids))
    return runner.prefill([chunk], [token_ids]).logits[:, 0]


def generate_alone(
    runner: LaunchRunner,
    prompt_ids: list[int],
    max_tokens: int,
    stop_ids: set[int],
    max_model_len: int,
    slot: int = 0,
    adjust: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None,
) -> ReferenceCompletion:
    """Prefill `prompt_ids` chunk by chunk in `slot`, then decode one row at a time;
    `adjust(logits [vocab], output so far)` changes each step's logits before the choice."""
    chunk = runner.prefill_chunk
    logits = torch.empty(0)
    for start in range(0, len(prompt_ids), chunk):
        logits = prefill_logits(runner, slot, prompt_ids[start : start + chunk], start)
    tokens: list[int] = []
    gaps: list[float] = []
    context = list(prompt_ids)
    while True:
        if adjust is not None:
            logits = adjust(logits[0].float(), tokens)[None]
        top2 = logits[0].topk(2).values
        gaps.append(float(top2[0] - top2[1]))
        token = int(logits[0].argmax())
        tokens.append(token)
        context.append(token)
        if token in stop_ids or len(tokens) >= max_tokens or len(context) >= max_model_len:
            return ReferenceCompletion(tokens, gaps)
        logits = runner.decode([slot], [token], [len(context) - 1])


def first_divergence(
    actual: list[int], reference: ReferenceCompletion, tie_tolerance: float
) -> str | None:
    """None if `actual` matches the reference up to a near-tie, else why not (see
    docs/architecture.md §7)."""
    for i, (got, want) in enumerate(zip(actual, reference.token_ids)):
        if got != want:
            gap = reference.top2_gaps[i]
            if gap <= tie_tolerance:
                return None
            return f"token {i}: got {got}, reference {want} (top-2 gap {gap:.3g} is no tie)"
    if len(actual) != len(reference.token_ids):
        return f"length {len(actual)} != reference length {len(reference.token_ids)}"
    return None


def lone_runs(
    path: Path, dtype: str, prompts: list[list[int]], max_tokens: int, max_model_len: int
) -> list[ReferenceCompletion]:
    """Each prompt run alone, one row a launch, on one rank holding the whole model (every
    expert, no MTP), EOS ignored."""
    loaded = load_model(path, dtype, torch.device("cpu"), max_model_len)
    runner = LaunchRunner(loaded.model, launch_shapes(1, max_model_len, 128, 1))
    return [generate_alone(runner, p, max_tokens, set(), max_model_len) for p in prompts]


def layer_kits() -> dict[str, Callable[[], LayerKit]]:
    """Every layer kit a CPU rank can be built with: plain torch layers (what graph backends
    capture), the CPU's with its kernels, and without them (`--no-decode-kernel`)."""
    cpu = torch.device("cpu")
    return {
        "torch": TorchKit,
        "cpu": lambda: kit_for(cpu),
        "cpu-without-kernels": lambda: kit_for(cpu, decode_kernel=False),
    }


def beside_differs(
    model: LaunchModel[Any], shapes: LaunchShapes, prompts: list[list[int]], tie_tolerance: float
) -> str | None:
    """Each prompt run alone on a runner of `model`, then all of them prefilled on a second
    runner (a state of its own) and decoded in one launch: None when every row's second
    token is its lone run's (or a near-tie of it), else which is not."""
    alone_runner, beside = LaunchRunner(model, shapes), LaunchRunner(model, shapes)
    max_len = shapes.max_kv_len
    alone = [
        generate_alone(alone_runner, p, 2, set(), max_len, slot=s) for s, p in enumerate(prompts)
    ]
    chunk = beside.prefill_chunk
    for slot, prompt in enumerate(prompts):
        for start in range(0, len(prompt), chunk):
            prefill_logits(beside, slot, prompt[start : start + chunk], start)
    slots, positions = list(range(len(prompts))), [len(p) for p in prompts]
    together = beside.decode(slots, [r.token_ids[0] for r in alone], positions)
    for slot, reference in enumerate(alone):
        got, want, gap = (
            int(together[slot].argmax()),
            reference.token_ids[1],
            reference.top2_gaps[1],
        )
        if got != want and gap > tie_tolerance:
            return f"prompt of {positions[slot]}: {got} beside others, {want} alone"
    return None


def hf_greedy(model: Any, prompt: list[int], max_tokens: int) -> ReferenceCompletion:
    """transformers' greedy generate (of a `transformers` model), with the top-2 gap of every
    step's logits."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return ReferenceCompletion(out.sequences[0, len(prompt) :].tolist(), gaps)
