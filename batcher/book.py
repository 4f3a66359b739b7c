"""The requests a pool holds, from the entry it read to the final chunk written for it.

The book validates entries (dead-lettering or rejecting bad ones), resumes requests after
what their result streams already hold, ends the ones no rank needs to finish (cancelled,
timed out, out of budget, already final), and applies what ranks report.
"""

from __future__ import annotations

import logging
import time

import redis
from tokenizers import Tokenizer

from batcher.chat import ChatTemplate
from batcher.durability import Delivery
from batcher.intake import (
    ModelFacts,
    Tracked,
    end_by_batcher,
    make_sequence,
    parse_entry,
    reject,
    settle,
    write_dead_letter,
)
from batcher.metrics import BatcherMetrics
from batcher.scheduler import PoolState, finish, stop
from schemas.codec import DeadLetter, Rejected
from schemas.config import Settings
from schemas.control import SlotStop, StepResult
from schemas.keys import FIELD, Keys
from schemas.messages import FinishReason
from schemas.results import ResultWriter, read_published

log = logging.getLogger("npu_pool.batcher")


class RequestBook:
    """Tracked requests of one pool epoch, with the planner state they live in."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        settings: Settings,
        state: PoolState,
        stats: dict[str, int],
        metrics: BatcherMetrics | None = None,
    ) -> None:
        self.metrics = metrics
        self.redis = client
        self.keys = keys
        self.settings = settings
        self.state = state
        self.stats = stats
        self.writer = ResultWriter(client, keys)
        self.tracked: dict[str, Tracked] = {}
        self.pending_stops: dict[int, list[SlotStop]] = {}
        self.order = 0
        self.tokenizer: Tokenizer | None = None
        self.chat: ChatTemplate | None = None
        self.facts = ModelFacts(vocab_size=0, max_model_len=settings.max_model_len)

    def accept(self, deliveries: list[Delivery], resume: bool) -> None:
        """Validate entries, settle or end the ones that need no rank, track the rest."""
        assert self.tokenizer is not None
        pipe = self.redis.pipeline(transaction=False)
        fresh: list[Tracked] = []
        for d in deliveries:
            if d.fields is None:  # deleted since it was read: already settled
                settle(pipe, self.keys, d.entry_id)
                continue
            if d.times_delivered > self.settings.max_deliveries:
                write_dead_letter(
                    pipe,
                    self.keys,
                    d.entry_id,
                    d.fields,
                    f"delivered {d.times_delivered} times without finishing",
                )
                self.stats["dead"] += 1
                continue
            try:
                request, prompt_ids = parse_entry(
                    d.fields.get(FIELD.encode()),
                    self.tokenizer,
                    self.facts,
                    self.settings.max_request_bytes,
                    self.chat,
                )
            except DeadLetter as exc:
                write_dead_letter(pipe, self.keys, d.entry_id, d.fields, str(exc))
                self.stats["dead"] += 1
                log.warning("dead letter %s: %s", d.entry_id, exc)
                continue
            except Rejected as exc:
                reject(pipe, self.writer, self.keys, d.entry_id, exc, self.settings.result_ttl_s)
                self.stats["rejected"] += 1
                continue
            if request.id in self.tracked:
                write_dead_letter(
                    pipe,
                    self.keys,
                    d.entry_id,
                    d.fields,
                    f"field `id`: {request.id!r} duplicates a request in progress",
                )
                self.stats["dead"] += 1
                continue
            self.order += 1
            tracked = Tracked(d.entry_id, request, prompt_ids)
            self.tracked[request.id] = tracked
            fresh.append(tracked)
        pipe.execute()
        self.enqueue(fresh, resume)

    def requeue(self, lost: list[Tracked]) -> None:
        """Requests whose rank was lost (or lost them) re-enter after what they published."""
        self.stats["recovered"] += len(lost)
        self.enqueue(lost, resume=True)

    def enqueue(self, requests: list[Tracked], resume: bool) -> None:
        """Put tracked requests in the waiting queue, or end them now if nothing is left."""
        if not requests:
            return
        ids = [t.request_id for t in requests]
        published = read_published(self.redis, self.keys, ids) if resume else {}
        cancelled = self.redis.zmscore(self.keys.cancelled, ids)
        now_ms = time.time() * 1000
        pipe = self.redis.pipeline(transaction=False)
        for tracked, cancel_score in zip(requests, cancelled):
            found = published.get(tracked.request_id)
            if found is not None:
                if found.final is not None:
                    self.forget(tracked, pipe)
                    continue
                tracked.resumed_ids, tracked.start_seq = found.token_ids, found.next_seq
            deadline = tracked.request.deadline_ms
            if cancel_score is not None and tracked.stop_reason is None:
                tracked.stop_reason = FinishReason.CANCELLED
            elif deadline is not None and deadline <= now_ms and tracked.stop_reason is None:
                tracked.stop_reason = FinishReason.TIMEOUT
            order = tracked.seq.order if tracked.seq is not None else self.order
            tracked.seq = make_sequence(tracked, order, self.settings.max_model_len)
            tracked.admission += 1
            reason = tracked.stop_reason
            if reason is None and tracked.seq.max_new_tokens <= 0:
                reason = FinishReason.LENGTH
            if reason is not None:
                end_by_batcher(pipe, self.writer, tracked, reason, self.settings.result_ttl_s)
                self.forget(tracked, pipe)
                continue
            self.state.waiting.append(tracked.seq)
        pipe.execute()

    def forget(self, tracked: Tracked, pipe: redis.client.Pipeline) -> None:
        """Drop a request whose final chunk is written, and settle its entry."""
        finish(self.state, tracked.request_id)
        self.tracked.pop(tracked.request_id, None)
        if self.metrics is not None:
            self.metrics.forget(tracked.request_id)
        settle(pipe, self.keys, tracked.entry_id)
        self.stats["finished"] += 1

    def stop(self, request_id: str, reason: FinishReason) -> None:
        """End a request: at once if no rank holds it, else by its rank's next step."""
        tracked = self.tracked.get(request_id)
        if tracked is None or tracked.stop_reason is not None:
            return
        tracked.stop_reason = reason
        seq = stop(self.state, request_id)
        if seq is not None:
            self.pending_stops.setdefault(seq.rank, []).append(
                SlotStop(slot=seq.slot, request_id=request_id, finish_reason=reason.value)
            )
            return
        pipe = self.redis.pipeline(transaction=False)
        end_by_batcher(pipe, self.writer, tracked, reason, self.settings.result_ttl_s)
        self.forget(tracked, pipe)
        pipe.execute()

    def expire_deadlines(self) -> None:
        """Stop every request whose deadline has passed."""
        now_ms = time.time() * 1000
        late = [
            t.request_id
            for t in self.tracked.values()
            if t.request.deadline_ms is not None and t.request.deadline_ms <= now_ms
        ]
        for request_id in late:
            self.stop(request_id, FinishReason.TIMEOUT)

    def apply(self, result: StepResult, pipe: redis.client.Pipeline) -> None:
        """Count a rank's tokens, settle what finished, resume what it lost."""
        lost: list[Tracked] = []
        for outcome in result.outcomes:
            tracked = self.tracked.get(outcome.request_id)
            if (
                tracked is None
                or tracked.seq is None
                or tracked.seq.rank != result.rank
                or outcome.admission != tracked.admission
            ):
                continue
            if self.metrics is not None:
                self.metrics.tokens(tracked, outcome.num_new_tokens)
            tracked.num_published += outcome.num_new_tokens
            self.stats["tokens"] += outcome.num_new_tokens
            if outcome.lost:
                finish(self.state, outcome.request_id)
                lost.append(tracked)
            elif outcome.finish_reason is not None:
                self.forget(tracked, pipe)
        self.requeue(lost)
