"""One rank's step execution: plan in, sampled tokens and result chunks out, no Redis.

The engine keeps each request's state by KV slot (its tokens, last token, sampler seed,
detokenizer). `execute` runs a rank's decode launches, then its prefill launches, samples,
applies stop conditions and returns the chunks to publish and the step result.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from npu_worker.mtp import Acceptance, accept_drafts
from npu_worker.runner import LaunchRunner
from npu_worker.sampler import SamplingRows, sample, sampling_rows, token_logprobs
from npu_worker.stops import StopStrings
from schemas.control import PREEMPTED, NewRequest, RankStepPlan, RequestOutcome, StepResult
from schemas.messages import ErrorInfo, FinishReason, ResultChunk, SamplingParams, Usage

log = logging.getLogger("npu_pool.worker")


@dataclass(slots=True)
class RequestState:
    """What a rank holds for one request in one of its KV slots."""

    request_id: str
    slot: int
    admission: int
    token_ids: list[int]  # prompt (plus tokens resumed after recovery), then new tokens
    num_prompt_tokens: int
    num_context_tokens: int  # tokens of token_ids that are prompt for this run
    sampling: SamplingParams
    seed: int
    next_index: int  # completion index of the next token
    next_seq: int
    result_ttl_s: int
    decoder: DecodeStream
    stops: StopStrings | None = None
    pending_ids: list[int] = field(default_factory=list)
    pending_text: list[str] = field(default_factory=list)
    pending_logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: ErrorInfo | None = None

    @property
    def num_completion_tokens(self) -> int:
        """Tokens generated so far, including any published before a recovery."""
        return self.next_index


@dataclass(slots=True)
class StepOutput:
    """What a step produced on a rank: chunks to publish (with stream TTLs) and its result."""

    chunks: list[tuple[ResultChunk, int]]
    result: StepResult


class RankEngine:
    """Executes one rank's step plans against its launch runner."""

    def __init__(
        self,
        runner: LaunchRunner,
        tokenizer: Tokenizer,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        rank: int = 0,
        lockstep: bool = False,
    ) -> None:
        self.runner = runner
        self.lockstep = lockstep
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.rank = rank
        self.epoch = -1
        self.slots: dict[int, RequestState] = {}
        self.totals = {
            "tokens": 0,
            "steps": 0,
            "decode_rows": 0,
            "padding_rows": 0,
            "mtp_proposed": 0,
            "mtp_accepted": 0,
        }
        decode_rows = 2 if runner.mtp else 1
        self.shapes = (f"B1S{runner.prefill_chunk}", f"B{runner.decode_batch}S{decode_rows}")
        # (shape, seconds from launch to sampled tokens on the host) of the last step
        self.launch_seconds: list[tuple[str, float]] = []

    def reset(self, epoch: int) -> None:
        """Drop every request: a new batcher epoch re-sends what it still wants."""
        self.epoch = epoch
        self.slots.clear()

    def execute(self, plan: RankStepPlan) -> StepOutput:
        """Run a plan: register new requests, decode launches, prefill launches, publish."""
        started = time.perf_counter()
        if plan.epoch != self.epoch:
            self.reset(plan.epoch)
        for new in plan.new_requests:
            self.slots[new.slot] = self._admit(new)
        result = StepResult(
            epoch=plan.epoch, step=plan.step, rank=self.rank, incarnation=plan.incarnation
        )
        touched: list[RequestState] = []
        self.launch_seconds = []
        self.runner.launches.clear()
        prefill_shape, decode_shape = self.shapes
        for stop in plan.stops:
            state = self.slots.get(stop.slot)
            if state is None or state.request_id != stop.request_id:
                result.outcomes.append(_released(stop.request_id, stop.admission))
            elif stop.finish_reason == PREEMPTED:
                del self.slots[stop.slot]
                result.outcomes.append(_released(state.request_id, state.admission))
            else:
                state.finish_reason = FinishReason(stop.finish_reason)
                touched.append(state)
        for launch in plan.decode_launches:
            began = time.perf_counter()
            touched += self._decode(launch, result)
            self.launch_seconds.append((decode_shape, time.perf_counter() - began))
        for chunk in plan.prefill:
            began = time.perf_counter()
            state = self._prefill(chunk.slot, chunk.start, chunk.num_tokens)
            self.launch_seconds.append((prefill_shape, time.perf_counter() - began))
            result.num_prefill_launches += 1
            if state is not None:
                touched.append(state)
        output = self._collect(touched, result)
        result.exec_ms = (time.perf_counter() - started) * 1000
        totals = self.totals
        totals["tokens"] += sum(o.num_new_tokens for o in result.outcomes)
        totals["steps"] += 1
        totals["decode_rows"] += result.num_decode_rows
        totals["padding_rows"] += result.num_padding_rows
        totals["mtp_proposed"] += result.num_draft_proposed
        totals["mtp_accepted"] += result.num_draft_accepted
        return output

    def drop(self, admissions: set[tuple[str, int]]) -> None:
        """Forget the given (request id, admission)s: their streams moved on without us."""
        for slot in [
            s for s, st in self.slots.items() if (st.request_id, st.admission) in admissions
        ]:
            del self.slots[slot]

    def _admit(self, new: NewRequest) -> RequestState:
        resumed = new.prompt_token_ids[new.num_prompt_tokens :]
        return RequestState(
            request_id=new.request_id,
            slot=new.slot,
            admission=new.admission,
            token_ids=list(new.prompt_token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            num_context_tokens=len(new.prompt_token_ids),
            sampling=new.sampling,
            seed=new.sampling.seed if new.sampling.seed is not None else _seed_of(new.request_id),
            next_index=new.start_index,
            next_seq=new.start_seq,
            result_ttl_s=new.result_ttl_s,
            decoder=DecodeStream(ids=resumed, skip_special_tokens=True),
            stops=StopStrings(list(new.sampling.stop)) if new.sampling.stop else None,
        )

    def _decode(self, slots: list[int], result: StepResult) -> list[RequestState]:
        live = [
            s
            for s in slots
            if s in self.slots
            and self.slots[s].finish_reason is None
            and len(self.slots[s].token_ids) > self.slots[s].num_context_tokens
        ]
        states = [self.slots[s] for s in live]
        result.num_decode_launches += 1
        result.num_decode_rows += len(states)
        result.num_padding_rows += self.runner.decode_batch - len(states)
        if self.runner.mtp:
            self._verify(live, states, result)
            return states
        logits = self.runner.decode(
            live, [st.token_ids[-1] for st in states], [len(st.token_ids) - 1 for st in states]
        )
        if states:
            self._sample_into(states, logits)
        return states

    def _verify(self, live: list[int], states: list[RequestState], result: StepResult) -> None:
        """MTP decode: verify each row's draft, commit one or two tokens, draft again."""
        max_position = max((len(s.token_ids) - 1 for s in states), default=0)
        verify = self.runner.verify(live, max_position)
        if not states:  # all padding: the draft launch still runs, as on every other rank
            nothing = torch.zeros(0, dtype=torch.long, device=self.runner.device)
            self.runner.commit(verify, nothing, nothing, nothing.bool())
            return
        logits = verify.logits
        banned = self._banned(states, offset=0) | self._banned(states, offset=1)
        if banned:
            logits = logits.clone()
            for (row, position), token_ids in banned.items():
                logits[row, position, token_ids] = float("-inf")
        decided = self._accept(states, logits, verify.drafts)
        self.runner.commit(verify, decided.first, decided.second, decided.accepted)
        firsts, seconds = decided.first.tolist(), decided.second.tolist()
        accepted = decided.accepted.tolist()
        first_lp = self._logprobs(states, logits[:, 0], firsts)
        second_lp = self._logprobs(states, logits[:, 1], seconds)
        result.num_draft_proposed += len(states)
        result.num_draft_accepted += sum(accepted)
        for i, state in enumerate(states):
            if state.finish_reason is not None:  # its row failed to decide
                continue
            self._commit(state, firsts[i], first_lp[i])
            if accepted[i] and state.finish_reason is None:
                self._commit(state, seconds[i], second_lp[i])

    def _accept(
        self, states: list[RequestState], logits: torch.Tensor, drafts: torch.Tensor
    ) -> Acceptance:
        """Decide every row; a row whose decision raises fails its request alone (the others
        are decided row by row, as they would have been together)."""
        try:
            return accept_drafts(logits, drafts, self._rows(states))
        except Exception as exc:
            if len(states) == 1:
                self._fail(states[0], exc)
                first = logits[:, 0].argmax(-1)
                return Acceptance(first, first, torch.zeros_like(first, dtype=torch.bool))
        parts = [
            self._accept([state], logits[i : i + 1], drafts[i : i + 1])
            for i, state in enumerate(states)
        ]
        return Acceptance(
            torch.cat([p.first for p in parts]),
            torch.cat([p.second for p in parts]),
            torch.cat([p.accepted for p in parts]),
        )

    def _banned(self, states: list[RequestState], offset: int) -> dict[tuple[int, int], list[int]]:
        """Tokens that min_tokens forbids, per (row, launch position)."""
        return {
            (r, offset): self._stop_ids(s)
            for r, s in enumerate(states)
            if s.next_index + offset < s.sampling.min_tokens
        }

    def _prefill(self, slot: int, start: int, num_tokens: int) -> RequestState | None:
        state = self.slots.get(slot)
        if num_tokens == 0 or state is None or state.finish_reason is not None:
            if num_tokens == 0 or self.lockstep:  # every rank runs the same launches
                self.runner.dummy_prefill()
            return None
        out = self.runner.prefill_launch(slot, state.token_ids[start : start + num_tokens], start)
        final = start + num_tokens >= state.num_context_tokens
        if final:
            self._sample_into([state], out.logits[:, 0])
        if self.runner.mtp:  # also for a request that just ended: the launches stay the same
            next_ids = state.token_ids[start + 1 : start + num_tokens + 1] or [0]
            draft = self.runner.prefill_draft(slot, out.hidden, next_ids, start)
            if final and state.finish_reason is None:
                position = state.num_context_tokens
                self.runner.set_tail(slot, state.token_ids[position], position, draft)
        return state if final else None

    def _sample_into(self, states: list[RequestState], logits: torch.Tensor) -> None:
        """Sample one token per row and commit it. If the launch's sampling raises, each row
        is sampled alone (draws depend only on the row), so only the failing request ends."""
        try:
            banned = self._banned(states, offset=0)
            if banned:
                logits = logits.clone()
                for (row, _), token_ids in banned.items():
                    logits[row, token_ids] = float("-inf")
            chosen = [int(t) for t in sample(logits, self._rows(states)).tolist()]
            logprobs = token_logprobs(logits, chosen, [s.sampling.logprobs for s in states])
        except Exception as exc:
            if len(states) == 1:
                self._fail(states[0], exc)
                return
            for i, state in enumerate(states):
                self._sample_into([state], logits[i : i + 1])
            return
        for state, token, entry in zip(states, chosen, logprobs):
            self._commit(state, token, entry)

    def _logprobs(
        self, states: list[RequestState], logits: torch.Tensor, chosen: list[int]
    ) -> list[dict[str, Any] | None]:
        """Logprob entries of the chosen tokens; a row that raises fails its request alone."""
        wanted = [s.sampling.logprobs for s in states]
        try:
            return token_logprobs(logits, chosen, wanted)
        except Exception:
            entries: list[dict[str, Any] | None] = []
            for i, state in enumerate(states):
                try:
                    entries += token_logprobs(
                        logits[i : i + 1], chosen[i : i + 1], wanted[i : i + 1]
                    )
                except Exception as exc:
                    self._fail(state, exc)
                    entries.append(None)
            return entries

    def _fail(self, state: RequestState, exc: Exception) -> None:
        """End one request `error` for an exception serving it; the rank serves on."""
        log.exception("request %s failed on rank %d", state.request_id, self.rank, exc_info=exc)
        state.finish_reason = FinishReason.ERROR
        state.error = ErrorInfo(code="internal", message=f"{type(exc).__name__}: {exc}")

    def _rows(self, states: list[RequestState]) -> SamplingRows:
        return sampling_rows(
            [s.sampling for s in states],
            [s.seed for s in states],
            [s.next_index for s in states],
            self.runner.device,
        )

    def _commit(self, state: RequestState, token: int, logprob: dict[str, Any] | None) -> None:
        if logprob is not None:
            state.pending_logprobs.append(logprob)
        try:
            self._append(state, token)
        except Exception as exc:  # detokenizing or stop handling: this request's alone
            self._fail(state, exc)

    def _stop_ids(self, state: RequestState) -> list[int]:
        eos = [] if state.sampling.ignore_eos else list(self.eos_token_ids)
        return eos + list(state.sampling.stop_token_ids)

    def _append(self, state: RequestState, token: int) -> None:
        state.token_ids.append(token)
        state.next_index += 1
        state.pending_ids.append(token)
        sampling = state.sampling
        may_stop = state.next_index >= sampling.min_tokens
        text = state.decoder.step(self.tokenizer, token) or ""
        hit = False
        if state.stops is not None and may_stop:
            text, hit = state.stops.feed(text)
        state.pending_text.append(text)
        if hit or (may_stop and token in self._stop_ids(state)):
            state.finish_reason = FinishReason.STOP
        elif state.next_index >= sampling.max_tokens or len(state.token_ids) >= self.max_model_len:
            state.finish_reason = FinishReason.LENGTH
        if state.finish_reason is not None and state.stops is not None and not hit:
            state.pending_text.append(state.stops.flush())

    def _collect(self, touched: list[RequestState], result: StepResult) -> StepOutput:
        chunks: list[tuple[ResultChunk, int]] = []
        for state in touched:
            first_index = state.next_index - len(state.pending_ids)
            final = state.finish_reason is not None
            chunk = ResultChunk(
                id=state.request_id,
                seq=state.next_seq,
                index=first_index,
                token_ids=state.pending_ids,
                text="".join(state.pending_text),
                finish_reason=state.finish_reason,
                error=state.error,
                logprobs=state.pending_logprobs or None,
                usage=Usage(
                    prompt_tokens=state.num_prompt_tokens,
                    completion_tokens=state.num_completion_tokens,
                )
                if final
                else None,
            )
            chunks.append((chunk, state.result_ttl_s))
            result.outcomes.append(
                RequestOutcome(
                    request_id=state.request_id,
                    admission=state.admission,
                    num_new_tokens=len(state.pending_ids),
                    finish_reason=state.finish_reason,
                )
            )
            state.next_seq += 1
            state.pending_ids, state.pending_text, state.pending_logprobs = [], [], []
            if final:
                self.slots.pop(state.slot, None)
        return StepOutput(chunks, result)


def _released(request_id: str, admission: int) -> RequestOutcome:
    """The outcome of a request this rank no longer holds, unfinished."""
    return RequestOutcome(
        request_id=request_id, admission=admission, num_new_tokens=0, released=True
    )


def _seed_of(request_id: str) -> int:
    """An unseeded request's seed, derived from its id so a resumed run draws the same."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest()) >> 1
