"""The requests a pool holds, from the entry it read to the final chunk written for it.

The book validates entries (dead-lettering or rejecting bad ones), resumes requests after
what their result streams already hold, ends the ones no rank needs to finish (cancelled,
timed out, out of budget, already final), and writes what ranks report once the planner's
half (`outcomes.apply_result`) has applied it to the pool state. It owns the pool's
counters (`PoolCounts`), which outlive its epochs.
"""

from __future__ import annotations

import logging
import time

import redis
from tokenizers import Tokenizer

from batcher.chat import ChatTemplate
from batcher.counts import PoolCounts
from batcher.durability import Delivery, count_delivery
from batcher.intake import (
    ModelFacts,
    Settler,
    Tracked,
    end_by_batcher,
    make_sequence,
    parse_entry,
    reject,
    rejection_chunk,
    settle,
    write_dead_letter,
)
from batcher.metrics import BatcherMetrics
from batcher.outcomes import apply_result
from batcher.prefix import block_keys
from batcher.scheduler import PoolState, Sequence, StepPlan, finish, stop
from schemas.codec import DeadLetter, Rejected, request_id_of
from schemas.config import Settings
from schemas.control import StepResult
from schemas.keys import FIELD, Keys
from schemas.messages import ErrorInfo, FinishReason
from schemas.results import ALREADY_FINAL, APPENDED, ResultWriter, read_published

log = logging.getLogger("npu_pool.batcher")


class RequestBook:
    """Tracked requests of the current pool epoch, with the planner state they live in."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        settings: Settings,
        state: PoolState,
        metrics: BatcherMetrics | None = None,
    ) -> None:
        self.metrics = metrics
        self.redis = client
        self.keys = keys
        self.settings = settings
        self.writer = ResultWriter(client, keys)
        self.settler = Settler(client, keys)
        self.counts = PoolCounts()
        self.limits: dict[str, int] = {"max_queue": settings.max_queue}
        self.tenants = settings.tenant_table()
        self.new_epoch(state)

    def new_epoch(self, state: PoolState) -> None:
        """Forget every request (an epoch resumes them from Redis) and the model: its ranks
        publish the tokenizer again. Counters and limits carry over."""
        self.state = state
        self.tracked: dict[str, Tracked] = {}
        self.order = 0
        self.tokenizer: Tokenizer | None = None
        self.chat: ChatTemplate | None = None
        self.facts = ModelFacts(vocab_size=0, max_model_len=self.settings.max_model_len)

    def use_model(self, tokenizer: Tokenizer, chat: ChatTemplate | None, vocab_size: int) -> None:
        """The model the ranks serve: how prompts are tokenized, chats rendered, ids checked."""
        self.tokenizer, self.chat = tokenizer, chat
        self.facts = ModelFacts(vocab_size, self.settings.max_model_len)

    def use_limits(self, limits: dict[str, int]) -> None:
        """The namespace's limits, as published (the bound excess entries are ended past)."""
        self.limits = limits

    def resume_own(self, deliveries: list[Delivery]) -> None:
        """Entries this pool held when its epoch began: resume each after what it published."""
        self.counts.recovered += len(deliveries)
        self.accept(deliveries, resume=True)

    def claim(self, deliveries: list[Delivery]) -> None:
        """Entries claimed from pools that are gone: resume each after what it published."""
        self.counts.claimed += len(deliveries)
        self.accept(deliveries, resume=True)

    def dispatched(self, plan: StepPlan) -> None:
        """A step went out: count it and the requests it admitted."""
        self.counts.steps += 1
        self.counts.admitted += len(plan.admitted)
        if self.state.config.prefix_caching:
            for seq in plan.admitted:
                self.counts.prefix_cache_queries += seq.num_prompt_tokens
                self.counts.prefix_cache_hits += seq.num_cached
        if self.metrics is not None:
            self.metrics.admitted(plan.admitted, self.tracked)

    def accept(self, deliveries: list[Delivery], resume: bool) -> None:
        """Validate entries, settle or end the ones that need no rank, track the rest."""
        assert self.tokenizer is not None
        pipe = self.redis.pipeline(transaction=False)
        fresh: list[Tracked] = []
        duplicates: list[tuple[Delivery, str]] = []
        for d in deliveries:
            if d.fields is None:  # deleted since it was read: already settled
                settle(pipe, d.stream, d.entry_id)
                continue
            try:
                request, prompt_ids = parse_entry(
                    d.fields.get(FIELD.encode()),
                    self.tokenizer,
                    self.facts,
                    self.settings.max_request_bytes,
                    self.chat,
                    self.tenants,
                )
            except DeadLetter as exc:
                write_dead_letter(pipe, self.keys, d.stream, d.entry_id, d.fields, str(exc))
                self.counts.dead += 1
                log.warning("dead letter %s: %s", d.entry_id, exc)
                continue
            except Rejected as exc:
                reject(pipe, self.writer, d.stream, d.entry_id, exc, self.settings.result_ttl_s)
                self.counts.rejected += 1
                continue
            if request.id in self.tracked:
                duplicates.append((d, request.id))
                continue
            self.order += 1
            payload = d.fields.get(FIELD.encode(), b"")
            tracked = Tracked(
                d.entry_id, d.stream, request, prompt_ids, d.times_delivered, payload=payload
            )
            self.tracked[request.id] = tracked
            fresh.append(tracked)
        self._end_duplicates(duplicates, pipe)
        pipe.execute()
        self.enqueue(fresh, resume)

    def _end_duplicates(
        self, duplicates: list[tuple[Delivery, str]], pipe: redis.client.Pipeline
    ) -> None:
        """Entries whose id this pool tracks: kept as served once where that request's final
        chunk is written already (it was submitted again the moment it finished, before its
        rank's step result came back), else dead letters (it is still in progress)."""
        if not duplicates:
            return
        published = read_published(self.redis, self.keys, [i for _, i in duplicates])
        kept = []
        for d, request_id in duplicates:
            if published[request_id].final is not None:
                settle(pipe, d.stream, d.entry_id)
                kept.append(request_id)
                continue
            reason = f"field `id`: {request_id!r} duplicates a request in progress"
            write_dead_letter(pipe, self.keys, d.stream, d.entry_id, d.fields or {}, reason)
            self.counts.dead += 1
        if kept:
            log.info(
                "already complete, result kept as it is (an id submitted again is served once): %s",
                kept,
            )

    def requeue(self, lost: list[Tracked], rank_died: bool = False) -> None:
        """Requests whose rank was lost (or lost them, or gave them back) re-enter after what
        they published; a rank that died counts a delivery, in Redis too."""
        if rank_died and lost:
            pipe = self.redis.pipeline(transaction=False)
            for tracked in lost:
                tracked.times_delivered += 1
                tracked.rank_deaths += 1
                count_delivery(pipe, self.settings.pool, tracked.stream, tracked.entry_id)
            pipe.execute()
        self.counts.recovered += len(lost)
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
            order = tracked.seq.order if tracked.seq is not None else self.order
            tracked.seq = make_sequence(
                tracked, order, self.settings.max_model_len, self.settings.priority_aging_s
            )
            if self.settings.prefix_caching:
                context = tracked.prompt_ids + tracked.resumed_ids
                block = self.settings.block_size
                tracked.seq.block_keys = block_keys(context, block, self.settings.model)
            reason, error = self._end_now(tracked, cancel_score is not None, now_ms)
            if reason is not None:
                end_by_batcher(
                    pipe, self.writer, tracked, reason, self.settings.result_ttl_s, error
                )
                if error is not None and error.code == "max_deliveries":
                    fields = {FIELD.encode(): tracked.payload}
                    write_dead_letter(
                        pipe, self.keys, tracked.stream, tracked.entry_id, fields, error.message
                    )
                    self.counts.dead += 1
                self.forget(tracked, pipe)
                continue
            self.state.waiting.append(tracked.seq)
        pipe.execute()

    def _end_now(
        self, tracked: Tracked, cancelled: bool, now_ms: float
    ) -> tuple[FinishReason | None, ErrorInfo | None]:
        """Why a request about to wait must end instead, if it must."""
        deadline = tracked.request.deadline_ms
        if tracked.stop_reason is None:
            if cancelled:
                tracked.stop_reason = FinishReason.CANCELLED
            elif deadline is not None and deadline <= now_ms:
                tracked.stop_reason = FinishReason.TIMEOUT
        if tracked.stop_reason is not None:
            return tracked.stop_reason, None
        limit = self.settings.max_deliveries
        if tracked.times_delivered > limit:
            message = (
                f"delivered {tracked.times_delivered} times without finishing "
                f"(max_deliveries={limit}): the rank or batcher serving it died each time"
            )
            return FinishReason.ERROR, ErrorInfo(code="max_deliveries", message=message)
        assert tracked.seq is not None
        if tracked.seq.max_new_tokens <= 0:
            return FinishReason.LENGTH, None
        return self._too_large(tracked.seq)

    def _too_large(self, seq: Sequence) -> tuple[FinishReason | None, ErrorInfo | None]:
        """In a cache of blocks, a request that would not fit on any rank even alone (its
        context and every token it may produce) is rejected: it could never finish."""
        state = self.state
        if not state.config.paged or not state.pools:
            return None, None
        tokens = seq.num_prompt_tokens + seq.max_new_tokens
        needed = state.blocks_needed(seq, tokens)
        most = max(pool.total - state.watermark(r) for r, pool in state.pools.items())
        if needed <= most:
            return None, None
        size = state.config.block_size
        message = (
            f"{seq.num_prompt_tokens} context tokens and up to {seq.max_new_tokens} more need "
            f"{needed} cache blocks of {size} tokens; a rank of this pool holds {most} for one "
            "request (raise --kv-cache-memory, or ask for fewer max_tokens)"
        )
        return FinishReason.REJECTED, ErrorInfo(code="cache_too_small", message=message)

    def forget(self, tracked: Tracked, pipe: redis.client.Pipeline) -> None:
        """Drop a request whose final chunk is written, and settle its entry."""
        finish(self.state, tracked.request_id)
        self._settle_finished(tracked, pipe)

    def _settle_finished(self, tracked: Tracked, pipe: redis.client.Pipeline) -> None:
        """Settle the entry of a request the planner no longer holds, and stop tracking it."""
        self.tracked.pop(tracked.request_id, None)
        if self.metrics is not None:
            self.metrics.forget(tracked.request_id)
        self.settler.finished(pipe, tracked)
        self.counts.finished += 1

    def stop(self, request_id: str, reason: FinishReason) -> None:
        """End a request: at once if no rank holds it, else by its rank's next step."""
        tracked = self.tracked.get(request_id)
        if tracked is None or tracked.stop_reason is not None:
            return
        tracked.stop_reason = reason
        if stop(self.state, request_id, reason.value) is not None:
            return  # planned: the next step tells its rank
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
        """Count a rank's step and tokens, settle what finished, resume what it lost or gave
        back (the planner's state has applied the result already: `apply_result`)."""
        self.counts.add_step(result.counts)
        applied = apply_result(self.state, result)
        for request_id, num_new in applied.num_new_tokens.items():
            tracked = self.tracked[request_id]
            if self.metrics is not None:
                self.metrics.tokens(tracked, num_new)
            tracked.num_published += num_new
            self.counts.tokens += num_new
        self.counts.preempted += applied.num_preempted
        for request_id in applied.finished:
            self._settle_finished(self.tracked[request_id], pipe)
        self.requeue([self.tracked[request_id] for request_id in applied.lost + applied.released])

    def reject_excess(self, excess: list[Delivery]) -> None:
        """End entries past the namespace's bound (they bypassed admission) `queue_full`."""
        if not excess:
            return
        ended: list[Delivery] = []
        appends = self.redis.pipeline(transaction=False)
        for d in excess:
            request_id = request_id_of((d.fields or {}).get(FIELD.encode()))
            if request_id is not None:
                message = f"the queue was over max_queue={self.limits['max_queue']} when it came"
                chunk = rejection_chunk(Rejected(request_id, "queue_full", message))
                self.writer.append(appends, chunk, self.settings.result_ttl_s)
                ended.append(d)
        replies = appends.execute()
        pipe = self.redis.pipeline(transaction=False)
        for d, reply in zip(ended, replies):
            if reply in (APPENDED, ALREADY_FINAL):  # else a rank serves it already: keep it
                settle(pipe, d.stream, d.entry_id)
                self.counts.rejected += 1
        for d in excess:
            if d not in ended:  # no usable id: nobody can wait for it
                write_dead_letter(pipe, self.keys, d.stream, d.entry_id, d.fields, "no usable `id`")
                self.counts.dead += 1
        pipe.execute()
