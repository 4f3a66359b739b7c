"""Splitting a pool's StepPlan into one RankStepPlan per rank: diffs only, vLLM-style."""

from __future__ import annotations

from batcher.intake import Tracked
from batcher.scheduler import StepPlan
from schemas.config import Settings
from schemas.control import NewRequest, RankStepPlan, SlotStop


def rank_plans(
    plan: StepPlan,
    tracked: dict[str, Tracked],
    epoch: int,
    step: int,
    settings: Settings,
    ranks: set[int] | None = None,
) -> list[RankStepPlan]:
    """Per-rank messages for the live `ranks` (None: those the plan names); a request's
    prompt and sampling travel once, when it is admitted. A fence, and a plan that runs
    nothing and admits nothing (stops alone), goes to every live rank."""
    if plan.fence and ranks is None:
        raise ValueError("a fence goes to every live rank: pass `ranks`")
    plans: dict[int, RankStepPlan] = {}

    def for_rank(rank: int) -> RankStepPlan:
        if rank not in plans:
            plans[rank] = RankStepPlan(epoch=epoch, step=step, rank=rank)
        return plans[rank]

    for seq in plan.admitted:
        entry = tracked[seq.request_id]
        for_rank(seq.rank).new_requests.append(
            NewRequest(
                request_id=seq.request_id,
                slot=seq.slot,
                prompt_token_ids=entry.prompt_ids + entry.resumed_ids,
                num_prompt_tokens=len(entry.prompt_ids),
                sampling=entry.request.sampling,
                start_index=len(entry.resumed_ids),
                start_seq=entry.start_seq,
                admission=seq.admission,
                result_ttl_s=entry.ttl_s(settings.result_ttl_s),
                tenant=entry.request.tenant,
                cached_from=seq.cached_from,
                num_cached_tokens=seq.num_cached,
                blocks=list(seq.blocks),
                copy_block=list(seq.copy_block),
                restore_mark=seq.restore_mark,
                grammar=constraint.compiled() if (constraint := entry.request.constraint) else None,
            )
        )
    for seq in plan.grown:  # a running request's next blocks
        start = seq.num_sent_blocks
        for_rank(seq.rank).blocks.append([seq.slot, start, seq.blocks[start:]])
        seq.num_sent_blocks = len(seq.blocks)
    for launch in plan.decode_launches:
        for rank, rows in launch.items():
            for_rank(rank).decode_launches.append([seq.slot for seq in rows])
    for rank, launches in plan.prefill.items():
        for_rank(rank).prefill.extend(launches)
    for stop in plan.stops:
        for_rank(stop.seq.rank).stops.append(
            SlotStop(
                slot=stop.seq.slot,
                request_id=stop.seq.request_id,
                finish_reason=stop.reason,
                admission=stop.seq.admission,
            )
        )
    if ranks is not None and (plan.fence or (plan.is_empty and not plan.admitted)):
        for rank in ranks:
            for_rank(rank)
    return [plans[r] for r in sorted(plans) if ranks is None or r in ranks]
