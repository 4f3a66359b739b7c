"""Splitting a pool's step into rank plans: who gets one, and what travels in it."""

from __future__ import annotations

import pytest

from batcher.dispatch import rank_plans
from batcher.scheduler import PlannedStop, Sequence, StepPlan
from schemas.config import Settings
from schemas.control import PrefillChunk, RankStepPlan, SlotStop

pytestmark = pytest.mark.fast

SETTINGS = Settings(model="tiny", device="cpu", ranks=3)
LIVE = {0, 2}  # rank 1 is gone


def running(request_id: str, rank: int, slot: int, admission: int = 1) -> Sequence:
    """A request admitted to (rank, slot), its prompt of 10 tokens prefilled."""
    return Sequence(
        request_id, 10, 16, 0, rank=rank, slot=slot, num_prefilled=10, admission=admission
    )


def test_a_fence_goes_to_every_live_rank_with_its_epoch_and_nothing_else() -> None:
    plans = rank_plans(StepPlan(fence=True), {}, epoch=5, step=1, settings=SETTINGS, ranks=LIVE)
    assert plans == [RankStepPlan(epoch=5, step=1, rank=0), RankStepPlan(epoch=5, step=1, rank=2)]


def test_a_fence_without_the_live_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match="a fence goes to every live rank"):
        rank_plans(StepPlan(fence=True), {}, epoch=5, step=1, settings=SETTINGS)


def test_stops_alone_go_to_every_live_rank() -> None:
    plan = StepPlan(stops=[PlannedStop(running("a", 2, 3, admission=4), "cancelled")])
    plans = rank_plans(plan, {}, epoch=5, step=9, settings=SETTINGS, ranks=LIVE)
    assert [(p.rank, p.stops) for p in plans] == [(0, []), (2, [SlotStop(3, "a", "cancelled", 4)])]


def test_a_step_with_launches_goes_to_the_live_ranks_it_names_with_the_planners_chunks() -> None:
    a, b = running("a", 0, 1), running("b", 1, 0)
    chunks = [[PrefillChunk(2, 0, 128, "c")], [PrefillChunk(2, 128, 40, "c")]]
    plan = StepPlan(decode_launches=[{0: [a], 1: [b]}], prefill={0: chunks})
    plans = rank_plans(plan, {}, epoch=5, step=9, settings=SETTINGS, ranks=LIVE)
    assert plans == [
        RankStepPlan(epoch=5, step=9, rank=0, decode_launches=[[1]], prefill=chunks),
    ]
