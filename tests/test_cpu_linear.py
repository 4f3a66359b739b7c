"""bfloat16 linear layers on packed oneDNN weights (npu_worker/models/cpu_linear.py): the
same bits as unpacked ones in every launch kind, and a row's logits still do not depend on
what shares its launch; float32 layers are left as they are."""

from __future__ import annotations

import random

import pytest
import torch

from npu_worker.models.cpu_linear import pack_linears, packing_available
from npu_worker.models.loader import LoadedModel, load_model
from npu_worker.models.presets import resolve_model_dir
from npu_worker.runner import LaunchRunner
from tests.helpers import launch_shapes, random_prompt

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch built without oneDNN")
MAX_KV_LEN = 320


def tiny(dtype: str) -> LoadedModel:
    return load_model(resolve_model_dir("tiny"), dtype, torch.device("cpu"), MAX_KV_LEN, mtp=True)


def launches(loaded: LoadedModel, packed: bool) -> list[torch.Tensor]:
    """Logits of chunked prefills, a B8 decode of four rows, one row alone, and an MTP
    verify and draft, on a fresh cache (packing the linears first with `packed`)."""
    shapes = launch_shapes(8, MAX_KV_LEN, 128, 4)
    runner = LaunchRunner(loaded.model, shapes, packed_linears=packed)
    assert ("packed-linears" in runner.backend.name) == packed
    rng = random.Random(5)
    prompts = [random_prompt(rng, n, loaded.config.vocab_size) for n in (9, 60, 140, 3)]
    out = []
    for slot, prompt in enumerate(prompts):
        for start in range(0, len(prompt), 128):
            out.append(runner.prefill(slot, prompt[start : start + 128], start))
    positions = [len(p) for p in prompts]
    out.append(runner.decode([0, 1, 2, 3], [5, 6, 7, 8], positions))
    out.append(runner.decode([2], [9], [positions[2] + 1]))
    for slot, position in zip(range(4), positions):
        runner.set_tail(slot, 5, position + 1, 6)
    verify = runner.verify([0, 1, 2, 3], max(positions) + 2)
    out += [verify.logits, verify.drafts.float()]
    return out


def test_packed_bfloat16_linears_give_the_unpacked_bits() -> None:
    loaded = tiny("bfloat16")
    plain = launches(loaded, packed=False)
    packed = launches(loaded, packed=True)
    assert all(
        getattr(m, "packed_weight", None) is not None
        for m in loaded.model.modules()
        if isinstance(m, torch.nn.Linear)
    )
    for i, (want, got) in enumerate(zip(plain, packed)):
        assert torch.equal(want, got), f"launch {i}"


def test_a_rows_bfloat16_logits_do_not_depend_on_its_launch_with_packed_linears() -> None:
    loaded = tiny("bfloat16")
    runner = LaunchRunner(loaded.model, launch_shapes(8, MAX_KV_LEN, 128, 4))
    assert "packed-linears" in runner.backend.name
    rng = random.Random(6)
    prompts = [random_prompt(rng, n, loaded.config.vocab_size) for n in (30, 100, 7, 64)]
    for slot, prompt in enumerate(prompts):
        runner.prefill(slot, prompt, 0)
    positions = [len(p) for p in prompts]
    together = runner.decode([0, 1, 2, 3], [5, 6, 7, 8], positions)
    for row in range(4):  # the same token at the same position again: the same K/V written
        alone = runner.decode([row], [5 + row], [positions[row]])
        assert torch.equal(alone[0], together[row]), f"row {row}"


def test_float32_linears_are_not_packed() -> None:
    loaded = tiny("float32")
    assert pack_linears(loaded.model) == 0
    runner = LaunchRunner(loaded.model, launch_shapes(8, MAX_KV_LEN, 128, 4))
    assert "packed-linears" not in runner.backend.name
