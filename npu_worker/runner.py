"""The fixed-shape launches of one rank.

Prefill is B1S`prefill_chunk`; decode is B`decode_batch`S1, or with MTP the verify launch
B`decode_batch`S2 (row = [last committed token, draft]) followed by the MTP draft launch
of the same shape. Only these shapes ever reach the model; inputs are padded explicitly
and the KV cache is allocated once. A decode launch reads the cache in place when its
rows fit in a window of `decode_batch` consecutive slots, and only the first `span`
positions (a multiple of `prefill_chunk` at or above the longest context).

With MTP, each request's committed tail (last committed token, its position, the draft)
lives in a per-rank pool indexed by KV slot, on the device: a verify launch gathers its
rows from it once and `commit` scatters them back once.

One entry per launch kind: `prefill` (chunks of one or several requests, as
`schemas.control.PrefillChunk` with their tokens) and its MTP draft `draft_prefill`,
`decode` (rows), `verify` (rows) with its draft `commit`, and `dummy_prefill` (lockstep).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from npu_worker.backends import make_backend
from npu_worker.devices import free_memory
from npu_worker.models.launch import LaunchInputs, LaunchModel, LaunchOutput
from npu_worker.prefill_inputs import PrefillLayout
from npu_worker.startup import ReportProgress, no_progress
from schemas.control import PrefillChunk
from schemas.registry import LaunchShapes


@dataclass(slots=True)
class TailPool:
    """Committed-tail state of every slot: token, position (not yet in the cache), draft."""

    token: torch.Tensor  # [slots] long
    position: torch.Tensor  # [slots] long
    draft: torch.Tensor  # [slots] long


@dataclass(slots=True)
class Layout:
    """Where a launch's rows sit: row i reads slot `slot_ids[i]`; `rows` maps inputs to rows."""

    window_start: int | None
    rows: list[int]
    slot_ids: list[int]


@dataclass(slots=True)
class Verify:
    """A verify launch's results, for acceptance and then `commit`."""

    layout: Layout
    slots: torch.Tensor  # [n] the requests' slots
    logits: torch.Tensor  # [n, 2, vocab]
    hidden: torch.Tensor  # [B, 2, hidden]
    drafts: torch.Tensor  # [n]
    positions: torch.Tensor  # [n] position of each row's last committed token
    span: int


EAGER_SPAN_STEP = 32


class LaunchRunner:
    """Runs prefill, decode, and MTP verify/draft launches of one rank on its device."""

    def __init__(
        self, model: LaunchModel[Any], shapes: LaunchShapes, cuda_graphs: bool = True
    ) -> None:
        self.mtp = model.mtp is not None
        self.model_packs = model.packs
        # where its kit keeps rows apart, a decode row is a one-token segment's bits
        self.model_decode_rows_pack = model.decode_rows_pack
        self.kit = model.kit
        # what this rank runs, as it registers it: verify launches only with an MTP module
        self.shapes = replace(shapes, mtp=self.mtp)
        self.prefill_segments = shapes.prefill_segments  # packed launches: segments, at most
        self.prefill_chunk = shapes.prefill_chunk
        self.decode_batch = decode_batch = shapes.decode_batch
        num_slots = shapes.num_slots
        num_blocks = cache_blocks(model, shapes)
        self.state = model.new_state(num_slots, shapes.max_kv_len, shapes.block_size, num_blocks)
        self.device = self.state.device
        self.backend = make_backend(model, self.state, self.device, cuda_graphs)
        # graph backends capture one shape per span, so spans are whole prefill chunks;
        # eager ones capture nothing and read only as far as the context needs
        self.span_step = self.prefill_chunk if not self.backend.reads_in_place else EAGER_SPAN_STEP
        zeros = torch.zeros(num_slots, dtype=torch.long, device=self.device)
        self.tail = TailPool(zeros.clone(), zeros.clone(), zeros.clone())
        self.decode_logit_index = torch.zeros(decode_batch, 1, dtype=torch.long, device=self.device)
        self.num_launches = {"prefill": 0, "decode": 0}
        self.launches: list[str] = []  # program and shape of each launch, cleared per step
        self.launch_seconds: list[tuple[str, float]] = []  # (shape, time in it), per step

    @property
    def prefix_cacheable(self) -> bool:
        """True when one slot's first positions can be copied to another."""
        return self.state.prefix_cacheable

    def copy_prefix(self, source: int, target: int, num_tokens: int) -> None:
        """Slot `target` takes `source`'s state for its first `num_tokens` positions."""
        self.state.copy_prefix(source, target, num_tokens)

    @property
    def kv_blocks(self) -> int:
        """Cache blocks the planner hands out (0: each slot reserves every position)."""
        return self.state.num_blocks if self.state.paged else 0

    def assign_blocks(self, slot: int, start: int, blocks: list[int]) -> None:
        """A slot's block table from entry `start` on (from 0: a new request's)."""
        self.state.assign(slot, start, blocks)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Each pair's target block takes its source block's entries."""
        self.state.copy_blocks(pairs)

    @property
    def kv_marks(self) -> int:
        """Marks the planner hands out: copies of a slot's state outside blocks at a block
        boundary, which a shared prefix needs beside its blocks (0: blocks suffice)."""
        return self.state.num_marks

    def save_mark(self, slot: int, mark: int) -> None:
        """Mark `mark` takes a copy of the slot's state outside blocks."""
        self.state.save_mark(slot, mark)

    def restore_mark(self, mark: int, slot: int) -> None:
        """The slot's state outside blocks becomes mark `mark`'s copy."""
        self.state.restore_mark(mark, slot)

    @property
    def packs(self) -> bool:
        """True when prefill launches may carry several requests' segments."""
        return self.backend.packs and self.model_packs

    @property
    def mixes(self) -> bool:
        """True when a decode row may ride in a packed prefill launch as a one-token segment
        and get the bits a decode launch gives it: an eager backend whose kit's products
        keep rows apart, a model whose decode rows and prefill tokens take the same layers,
        and no MTP (a verify row is two tokens and a draft)."""
        return (
            self.packs
            and not self.mtp
            and self.backend.reads_in_place
            and bool(getattr(self.kit, "rows_apart", False))
            and self.model_decode_rows_pack
        )

    def spans(self) -> list[int]:
        """Every cache span a launch may read: the captured shapes of graph backends."""
        return list(range(self.prefill_chunk, self.state.max_kv_len + 1, self.prefill_chunk))

    def span_for(self, context_len: int) -> int:
        """Cache positions a launch reads: whole `span_step`s covering `context_len`."""
        steps = -(-context_len // self.span_step)
        return min(self.state.max_kv_len, steps * self.span_step)

    def warm_up(self, progress: ReportProgress = no_progress) -> None:
        """Run (and so capture, on graph backends) every launch shape before any request."""
        spans = self.spans()
        for done, span in enumerate(spans):
            progress("warm-up: launch shapes per cache span", done, len(spans))
            self.dummy_prefill(span)
            self.backend.run(self._padding_launch(1, span))
            if self.mtp:
                launch = self._padding_launch(2, span)
                hidden = self.backend.run(launch).hidden
                self.backend.draft(launch, hidden)
        progress("warm-up: launch shapes per cache span", len(spans), len(spans))
        self.num_launches = {"prefill": 0, "decode": 0}
        self.launches.clear()
        self.launch_seconds.clear()

    # -- prefill --------------------------------------------------------------------------

    def prefill(self, chunks: list[PrefillChunk], token_ids: list[list[int]]) -> LaunchOutput:
        """One B1S`prefill_chunk` launch of `chunks` (chunk j feeding `token_ids[j]`, its
        `num_tokens` tokens, from position `chunks[j].start` of its slot): logits
        [1, chunks, vocab] at each chunk's last token, hidden states of all. Several chunks
        only where the runner packs."""
        return self._launch("prefill", self._prefill_inputs(chunks, token_ids))

    def draft_prefill(
        self, chunks: list[PrefillChunk], hidden: torch.Tensor, next_ids: list[list[int]]
    ) -> list[int]:
        """MTP over a prefill launch (fills the MTP cache layer): the draft after each
        chunk's end. `next_ids[j][i]` is the token after chunk j's position i: the next
        prompt token, or the sampled first token for the prompt's last position."""
        drafted = self._launch("draft", self._prefill_inputs(chunks, next_ids), hidden)
        return drafted[0, : len(chunks)].argmax(-1).tolist()

    def dummy_prefill(self, span: int | None = None) -> None:
        """A prefill launch (and its MTP draft launch) that touches only scratch positions:
        the lockstep filler, the same launches a real chunk runs."""
        scratch = self.state.scratch_position
        launch = LaunchInputs(
            input_ids=self._tensor([[0] * self.prefill_chunk]),
            positions=self._tensor([[scratch] * self.prefill_chunk]),
            slot_ids=self._tensor([0]),
            logit_index=self._tensor([[0] * self.prefill_segments]),
            span=span or self.prefill_chunk,
            window_start=0 if self.backend.reads_in_place else None,
        )
        out = self._launch("prefill", launch)
        if self.mtp:
            self._launch("draft", launch, out.hidden)

    def set_tail(self, slot: int, token: int, position: int, draft: int) -> None:
        """Start a request's committed tail after its prompt."""
        self.tail.token[slot], self.tail.position[slot], self.tail.draft[slot] = (
            token,
            position,
            draft,
        )

    def _prefill_inputs(
        self, chunks: list[PrefillChunk], token_ids: list[list[int]]
    ) -> LaunchInputs:
        """A prefill launch's inputs: packed where the runner packs, else one chunk."""
        layout = PrefillLayout(
            self.prefill_chunk,
            self.state.scratch_position,
            self.backend.reads_in_place,
            self.prefill_segments,
            self.device,
        )
        if self.packs:
            return layout.packed(chunks, token_ids, self.span_for)
        if len(chunks) != 1:
            raise ValueError(f"this runner does not pack: {len(chunks)} chunks in one launch")
        return layout.single(chunks[0].slot, token_ids[0], chunks[0].start)

    # -- decode ---------------------------------------------------------------------------

    def decode(self, slots: list[int], token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """One B`decode_batch`S1 launch for up to `decode_batch` rows; [len(slots), vocab] logits.

        Row r feeds `token_ids[r]` at `positions[r]` of slot `slots[r]`; padding rows write
        only to the scratch position.
        """
        layout = self._layout(slots)
        batch = self.decode_batch
        ids = [0] * batch
        launch_positions = [self.state.scratch_position] * batch
        for row, token, position in zip(layout.rows, token_ids, positions):
            ids[row], launch_positions[row] = token, position
        inputs = self._tensor([ids, launch_positions, layout.slot_ids])  # one host copy
        launch = LaunchInputs(
            input_ids=inputs[0].view(batch, 1),
            positions=inputs[1].view(batch, 1),
            slot_ids=inputs[2],
            logit_index=self.decode_logit_index,
            span=self.span_for(max(positions) + 1 if positions else 1),
            window_start=layout.window_start,
        )
        return self._rows(self._launch("decode", launch).logits[:, 0], layout.rows)

    def verify(self, slots: list[int], max_position: int) -> Verify:
        """One B`decode_batch`S2 launch: each row feeds [last committed token, draft]."""
        layout = self._layout(slots)
        batch = self.decode_batch
        rows = self._tensor(layout.rows)
        slot_index = self._tensor(slots)
        row_slots = torch.zeros(batch, dtype=torch.long, device=self.device)
        row_slots[rows] = slot_index
        real = torch.zeros(batch, dtype=torch.bool, device=self.device)
        real[rows] = True
        tokens = torch.stack((self.tail.token[row_slots], self.tail.draft[row_slots]), dim=1)
        base = self.tail.position[row_slots]
        positions = torch.stack((base, base + 1), dim=1)
        span = self.span_for(max_position + 2)
        launch = LaunchInputs(
            input_ids=torch.where(real[:, None], tokens, 0),
            positions=torch.where(real[:, None], positions, self.state.scratch_position),
            slot_ids=self._tensor(layout.slot_ids),
            logit_index=self._tensor([[0, 1]] * batch),
            span=span,
            window_start=layout.window_start,
        )
        out = self._launch("decode", launch)
        return Verify(
            layout,
            slot_index,
            out.logits[rows],
            out.hidden,
            self.tail.draft[slot_index],
            self.tail.position[slot_index],
            span,
        )

    def commit(
        self, verify: Verify, first: torch.Tensor, second: torch.Tensor, accepted: torch.Tensor
    ) -> torch.Tensor:
        """Run the MTP draft launch on what each row committed and scatter the new tails.

        Row inputs: (hidden at the last committed position, first committed token) and, if
        the draft was accepted, (hidden at the draft's position, second token). Returns the
        new drafts.
        """
        batch = self.decode_batch
        rows = self._tensor(verify.layout.rows)
        next_ids = torch.zeros(batch, 2, dtype=torch.long, device=self.device)
        next_ids[rows] = torch.stack((first, second), dim=1)
        scratch = self.state.scratch_position
        positions = torch.full((batch, 2), scratch, dtype=torch.long, device=self.device)
        positions[rows, 0] = verify.positions
        positions[rows, 1] = torch.where(accepted, verify.positions + 1, scratch)
        logit_index = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        logit_index[rows, 0] = accepted.long()
        launch = LaunchInputs(
            next_ids,
            positions,
            self._tensor(verify.layout.slot_ids),
            logit_index,
            verify.span,
            verify.layout.window_start,
        )
        drafts = self._launch("draft", launch, verify.hidden)[rows, 0].argmax(-1)
        self.tail.token[verify.slots] = torch.where(accepted, second, first)
        self.tail.position[verify.slots] = verify.positions + 1 + accepted.long()
        self.tail.draft[verify.slots] = drafts
        return drafts

    def _launch(self, kind: str, launch: LaunchInputs, hidden: Any = None) -> Any:
        """Run one launch of `kind` (prefill, decode, or an MTP draft over `hidden`),
        counted and timed: a LaunchOutput, or a draft's logits."""
        shape = f"B{launch.input_ids.shape[0]}S{launch.input_ids.shape[1]}"
        timed = shape if kind != "draft" else f"draft {shape}"
        if kind != "draft":
            self.num_launches[kind] += 1
        self.launches.append(f"{kind} {shape}")
        began = time.perf_counter()
        out = self.backend.run(launch) if kind != "draft" else self.backend.draft(launch, hidden)
        self.launch_seconds.append((timed, time.perf_counter() - began))
        return out

    # -- layout ---------------------------------------------------------------------------

    def _layout(self, slots: list[int]) -> Layout:
        """Rows on a window of consecutive slots where they fit, else gathered by slot id."""
        batch, num_slots = self.decode_batch, self.state.num_slots
        if len(slots) > batch:
            raise ValueError(f"{len(slots)} rows exceed decode_batch={batch}")
        in_place = self.backend.reads_in_place
        if in_place and slots and num_slots >= batch and max(slots) - min(slots) < batch:
            start = min(min(slots), num_slots - batch)
            return Layout(start, [s - start for s in slots], list(range(start, start + batch)))
        padding = [slots[0] if slots else 0] * (batch - len(slots))
        return Layout(None, list(range(len(slots))), list(slots) + padding)

    def _padding_launch(self, seq: int, span: int) -> LaunchInputs:
        batch = self.decode_batch
        return LaunchInputs(
            input_ids=torch.zeros(batch, seq, dtype=torch.long, device=self.device),
            positions=torch.full(
                (batch, seq), self.state.scratch_position, dtype=torch.long, device=self.device
            ),
            slot_ids=torch.zeros(batch, dtype=torch.long, device=self.device),
            logit_index=torch.zeros(batch, seq, dtype=torch.long, device=self.device),
            span=span,
            window_start=None,
        )

    def _rows(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """`logits` of `rows`, in order: a view when they are consecutive (the usual case)."""
        first = rows[0] if rows else 0
        if rows == list(range(first, first + len(rows))):
            return logits[first : first + len(rows)]
        return logits[self._tensor(rows)]

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


def cache_blocks(model: LaunchModel[Any], shapes: LaunchShapes) -> int:
    """Blocks of `shapes.block_size` positions that `shapes.kv_cache_memory` bytes (or
    `kv_cache_fraction` of the device's free memory, a CPU's split over the ranks sharing
    it) hold for the model's cache (0 without a budget, or where its state is not a KV
    cache)."""
    if not (shapes.kv_cache_memory or shapes.kv_cache_fraction):
        return 0
    probe = model.new_state(1, shapes.block_size, shapes.block_size, 1)
    if not probe.paged:
        return 0
    per_block = probe.bytes_per_token * shapes.block_size
    budget = shapes.kv_cache_memory
    if not budget:
        free = free_memory(probe.device)
        if probe.device.type == "cpu":
            free //= max(1, shapes.ranks_sharing)
        budget = int(free * shapes.kv_cache_fraction)
    fixed = probe.fixed_bytes * shapes.num_slots  # the slots' (and marks') own state
    blocks = (budget - fixed) // per_block
    if blocks < 1:
        beside = f" beside its slots' own {fixed} bytes" if fixed else ""
        raise ValueError(
            f"a cache of {budget} bytes holds no block of "
            f"{shapes.block_size} tokens ({per_block} bytes){beside}"
        )
    return int(blocks)
