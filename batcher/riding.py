"""Decode rows riding in packed prefill launches (docs/architecture.md §3, step 5): where a
row gets the same bits in a decode launch and as a one-token segment of a prefill launch,
a rank's decode micro-batch runs in the room its prefill launch keeps, one pass over the
weights instead of two. Pure functions of the step's launches, called by the planner."""

from __future__ import annotations

from typing import TYPE_CHECKING

from schemas.control import DECODE_ROW, PrefillChunk

if TYPE_CHECKING:
    from batcher.scheduler import Sequence

DecodeLaunches = list[dict[int, list["Sequence"]]]


def rooms_to_ride(decode_launches: DecodeLaunches, prefill_chunk: int) -> dict[int, list[int]]:
    """Per rank, the tokens its first prefill launches keep for its decode micro-batches to
    ride in, smallest first (a micro-batch as large as a launch never rides)."""
    sizes: dict[int, list[int]] = {}
    for decode in decode_launches:
        for rank, rows in decode.items():
            if 0 < len(rows) < prefill_chunk:
                sizes.setdefault(rank, []).append(len(rows))
    return {rank: sorted(rows) for rank, rows in sizes.items()}


def ride(
    decode_launches: DecodeLaunches,
    prefill: dict[int, list[list[PrefillChunk]]],
    prefill_chunk: int,
) -> DecodeLaunches:
    """Each of a rank's prefill launches takes one of its decode micro-batches, smallest
    first, where the tokens it leaves free hold every row: its rows become one-token
    segments (`DECODE_ROW`) and that decode launch is not run. Returns the decode launches
    left. The rows are planned as before (their tokens counted, their blocks grown); only
    where they run moves."""
    for rank, launches in prefill.items():
        for launch in launches:
            room = prefill_chunk - sum(chunk.num_tokens for chunk in launch)
            fits = [
                k
                for k, decode in enumerate(decode_launches)
                if 0 < len(decode.get(rank, ())) <= room
            ]
            if not fits:
                continue
            k = min(fits, key=lambda k: len(decode_launches[k][rank]))
            rows = decode_launches[k].pop(rank)
            launch += [PrefillChunk(s.slot, DECODE_ROW, 1, s.request_id) for s in rows]
    return [decode for decode in decode_launches if decode]
