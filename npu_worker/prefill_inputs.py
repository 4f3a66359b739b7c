"""A prefill launch's fixed-shape inputs (B1S`prefill_chunk`): one request's chunk read in
place, or several requests' chunks back to back, each token at its own slot and position
(docs/architecture.md §2)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from npu_worker.models.launch import LaunchInputs
from schemas.control import PrefillChunk


@dataclass(frozen=True, slots=True)
class PrefillLayout:
    """What a rank's prefill launches look like: `chunk` tokens, padding written at
    `scratch`; eager backends (`reads_in_place`) read a lone chunk's slot in place and a
    packed launch's exact keys, graph backends a fixed number of `segments`."""

    chunk: int
    scratch: int
    reads_in_place: bool
    segments: int
    device: torch.device

    def single(self, slot: int, token_ids: list[int], start: int) -> LaunchInputs:
        """One request's chunk at its slot: logits of its last token (first of `segments`
        head rows, as a packed launch's, so its bits are a decode row's)."""
        size = self.chunk
        if not 0 < len(token_ids) <= size or start % size:
            raise ValueError(f"bad prefill chunk: {len(token_ids)} tokens at start {start}")
        padding = size - len(token_ids)  # padding tokens write the scratch position only
        positions = list(range(start, start + len(token_ids))) + [self.scratch] * padding
        return LaunchInputs(
            input_ids=self._tensor([token_ids + [0] * padding]),
            positions=self._tensor([positions]),
            slot_ids=self._tensor([slot]),
            logit_index=self._tensor([[len(token_ids) - 1] * self.segments]),
            span=start + size,
            window_start=slot if self.reads_in_place else None,
        )

    def packed(
        self,
        chunks: list[PrefillChunk],
        token_ids: list[list[int]],
        span_for: Callable[[int], int],
    ) -> LaunchInputs:
        """Several requests' chunks back to back (chunk j feeding `token_ids[j]`): logits
        of each chunk's last token; `span_for` gives the cache span a context needs."""
        size = self.chunk
        if not chunks or sum(len(t) for t in token_ids) > size:
            raise ValueError(f"bad packed launch: {[len(t) for t in token_ids]} tokens")
        ids: list[int] = []
        positions: list[int] = []
        owners: list[int] = []
        ends: list[int] = []
        for j, (chunk, tokens) in enumerate(zip(chunks, token_ids, strict=True)):
            ids += tokens
            positions += range(chunk.start, chunk.start + len(tokens))
            owners += [j] * len(tokens)
            ends.append(len(ids) - 1)
        padding = size - len(ids)  # padding tokens: chunk 0's slot, the scratch position
        slots = [c.slot for c in chunks]
        chunk_ends = [c.start + c.num_tokens for c in chunks]
        packed_keys = None
        if self.reads_in_place:  # eager: attend over exactly the chunks' keys
            packed_keys = self._exact_keys(slots, chunk_ends)
        else:  # graph backends: a fixed number of segments
            slots += [slots[0]] * (self.segments - len(slots))
        # the head always takes `segments` rows: a product's rows may get other bits at
        # another row count, and a segment's logits must not depend on what shares it
        ends += [0] * (self.segments - len(ends))
        return LaunchInputs(
            input_ids=self._tensor([ids + [0] * padding]),
            positions=self._tensor([positions + [self.scratch] * padding]),
            slot_ids=self._tensor(slots[:1]),
            logit_index=self._tensor([ends]),
            span=span_for(max(chunk_ends)),
            window_start=None,
            segment_slots=self._tensor(slots),
            token_segments=self._tensor(owners + [0] * padding),
            packed_keys=packed_keys,
        )

    def _exact_keys(self, slots: list[int], ends: list[int]) -> torch.Tensor:
        """[3, K]: the slot, position and segment of every key the chunks see."""
        key_slots: list[int] = []
        key_positions: list[int] = []
        key_segments: list[int] = []
        for j, (slot, end) in enumerate(zip(slots, ends, strict=True)):
            key_slots += [slot] * end
            key_positions += range(end)
            key_segments += [j] * end
        return self._tensor([key_slots, key_positions, key_segments])

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
