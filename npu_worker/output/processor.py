"""A rank's output processing: step records in, result chunks and the step result out.

It runs in the rank's output process (process.py), so detokenizing, stop
strings, chunk encoding and publishing never hold the GIL against the launches. It keeps
each request's streaming detokenizer, stop-string state and chunk counters by slot, ends
the requests whose text hits a stop string (tokens after it never reach the stream) and
reports those back so the model thread stops spending rows on them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import msgpack
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from npu_worker.output.records import StepRecord, TokenRow
from npu_worker.output.stops import StopStrings
from schemas.control import PREEMPTED, NewRequest, RequestOutcome, SlotStop, StepResult
from schemas.keys import DEFAULT_TENANT
from schemas.messages import SCHEMA_VERSION

log = logging.getLogger("npu_pool.worker")


@dataclass(slots=True)
class RequestOutput:
    """What the output process holds for one request in one KV slot."""

    request_id: str
    slot: int
    admission: int
    num_prompt_tokens: int
    num_cached_tokens: int  # of its prompt, held from a cached prefix at its admission
    next_index: int  # completion index of the next token
    next_seq: int  # chunk number of the next chunk
    result_ttl_s: int
    min_tokens: int
    decoder: DecodeStream
    stops: StopStrings | None
    tenant: str = DEFAULT_TENANT


@dataclass(slots=True)
class Chunk:
    """One encoded chunk for a result stream, with what its append needs."""

    request_id: str
    slot: int
    admission: int
    seq: int
    payload: bytes
    final: bool
    ttl_s: int


@dataclass(slots=True)
class StepOutput:
    """A step's chunks (in order), its result, and the requests this process ended."""

    chunks: list[Chunk]
    result: StepResult
    ended: list[tuple[int, str, int]] = field(default_factory=list)  # (slot, id, admission)


class OutputProcessor:
    """Turns a rank's step records into chunks and step results."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[int, RequestOutput] = {}

    def reset(self) -> None:
        """Drop every request (a new incarnation or epoch)."""
        self.requests.clear()

    def process(self, record: StepRecord) -> StepOutput:
        """The chunks and the step result of one step record."""
        result = StepResult(
            record.epoch, record.step, record.rank, record.incarnation, [], record.counts
        )
        output = StepOutput([], result)
        for new in record.new_requests:
            self.requests[new.slot] = self._admit(new)
        for stop in record.stops:
            self._stop(stop, output)
        for row in record.rows:
            request = self.requests.get(row.slot)
            if request is not None and request.admission == row.admission:
                self._tokens(row, request, output)
        return output

    def _admit(self, new: NewRequest) -> RequestOutput:
        resumed = new.prompt_token_ids[new.num_prompt_tokens :]
        stops = list(new.sampling.stop)
        request = RequestOutput(
            request_id=new.request_id,
            slot=new.slot,
            admission=new.admission,
            num_prompt_tokens=new.num_prompt_tokens,
            num_cached_tokens=min(new.num_cached_tokens, new.num_prompt_tokens),
            next_index=new.start_index - len(resumed),
            next_seq=new.start_seq,
            result_ttl_s=new.result_ttl_s,
            min_tokens=new.sampling.min_tokens,
            decoder=DecodeStream(skip_special_tokens=True),
            stops=StopStrings(stops) if stops else None,
            tenant=new.tenant,
        )
        # A resumed request's decoder and stop strings replay the tokens it published, so
        # they hold what they held then (part of a character, text that may begin a stop
        # string) and its next chunks carry the text they carried before a failure.
        for token in resumed:
            request.next_index += 1
            text = request.decoder.step(self.tokenizer, token) or ""
            if request.stops is not None and request.next_index >= request.min_tokens:
                request.stops.feed(text)
        return request

    def _stop(self, stop: SlotStop, output: StepOutput) -> None:
        """A cancel or deadline ends the request here; a preemption gives it back."""
        request = self.requests.get(stop.slot)
        if request is None or request.request_id != stop.request_id:
            output.result.outcomes.append(
                RequestOutcome(stop.request_id, stop.admission, 0, released=True)
            )
            return
        del self.requests[stop.slot]
        if stop.finish_reason == PREEMPTED:
            output.result.outcomes.append(
                RequestOutcome(request.request_id, request.admission, 0, released=True)
            )
            return
        text = request.stops.flush() if request.stops is not None else ""
        self._emit(request, [], text, None, stop.finish_reason, None, output)

    def _tokens(self, row: TokenRow, request: RequestOutput, output: StepOutput) -> None:
        """Detokenize a row's tokens, cut at a stop string, and emit its chunk."""
        pieces: list[str] = []
        token_ids: list[int] = []
        finish, error = row.finish, row.error
        hit = False
        try:
            for token in row.token_ids:
                token_ids.append(token)
                request.next_index += 1
                text = request.decoder.step(self.tokenizer, token) or ""
                if request.stops is not None and request.next_index >= request.min_tokens:
                    text, hit = request.stops.feed(text)
                pieces.append(text)
                if hit:  # tokens after the stop string never reach the stream
                    finish, error = "stop", None
                    break
            if finish is not None and request.stops is not None and not hit:
                pieces.append(request.stops.flush())
        except Exception as exc:  # detokenizing or stop handling: this request's alone
            log.exception("request %s failed in output processing", request.request_id)
            finish, error = "error", f"{type(exc).__name__}: {exc}"
        if finish is not None:
            del self.requests[row.slot]
            if row.finish is None:  # the model thread does not know yet
                output.ended.append((row.slot, request.request_id, request.admission))
        logprobs = row.logprobs[: len(token_ids)] if row.logprobs else None
        self._emit(request, token_ids, "".join(pieces), logprobs, finish, error, output)

    def _emit(
        self,
        request: RequestOutput,
        token_ids: list[int],
        text: str,
        logprobs: list[dict[str, Any]] | None,
        finish: str | None,
        error: str | None,
        output: StepOutput,
    ) -> None:
        final = finish is not None
        chunk = {
            "v": SCHEMA_VERSION,
            "id": request.request_id,
            "seq": request.next_seq,
            "index": request.next_index - len(token_ids),
            "token_ids": token_ids,
            "text": text,
            "finish_reason": finish,
            "error": {"code": "internal", "message": error} if error is not None else None,
            "usage": {
                "prompt_tokens": request.num_prompt_tokens,
                "completion_tokens": request.next_index,
                "cached_tokens": request.num_cached_tokens,
            }
            if final
            else None,
            "logprobs": logprobs,
            "tenant": request.tenant if final else None,
        }
        output.chunks.append(
            Chunk(
                request.request_id,
                request.slot,
                request.admission,
                request.next_seq,
                msgpack.packb(chunk),
                final,
                request.result_ttl_s,
            )
        )
        request.next_seq += 1
        output.result.outcomes.append(
            RequestOutcome(request.request_id, request.admission, len(token_ids), finish)
        )
