"""One rank's step on its model thread: launches and sampling, nothing else.

The engine keeps each request's token ids and counters by KV slot, and its sampling
parameters as per-slot device tensors written once on admission. A step runs the plan's
decode launches, then its prefill launches; every launch's sampled tokens stay on the
device until the step ends, when one transfer brings them all to the host. It decides the
endings token ids alone show (EOS or a stop token id, `max_tokens`, `max_model_len`) and
returns a StepRecord. Detokenizing, stop strings, chunks and publishing belong to the
rank's output process (npu_worker/output/); see docs/architecture.md.
"""

from __future__ import annotations

import hashlib
import logging
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from npu_worker.constraints import ConstraintError, Constraints
from npu_worker.logits import RowRules
from npu_worker.mtp import Acceptance, accept_drafts
from npu_worker.output.records import StepRecord, TokenRow
from npu_worker.runner import LaunchRunner
from npu_worker.sampler import SamplingTable, sample, token_logprobs
from schemas.control import DECODE_ROW, NewRequest, PrefillChunk, RankStepPlan

log = logging.getLogger("npu_pool.worker")


@dataclass(slots=True)
class SlotState:
    """What the model thread holds for one request in one of its KV slots."""

    request_id: str
    slot: int
    admission: int
    token_ids: list[int]  # prompt (plus tokens resumed after recovery), then new tokens
    num_context_tokens: int  # tokens of token_ids that are prompt for this run
    next_index: int  # completion index of the next token
    max_tokens: int
    min_tokens: int
    stop_ids: frozenset[int]  # EOS (unless ignored) and stop_token_ids
    logprobs: int | None
    greedy: bool
    num_prompt_tokens: int = 0  # the original prompt's: what follows is output (penalties)
    rules: RowRules | None = None  # penalties and bias
    matcher: Any = None  # its constraint's llguidance matcher
    new_ids: list[int] = field(default_factory=list)  # tokens of the current step
    new_logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None
    failure: Exception | None = None  # met at admission: it ends at its first token

    @property
    def decoding(self) -> bool:
        """True once its prompt is prefilled and while it has not ended."""
        return self.finish is None and len(self.token_ids) > self.num_context_tokens

    @property
    def adjusted(self) -> bool:
        """True when its logits are changed before it samples (beyond `min_tokens`)."""
        return self.rules is not None or self.matcher is not None


@dataclass(slots=True)
class _Sampled:
    """A launch's sampled tokens, still on the device, and the rows they belong to."""

    states: list[SlotState]
    tokens: torch.Tensor


class RankEngine:
    """Executes one rank's step plans against its launch runner."""

    def __init__(
        self,
        runner: LaunchRunner,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        rank: int = 0,
        lockstep: bool = False,
        constraints: Constraints | None = None,
    ) -> None:
        self.runner = runner
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.rank = rank
        self.lockstep = lockstep
        self.constraints = constraints
        self.epoch = -1
        self.slots: dict[int, SlotState] = {}
        self.table = SamplingTable(runner.state.num_slots, runner.device)
        self.sampled: list[_Sampled] = []
        self.touched: dict[int, SlotState] = {}
        self.totals = {"tokens": 0, "steps": 0, "decode_rows": 0, "padding_rows": 0}
        self.totals |= {"mtp_proposed": 0, "mtp_accepted": 0}
        decode_rows = 2 if runner.mtp else 1
        self.shapes = (f"B1S{runner.prefill_chunk}", f"B{runner.decode_batch}S{decode_rows}")

    def reset(self, epoch: int) -> None:
        """Drop every request: a new batcher epoch re-sends what it still wants."""
        self.epoch = epoch
        self.slots.clear()

    def drop(self, ended: list[tuple[int, str, int]]) -> None:
        """Forget requests the output process ended: (slot, request id, admission)."""
        for slot, request_id, admission in ended:
            state = self.slots.get(slot)
            if state is not None and (state.request_id, state.admission) == (request_id, admission):
                del self.slots[slot]

    def execute(self, plan: RankStepPlan, idle_ms: float = 0.0) -> StepRecord:
        """Run a plan: take on new requests, stop slots, decode launches, prefill launches."""
        started = time.perf_counter()
        if plan.epoch != self.epoch:
            self.reset(plan.epoch)
        record = StepRecord(
            plan.epoch, plan.step, self.rank, plan.incarnation, plan.new_requests, plan.stops
        )
        for new in plan.new_requests:  # a cached prefix is copied before any launch writes
            if new.blocks:  # a cache of blocks: shared ones are named, one may be copied
                self.runner.assign_blocks(new.slot, 0, new.blocks)
                if new.copy_block:
                    self.runner.copy_blocks([(new.copy_block[0], new.copy_block[1])])
                if new.restore_mark >= 0:  # and the state outside blocks at its boundary
                    self.runner.restore_mark(new.restore_mark, new.slot)
            elif new.num_cached_tokens and new.cached_from not in (-1, new.slot):
                self.runner.copy_prefix(new.cached_from, new.slot, new.num_cached_tokens)
        for slot, start, blocks in plan.blocks:  # running requests' next blocks
            self.runner.assign_blocks(slot, start, blocks)
        for new in plan.new_requests:
            self.slots[new.slot] = self._admit(new)
        for stop in plan.stops:  # the output process writes what the stop means
            state = self.slots.get(stop.slot)
            if state is not None and state.request_id == stop.request_id:
                del self.slots[stop.slot]
        self.runner.launches.clear()
        self.runner.launch_seconds.clear()
        for launch in plan.decode_launches:
            self._decode(launch, record)
        for chunk in plan.prefill:
            self._prefill(chunk, record)
        self._commit_sampled()
        for state in self.touched.values():
            record.rows.append(
                TokenRow(
                    state.slot,
                    state.admission,
                    state.new_ids,
                    state.finish,
                    state.error,
                    state.new_logprobs or None,
                )
            )
            state.new_ids, state.new_logprobs = [], []
            if state.finish is not None:
                self.slots.pop(state.slot, None)
        self.touched.clear()
        counts = record.counts
        counts.exec_ms = (time.perf_counter() - started) * 1000
        counts.launch_ms = sum(s for _, s in self.runner.launch_seconds) * 1000
        counts.idle_ms = idle_ms
        self._count(record)
        return record

    def _count(self, record: StepRecord) -> None:
        totals = self.totals
        totals["tokens"] += sum(len(row.token_ids) for row in record.rows)
        totals["steps"] += 1
        counts = record.counts
        totals["decode_rows"] += counts.num_decode_rows
        totals["padding_rows"] += counts.num_padding_rows
        totals["mtp_proposed"] += counts.num_draft_proposed
        totals["mtp_accepted"] += counts.num_draft_accepted

    def _admit(self, new: NewRequest) -> SlotState:
        sampling = new.sampling
        seed = sampling.seed if sampling.seed is not None else _seed_of(new.request_id)
        self.table.set(new.slot, sampling, seed)
        eos = frozenset() if sampling.ignore_eos else self.eos_token_ids
        state = SlotState(
            request_id=new.request_id,
            slot=new.slot,
            admission=new.admission,
            token_ids=list(new.prompt_token_ids),
            num_context_tokens=len(new.prompt_token_ids),
            next_index=new.start_index,
            max_tokens=sampling.max_tokens,
            min_tokens=sampling.min_tokens,
            stop_ids=eos | frozenset(sampling.stop_token_ids),
            logprobs=sampling.logprobs,
            greedy=sampling.temperature == 0,
            num_prompt_tokens=new.num_prompt_tokens,
            rules=RowRules.of(sampling),
        )
        if new.grammar is not None:
            try:
                if self.constraints is None:
                    raise ValueError("this rank serves no constrained output")
                resumed = new.prompt_token_ids[new.num_prompt_tokens :]
                state.matcher = self.constraints.matcher(new.grammar, resumed)
            except Exception as exc:  # it still computes its prompt: blocks the planner
                state.failure = exc  # keyed as planned may be shared by requests after it
        return state

    # -- launches -------------------------------------------------------------------------

    def _decode(self, slots: list[int], record: StepRecord) -> None:
        states = [st for s in slots if (st := self.slots.get(s)) is not None and st.decoding]
        live = [st.slot for st in states]
        counts = record.counts
        counts.num_decode_launches += 1
        counts.num_decode_rows += len(states)
        counts.num_padding_rows += self.runner.decode_batch - len(states)
        if self.runner.mtp:
            self._verify(live, states, record)
            return
        masks = self._masks_soon(states)  # computed while the launch runs
        logits = self.runner.decode(
            live, [st.token_ids[-1] for st in states], [len(st.token_ids) - 1 for st in states]
        )
        if states:
            self._sample(states, logits, masks)

    def _prefill(self, launch: list[PrefillChunk], record: StepRecord) -> None:
        """One prefill launch: one request's chunk, or (packed) several requests' segments,
        and the decode rows riding in it (`DECODE_ROW`: the request's last token at its
        position). A segment that completes its prompt samples the request's first token, a
        decode row its next one."""
        counts = record.counts
        counts.num_prefill_launches += 1
        live = [
            (_decode_row(state) if chunk.start == DECODE_ROW else chunk, state)
            for chunk in launch
            if (state := self.slots.get(chunk.slot)) is not None
            and state.finish is None
            and chunk.request_id in ("", state.request_id)  # "": a plan that names none
            and (chunk.start != DECODE_ROW or state.decoding)
        ]
        if not live:
            if not launch or self.lockstep:  # every rank runs the same launches
                self.runner.dummy_prefill()
            return
        rows = sum(state.decoding for _, state in live)
        counts.num_decode_rows += rows
        counts.num_prefill_tokens += sum(chunk.num_tokens for chunk, _ in live) - rows
        chunks = [chunk for chunk, _ in live]
        finals = [
            (j, s)
            for j, (c, s) in enumerate(live)
            if c.start + c.num_tokens >= s.num_context_tokens
        ]
        masks = self._masks_soon([s for _, s in finals])  # computed while the launch runs
        out = self.runner.prefill(
            chunks, [s.token_ids[c.start : c.start + c.num_tokens] for c, s in live]
        )
        for _, state in finals:
            if state.failure is not None:
                self._fail(state, state.failure)
        sampled = [(j, s) for j, s in finals if s.failure is None]
        if sampled:
            self._sample([s for _, s in sampled], out.logits[0, [j for j, _ in sampled]], masks)
        if self.runner.mtp:  # also for requests that just ended: the launches stay the same
            self._commit_sampled()  # the drafts read the sampled first tokens
            next_ids = [
                s.token_ids[c.start + 1 : c.start + c.num_tokens + 1] or [0] for c, s in live
            ]
            drafts = self.runner.draft_prefill(chunks, out.hidden, next_ids)
            for j, state in finals:
                if state.finish is None:
                    position = state.num_context_tokens
                    self.runner.set_tail(state.slot, state.token_ids[position], position, drafts[j])
        for chunk in chunks:  # segments ending on a block boundary a prefix may start from
            if chunk.mark >= 0:
                self.runner.save_mark(chunk.slot, chunk.mark)

    def _verify(self, live: list[int], states: list[SlotState], record: StepRecord) -> None:
        """MTP decode: verify each row's draft, commit one or two tokens, draft again."""
        max_position = max((len(s.token_ids) - 1 for s in states), default=0)
        masks = self._masks_soon(states)  # the first position's, while the launch runs
        verify = self.runner.verify(live, max_position)
        if not states:  # all padding: the draft launch still runs, as on every other rank
            nothing = torch.zeros(0, dtype=torch.long, device=self.runner.device)
            self.runner.commit(verify, nothing, nothing, nothing.bool())
            return
        logits = self._ban_early_stops(states, verify.logits)
        scores = logits
        if any(s.adjusted for s in states):
            try:
                scores = self._adjust_verify(states, logits, verify.drafts, masks)
            except Exception:  # one row's rules failed: each row is adjusted alone
                _settled(masks)  # the helper is done with the matchers first
                scores = torch.cat(
                    [
                        self._adjust_verify_alone(states, i, logits, verify.drafts)
                        for i in range(len(states))
                    ]
                )
        decided = self._accept(states, scores, verify.drafts)
        self.runner.commit(verify, decided.first, decided.second, decided.accepted)
        firsts, seconds = decided.first.tolist(), decided.second.tolist()
        accepted = decided.accepted.tolist()
        first_lp = self._logprobs(states, logits[:, 0], firsts)
        second_lp = self._logprobs(states, logits[:, 1], seconds)
        record.counts.num_draft_proposed += len(states)
        record.counts.num_draft_accepted += sum(accepted)
        for i, state in enumerate(states):
            if state.finish is not None:  # its row failed to decide
                continue
            self._commit(state, firsts[i], first_lp[i])
            if accepted[i] and state.finish is None:
                self._commit(state, seconds[i], second_lp[i])

    # -- sampling -------------------------------------------------------------------------

    def _sample(
        self,
        states: list[SlotState],
        logits: torch.Tensor,
        masks: Future[torch.Tensor] | None = None,
    ) -> None:
        """Sample one token per row (kept on the device until the step ends). If the
        launch's sampling raises, each row is sampled alone (draws depend only on the row),
        so only the failing request ends."""
        try:
            if any(s.next_index < s.min_tokens for s in states):
                logits = self._ban_early_stops(states, logits[:, None])[:, 0]
            scores = logits  # logprobs stay the model's own; the rules change what is drawn
            if any(s.adjusted for s in states):
                allowed = masks.result() if masks is not None else self._masks_now(states)
                scores = self._adjust(states, logits[:, None], [allowed], None)[:, 0]
            if all(s.greedy for s in states):  # the common case needs no sampling tensors
                tokens = scores.argmax(dim=-1)
            else:
                rows = self.table.rows(
                    [s.slot for s in states], [s.next_index for s in states], all_greedy=False
                )
                tokens = sample(scores, rows)
            if any(s.logprobs is not None for s in states):  # rare: computed right away
                chosen = tokens.tolist()
                for state, entry in zip(states, self._logprobs(states, logits, chosen)):
                    if entry is not None:
                        state.new_logprobs.append(entry)
        except Exception as exc:
            _settled(masks)  # the helper is done with the matchers before they are used here
            if len(states) == 1:
                self._fail(states[0], exc)
                return
            for i, state in enumerate(states):
                self._sample([state], logits[i : i + 1])
            return
        self.sampled.append(_Sampled(states, tokens))

    def _commit_sampled(self) -> None:
        """Bring the step's sampled tokens to the host in one transfer and commit them."""
        if not self.sampled:
            return
        tokens = torch.cat([s.tokens for s in self.sampled]).tolist()
        states = [state for s in self.sampled for state in s.states]
        self.sampled = []
        for state, token in zip(states, tokens):
            self._commit(state, token, None)

    def _commit(self, state: SlotState, token: int, logprob: dict[str, Any] | None) -> None:
        state.token_ids.append(token)
        state.next_index += 1
        state.new_ids.append(token)
        if logprob is not None:
            state.new_logprobs.append(logprob)
        self.touched[state.slot] = state
        matcher = state.matcher
        if matcher is not None and not matcher.consume_token(token):
            self._fail(state, ConstraintError(f"token {token} breaks the constraint"))
        elif (state.next_index >= state.min_tokens and token in state.stop_ids) or (
            matcher is not None and matcher.is_stopped()  # the constraint is complete
        ):
            state.finish = "stop"
        elif state.next_index >= state.max_tokens or len(state.token_ids) >= self.max_model_len:
            state.finish = "length"

    # -- a request's own rules ------------------------------------------------------------

    def _masks_soon(self, states: list[SlotState]) -> Future[torch.Tensor] | None:
        """The constrained rows' masks, computed on the helper thread; None if none is."""
        matchers = [s.matcher for s in states if s.matcher is not None]
        if not matchers or self.constraints is None:
            return None
        return self.constraints.masks_soon(matchers)

    def _masks_now(self, states: list[SlotState]) -> torch.Tensor | None:
        matchers = [s.matcher for s in states if s.matcher is not None]
        if not matchers or self.constraints is None:
            return None
        return self.constraints.masks(matchers)

    def _adjust(
        self,
        states: list[SlotState],
        logits: torch.Tensor,
        allowed: list[torch.Tensor | None],
        drafts: list[int] | None,
    ) -> torch.Tensor:
        """Logits [rows, positions, vocab] (float32, a copy) after each row's penalties,
        bias and constraint; `allowed[p]` holds the constrained rows' masks at position p
        (in row order), `drafts` the rows' draft tokens, seen from position 1 on."""
        out = logits.to(torch.float32, copy=True)
        constrained = [i for i, s in enumerate(states) if s.matcher is not None]
        for p in range(out.shape[1]):
            for i, state in enumerate(states):
                if state.rules is not None:
                    extra = [drafts[i]] if p and drafts is not None else []
                    output = state.token_ids[state.num_prompt_tokens :] + extra
                    state.rules.apply(out[i, p], state.token_ids + extra, output)
            masks = allowed[p]
            if masks is not None:  # every constrained row at once, each by its own mask
                rows = torch.tensor(constrained, dtype=torch.long, device=out.device)
                out[rows, p] = out[rows, p].masked_fill(~masks.to(out.device), float("-inf"))
        return out

    def _adjust_verify(
        self,
        states: list[SlotState],
        logits: torch.Tensor,
        drafts: torch.Tensor,
        masks: Future[torch.Tensor] | None,
    ) -> torch.Tensor:
        """A verify launch's logits after the rows' rules: the second position's mask is
        what the constraint allows after the draft."""
        draft_ids = drafts.tolist()
        first = masks.result() if masks is not None else self._masks_now(states)
        second = None
        if first is not None and self.constraints is not None:
            constrained = [i for i, s in enumerate(states) if s.matcher is not None]
            second = self.constraints.draft_masks(
                [states[i].matcher for i in constrained], [draft_ids[i] for i in constrained]
            )
        return self._adjust(states, logits, [first, second], draft_ids)

    def _adjust_verify_alone(
        self, states: list[SlotState], i: int, logits: torch.Tensor, drafts: torch.Tensor
    ) -> torch.Tensor:
        """Row i of a verify launch adjusted alone; a row whose rules raise fails its
        request and keeps the model's logits."""
        try:
            return self._adjust_verify([states[i]], logits[i : i + 1], drafts[i : i + 1], None)
        except Exception as exc:
            self._fail(states[i], exc)
            return logits[i : i + 1].float()

    def _ban_early_stops(self, states: list[SlotState], logits: torch.Tensor) -> torch.Tensor:
        """Logits [rows, positions, vocab] with stop tokens forbidden where `min_tokens` says
        the request may not end yet."""
        banned = [
            (row, offset, list(state.stop_ids))
            for row, state in enumerate(states)
            for offset in range(logits.shape[1])
            if state.next_index + offset < state.min_tokens and state.stop_ids
        ]
        if not banned:
            return logits
        logits = logits.clone()
        for row, offset, token_ids in banned:
            logits[row, offset, token_ids] = float("-inf")
        return logits

    def _accept(
        self, states: list[SlotState], logits: torch.Tensor, drafts: torch.Tensor
    ) -> Acceptance:
        """Decide every row; a row whose decision raises fails its request alone (the others
        are decided row by row, as they would have been together)."""
        try:
            rows = self.table.rows(
                [s.slot for s in states],
                [s.next_index for s in states],
                all(s.greedy for s in states),
            )
            return accept_drafts(logits, drafts, rows)
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

    def _logprobs(
        self, states: list[SlotState], logits: torch.Tensor, chosen: list[int]
    ) -> list[dict[str, Any] | None]:
        """Logprob entries of the chosen tokens; a row that raises fails its request alone."""
        wanted = [s.logprobs for s in states]
        try:
            return token_logprobs(logits, chosen, wanted)
        except Exception:
            entries: list[dict[str, Any] | None] = []
            for i, state in enumerate(states):
                row = slice(i, i + 1)
                try:
                    entries += token_logprobs(logits[row], chosen[row], wanted[row])
                except Exception as exc:
                    self._fail(state, exc)
                    entries.append(None)
            return entries

    def _fail(self, state: SlotState, exc: Exception) -> None:
        """End one request `error` for an exception serving it; the rank serves on."""
        log.exception("request %s failed on rank %d", state.request_id, self.rank, exc_info=exc)
        state.finish = "error"
        state.error = f"{type(exc).__name__}: {exc}"
        self.touched[state.slot] = state


def _decode_row(state: SlotState) -> PrefillChunk:
    """A decode row as a one-token segment: the request's last token, at its position."""
    position = len(state.token_ids) - 1
    return PrefillChunk(state.slot, position, 1, state.request_id)


def _settled(masks: Future[torch.Tensor] | None) -> None:
    """Wait until a mask computation has ended, however it ended."""
    if masks is not None:
        wait([masks])


def _seed_of(request_id: str) -> int:
    """An unseeded request's seed, derived from its id so a resumed run draws the same."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest()) >> 1
