"""A cache of blocks (`--kv-cache-memory`): a request's positions lie in whatever blocks the
planner handed it, in any order, and its logits are those of a slot that reserves every
position, bit for bit, with every layer kit: Llama's and DeepSeek-V3's caches, and
DeepSeek-V4's compressed entries and index keys (docs/architecture.md §3c)."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from npu_worker.devices import free_memory
from npu_worker.models.deepseek_v4.config import state_elements_in_blocks
from npu_worker.models.deepseek_v4.state import DeepseekV4State
from npu_worker.runner import LaunchRunner
from npu_worker.weights.loader import load_model
from npu_worker.weights.makers import deepseek_v3 as v3
from npu_worker.weights.makers import deepseek_v4 as v4
from npu_worker.weights.tiny import ensure_tiny_model
from schemas.config import Settings
from schemas.control import PrefillChunk
from tests.helpers import random_prompt
from tests.reference import launch_shapes, layer_kits

MAX_LEN = 256
BLOCK = 32
CHUNK = 64


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("blocks") / "v3"
    v3.build(path, q_lora=True, mtp=True)
    return path


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("blocks") / "v4"
    v4.build(path, "small", mtp=True)  # compression rates 4 and 16
    return path


def runners(path: Path, kit: str, dtype: str, mtp: bool) -> tuple[LaunchRunner, LaunchRunner]:
    """A runner whose slots reserve every position, and one over a pool of 24 blocks (and
    its 3 slots' own state: V4's rings and marks)."""
    loaded = load_model(path, dtype, torch.device("cpu"), MAX_LEN, mtp=mtp, kit=layer_kits()[kit]())
    shapes = launch_shapes(3, MAX_LEN, CHUNK, 4)
    slots = LaunchRunner(loaded.model, shapes)
    probe = loaded.model.new_state(1, BLOCK, BLOCK, 1)
    memory = 24 * BLOCK * probe.bytes_per_token + 3 * probe.fixed_bytes
    blocks = LaunchRunner(loaded.model, replace(shapes, block_size=BLOCK, kv_cache_memory=memory))
    assert (slots.kv_blocks, blocks.kv_blocks) == (0, 24)
    return slots, blocks


def run(runner: LaunchRunner, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Each prompt prefilled in its own slot (two packed into one launch where the runner
    packs), then `steps` greedy decode launches of every row: every launch's logits."""
    out: list[torch.Tensor] = []
    tokens: list[int] = []
    for slot, prompt in enumerate(prompts):
        logits = torch.empty(0)
        for start in range(0, len(prompt), CHUNK):
            part = prompt[start : start + CHUNK]
            chunk = PrefillChunk(slot=slot, start=start, num_tokens=len(part))
            logits = runner.prefill([chunk], [part]).logits[:, 0]
            out.append(logits)
        tokens.append(int(logits[0].argmax()))
    lengths = [len(p) for p in prompts]
    slots = list(range(len(prompts)))
    for _ in range(steps):
        logits = runner.decode(slots, tokens, lengths)
        out.append(logits)
        tokens = logits.argmax(-1).tolist()
        lengths = [n + 1 for n in lengths]
    return out


@pytest.mark.parametrize("kit", list(layer_kits()))
@pytest.mark.parametrize("model", ["llama", "v3", "v4"])
def test_blocks_in_any_order_give_the_logits_of_a_slot_reserving_every_position(
    kit: str, model: str, tiny_v3: Path, tiny_v4: Path
) -> None:
    path = {"llama": ensure_tiny_model(), "v3": tiny_v3, "v4": tiny_v4}[model]
    rng = random.Random(7)
    prompts = [random_prompt(rng, n, 200) for n in (70, 100, 5)]
    for dtype in ("float32", "bfloat16"):
        slots, blocks = runners(path, kit, dtype, mtp=False)
        order = list(range(24))
        rng.shuffle(order)  # each request's blocks scattered over the pool, out of order
        for slot, prompt in enumerate(prompts):
            need = -(-(len(prompt) + 12) // BLOCK)
            blocks.assign_blocks(slot, 0, [order.pop() for _ in range(need)])
        want, got = run(slots, prompts, 10), run(blocks, prompts, 10)
        assert len(want) == len(got)
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            assert torch.equal(a, b), f"{kit} {model} {dtype}: launch {i} differs"


def test_a_copied_block_holds_what_its_source_held(tiny_v3: Path) -> None:
    """`copy_blocks`: a request that starts on a shared prefix and writes into the block
    where the prefix ends gets a copy of that block first; its logits are a lone run's."""
    slots, blocks = runners(tiny_v3, "cpu", "bfloat16", mtp=False)
    rng = random.Random(3)
    shared = random_prompt(rng, 50, 200)
    second = shared + random_prompt(rng, 30, 200)
    blocks.assign_blocks(0, 0, [5, 9])  # positions 0..63 of the first request
    want = run(slots, [second], 0)
    run(blocks, [shared], 0)
    # the second request shares block 5 (positions 0..31) and copies block 9, where its
    # own tokens start (it takes positions 32..39 from the copy and computes 40..79)
    blocks.copy_blocks([(9, 11)])
    blocks.assign_blocks(1, 0, [5, 11, 12])
    chunk = PrefillChunk(slot=1, start=40, num_tokens=len(second) - 40)
    got = blocks.prefill([chunk], [second[40:]]).logits[:, 0]
    assert torch.equal(got, want[-1])


@pytest.mark.parametrize("computed", [30, 1])
def test_a_v4_slot_given_a_mark_goes_on_as_the_slot_that_took_it(
    tiny_v4: Path, computed: int
) -> None:
    """A prefix of two blocks shared with its mark (the rings where it ends): a request
    that computes `computed` tokens after it gets a lone run's logits; without the mark it
    does not. (V4's launches are unpacked, so a prefix's last token is never computed
    again: prefill resumes on a chunk's boundary.)"""
    slots, blocks = runners(tiny_v4, "cpu", "float32", mtp=False)
    assert blocks.kv_marks == 3
    rng = random.Random(5)
    shared = random_prompt(rng, 2 * BLOCK, 200)
    second = shared + random_prompt(rng, computed, 200)
    want = run(slots, [second], 0)[-1]
    blocks.assign_blocks(0, 0, [5, 9])
    blocks.prefill([PrefillChunk(slot=0, start=0, num_tokens=2 * BLOCK)], [shared])
    blocks.save_mark(0, 2)
    start = len(shared)
    for slot, mark in ((1, True), (2, False)):
        blocks.assign_blocks(slot, 0, [5, 9, 12])
        if mark:
            blocks.restore_mark(2, slot)
        chunk = PrefillChunk(slot=slot, start=start, num_tokens=len(second) - start)
        got = blocks.prefill([chunk], [second[start:]]).logits[:, 0]
        assert torch.equal(got, want) == mark


def test_a_share_of_free_memory_sizes_the_pool_of_blocks() -> None:
    """`--kv-cache-fraction`: the share of the host's available memory (split over the
    pool's ranks) in blocks, measured beside the rank's own reading of /proc/meminfo."""
    loaded = load_model(ensure_tiny_model(), "float32", torch.device("cpu"), MAX_LEN)
    shapes = replace(launch_shapes(2, MAX_LEN, CHUNK, 4), block_size=BLOCK)
    per_block = loaded.model.new_state(1, BLOCK, BLOCK, 1).bytes_per_token * BLOCK
    fraction = 128 * per_block / free_memory(torch.device("cpu"))  # 64 blocks a rank
    runner = LaunchRunner(
        loaded.model, replace(shapes, kv_cache_fraction=fraction, ranks_sharing=2)
    )
    assert 40 <= runner.kv_blocks <= 90  # 64 blocks give or take what others allocate
    assert runner.state.k[0].shape[0] == runner.kv_blocks + 1


def resident_bytes() -> int:
    """This process's resident memory (/proc/self/statm), in bytes."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def test_by_default_a_rank_takes_a_share_of_the_host_whose_pages_come_as_blocks_are_written() -> (
    None
):
    """The settings' default is a cache of blocks in 0.9 of the host's available memory over
    the pool's ranks. Its buffers are zeros the kernel maps on first use: the rank holds the
    blocks it writes or reads, not the share. `--kv-cache-fraction 0` keeps slots."""
    settings = Settings(model="tiny", device="cpu", ranks=2, max_model_len=MAX_LEN)
    loaded = load_model(ensure_tiny_model(), "float32", torch.device("cpu"), MAX_LEN)
    per_block = loaded.model.new_state(1, BLOCK, BLOCK, 1).bytes_per_token * settings.block_size
    before = resident_bytes()
    share = free_memory(torch.device("cpu")) * 0.9 / 2
    runner = LaunchRunner(loaded.model, settings.launch_shapes())
    assert settings.blocks and runner.kv_blocks > 0
    assert 0.8 * share <= runner.kv_blocks * per_block <= 1.1 * share
    buffers = [*runner.state.k, *runner.state.v]
    assert all(b.shape[0] == runner.kv_blocks + 1 for b in buffers)
    assert not any(b[-1].any() or b[5].any() for b in buffers)  # zeros (reading maps pages)
    for b in buffers:
        b[3] = 1.0  # one block written in every layer
    assert resident_bytes() - before < 0.01 * runner.kv_blocks * per_block
    assert all(torch.equal(b[3], torch.ones_like(b[3])) and not b[4].any() for b in buffers)

    slots = Settings(model="tiny", device="cpu", max_model_len=MAX_LEN, kv_cache_fraction=0)
    assert not slots.blocks
    assert LaunchRunner(loaded.model, slots.launch_shapes()).kv_blocks == 0


def test_a_v4_request_holds_its_rings_and_a_block_of_entries_per_block_size_positions(
    tiny_v4: Path,
) -> None:
    """What a cache of blocks allocates is what `state_elements_in_blocks` says: rings per
    slot, entries and index keys per block."""
    loaded = load_model(tiny_v4, "float32", torch.device("cpu"), MAX_LEN, mtp=True)
    state = loaded.model.new_state(3, MAX_LEN, BLOCK, 10)
    assert isinstance(state, DeepseekV4State) and state.paged
    fixed, per_block = state_elements_in_blocks(loaded.model.config, BLOCK, mtp=True)
    rings = [r.rows for r in state.window]
    rings += [r.rows for r in (*state.projections, *state.index_projections) if r is not None]
    blocks = [e.rows for e in (*state.entries, *state.index_keys) if e is not None]
    assert sum(r.numel() for r in rings) == 3 * fixed
    assert sum(b.numel() for b in blocks) == 11 * per_block  # and the scratch block
    assert state.bytes_per_token * BLOCK == per_block * 4
