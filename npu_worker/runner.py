"""The fixed-shape launches of one rank: B1S`prefill_chunk` prefill and B`decode_batch`S1 decode.

Only these shapes ever reach the model. Inputs are padded explicitly; the KV cache is
allocated once. A decode launch reads the cache in place when its rows fit in a window of
`decode_batch` consecutive slots, and only the first `span` positions (a multiple of
`prefill_chunk` at or above the longest context), so cost follows the context, not the cache.
"""

from __future__ import annotations

import torch

from npu_worker.backends import make_backend
from npu_worker.loader import LoadedModel
from npu_worker.model import KVCache, LaunchInputs


class LaunchRunner:
    """Runs prefill and decode launches of one rank on its device."""

    def __init__(
        self,
        loaded: LoadedModel,
        num_slots: int,
        max_kv_len: int,
        prefill_chunk: int,
        decode_batch: int,
        cuda_graphs: bool = True,
    ) -> None:
        self.device = loaded.device
        self.prefill_chunk = prefill_chunk
        self.decode_batch = decode_batch
        self.cache = KVCache(loaded.config, num_slots, max_kv_len, loaded.dtype, loaded.device)
        self.backend = make_backend(loaded.model, self.cache, loaded.device, cuda_graphs)
        self.num_launches = {"prefill": 0, "decode": 0}

    def spans(self) -> list[int]:
        """Every cache span a launch may read: the captured shapes of graph backends."""
        return list(range(self.prefill_chunk, self.cache.max_kv_len + 1, self.prefill_chunk))

    def span_for(self, context_len: int) -> int:
        """Cache positions a launch reads: whole prefill chunks covering `context_len`."""
        chunks = -(-context_len // self.prefill_chunk)
        return min(self.cache.max_kv_len, chunks * self.prefill_chunk)

    def prefill(self, slot: int, token_ids: list[int], start: int) -> torch.Tensor:
        """One B1S`prefill_chunk` launch; returns the [1, vocab] logits of its last real token."""
        size = self.prefill_chunk
        if not 0 < len(token_ids) <= size or start % size:
            raise ValueError(f"bad prefill chunk: {len(token_ids)} tokens at start {start}")
        ids = token_ids + [0] * (size - len(token_ids))
        positions = list(range(start, start + size))
        launch = LaunchInputs(
            input_ids=self._tensor([ids]),
            positions=self._tensor([positions]),
            slot_ids=self._tensor([slot]),
            logit_index=self._tensor([len(token_ids) - 1]),
            span=start + size,
            window_start=slot if self.backend.reads_in_place else None,
        )
        self.num_launches["prefill"] += 1
        return self.backend.run(launch)

    def warm_up(self) -> None:
        """Run (and so capture, on graph backends) every launch shape before any request."""
        for span in self.spans():
            self.dummy_prefill(span)
            self.dummy_decode(span)
        self.num_launches = {"prefill": 0, "decode": 0}

    def dummy_decode(self, span: int) -> torch.Tensor:
        """A decode launch of padding rows only, reading `span` positions."""
        batch = self.decode_batch
        launch = LaunchInputs(
            input_ids=torch.zeros(batch, 1, dtype=torch.long, device=self.device),
            positions=torch.full(
                (batch, 1), self.cache.scratch_position, dtype=torch.long, device=self.device
            ),
            slot_ids=torch.zeros(batch, dtype=torch.long, device=self.device),
            logit_index=torch.zeros(batch, dtype=torch.long, device=self.device),
            span=span,
            window_start=None,
        )
        self.num_launches["decode"] += 1
        return self.backend.run(launch)

    def dummy_prefill(self, span: int | None = None) -> None:
        """A prefill launch that touches only scratch positions (lockstep filler)."""
        scratch = self.cache.scratch_position
        launch = LaunchInputs(
            input_ids=self._tensor([[0] * self.prefill_chunk]),
            positions=self._tensor([[scratch] * self.prefill_chunk]),
            slot_ids=self._tensor([0]),
            logit_index=self._tensor([0]),
            span=span or self.prefill_chunk,
            window_start=0 if self.backend.reads_in_place else None,
        )
        self.num_launches["prefill"] += 1
        self.backend.run(launch)

    def decode(self, slots: list[int], token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """One B`decode_batch`S1 launch for up to `decode_batch` rows; [len(slots), vocab] logits.

        Row r feeds `token_ids[r]` at `positions[r]` of slot `slots[r]`; padding rows write
        only to the scratch position.
        """
        batch = self.decode_batch
        if len(slots) > batch:
            raise ValueError(f"{len(slots)} rows exceed decode_batch={batch}")
        window_start, row_of, slot_ids = self._layout(slots)
        ids = [0] * batch
        launch_positions = [self.cache.scratch_position] * batch
        for row, token, position in zip(row_of, token_ids, positions):
            ids[row], launch_positions[row] = token, position
        context = max(positions) + 1 if positions else 1
        launch = LaunchInputs(
            input_ids=self._tensor(ids).view(batch, 1),
            positions=self._tensor(launch_positions).view(batch, 1),
            slot_ids=self._tensor(slot_ids),
            logit_index=torch.zeros(batch, dtype=torch.long, device=self.device),
            span=self.span_for(context),
            window_start=window_start,
        )
        self.num_launches["decode"] += 1
        logits = self.backend.run(launch)
        return logits[self._tensor(row_of)] if slots else logits[:0]

    def _layout(self, slots: list[int]) -> tuple[int | None, list[int], list[int]]:
        """Rows on a window of consecutive slots where they fit, else gathered by slot id."""
        batch, num_slots = self.decode_batch, self.cache.num_slots
        in_place = self.backend.reads_in_place
        if in_place and slots and num_slots >= batch and max(slots) - min(slots) < batch:
            start = min(min(slots), num_slots - batch)
            return start, [s - start for s in slots], list(range(start, start + batch))
        padding = [slots[0] if slots else 0] * (batch - len(slots))
        return None, list(range(len(slots))), list(slots) + padding

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
