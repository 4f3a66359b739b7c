"""A rank's output process: it turns the model thread's step records into chunks and step
results and publishes each step with one Redis call, in order, while the next step runs.

The process is spawned once per rank (it never imports torch) and fed over a pipe; a
second pipe carries back the requests it ended (stop strings, output errors, streams that
moved on) and publishing failures. Everything a step writes (its chunks, then its step
result) is one script call fenced by the rank's incarnation: a rank the batcher declared
lost writes nothing.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
from multiprocessing.connection import Connection
from typing import Any

import redis
from tokenizers import Tokenizer

from npu_worker.output.processor import OutputProcessor, StepOutput
from npu_worker.output.records import Feedback, StepRecord
from schemas.config import Settings
from schemas.connection import connect, reset_connections
from schemas.control import RequestOutcome
from schemas.keys import STEP_RESULTS_MAXLEN, Keys
from schemas.results import ALREADY_FINAL, APPENDED, FENCED, STEP_SCRIPT

log = logging.getLogger("npu_pool.worker")
RECORD, RESET, QUIT = b"R", b"X", b"Q"


class OutputProcess:
    """The model thread's handle on its output process."""

    def __init__(self, settings: Settings, rank: int, tokenizer: Tokenizer) -> None:
        context = multiprocessing.get_context("spawn")
        records_out, self.records = context.Pipe(duplex=False)
        self.feedback, feedback_in = context.Pipe(duplex=False)
        self.process = context.Process(
            target=run,
            args=(settings, rank, tokenizer.to_str(), records_out, feedback_in),
            name=f"npu-pool rank{rank} output",
            daemon=True,
        )
        self.process.start()
        records_out.close()
        feedback_in.close()

    def send(self, record: StepRecord) -> None:
        """Hand over one executed step (blocks only while the pipe is full)."""
        self.records.send_bytes(RECORD + record.encode())

    def take_feedback(self) -> Feedback:
        """Everything the output process reported since the last call, merged."""
        merged = Feedback()
        while self.feedback.poll():
            got = Feedback.decode(self.feedback.recv_bytes())
            merged.ended += got.ended
            merged.failed |= got.failed
        return merged

    def reset(self) -> None:
        """Wait until every step handed over is published (or refused), then forget every
        request: a new incarnation starts from nothing."""
        self.records.send_bytes(RESET)
        while not Feedback.decode(self.feedback.recv_bytes()).acked:
            pass

    @property
    def alive(self) -> bool:
        """True while the process runs."""
        return self.process.is_alive()

    def close(self) -> None:
        """Publish what is queued, then stop the process."""
        with contextlib.suppress(OSError):  # the process may be gone already
            self.records.send_bytes(QUIT)
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()


def run(
    settings: Settings, rank: int, tokenizer_json: str, records: Connection, feedback: Connection
) -> None:
    """The output process's loop: process and publish each step record, in order."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} output %(message)s")
    publisher = StepPublisher(settings, rank)
    processor = OutputProcessor(Tokenizer.from_str(tokenizer_json))
    while True:
        try:
            message = records.recv_bytes()
        except EOFError:  # the model thread is gone
            return
        kind, body = message[:1], message[1:]
        if kind == QUIT:
            return
        if kind == RESET:
            processor.reset()
            publisher.lost = []
            feedback.send_bytes(Feedback(acked=True).encode())
            continue
        record = StepRecord.decode(body)
        output = processor.process(record)
        refused, failed = publisher.publish(output)
        for slot, request_id, _ in refused:
            held = processor.requests.get(slot)
            if held is not None and held.request_id == request_id:
                del processor.requests[slot]
        ended = output.ended + refused
        if ended or failed:
            feedback.send_bytes(Feedback(ended, failed).encode())


class StepPublisher:
    """Publishes one step's chunks and result with one fenced script call."""

    def __init__(self, settings: Settings, rank: int) -> None:
        self.keys = Keys(settings.namespace)
        self.results_key = self.keys.step_results(settings.pool)
        self.rank_key = self.keys.rank(settings.pool, rank)
        self.redis = connect(settings.redis_url)
        self.script = self.redis.register_script(STEP_SCRIPT)
        self.lost: list[RequestOutcome] = []  # refused last step: told to the batcher now

    def publish(self, output: StepOutput) -> tuple[list[tuple[int, str, int]], bool]:
        """Write the step; returns the requests whose streams refused it (another writer
        moved them on) and whether the rank must start afresh (fenced, or Redis failed)."""
        result = output.result
        result.outcomes += self.lost
        self.lost = []
        keys = [self.results_key, self.rank_key]
        args: list[Any] = [result.incarnation, result.encode(), STEP_RESULTS_MAXLEN]
        for chunk in output.chunks:
            keys.append(self.keys.result(chunk.request_id))
            args += [chunk.seq, chunk.payload, "1" if chunk.final else "0", chunk.ttl_s]
        try:
            replies = self.script(keys=keys, args=args)
        except redis.RedisError as exc:
            log.warning("publishing failed (%s); the rank starts afresh", exc)
            reset_connections(self.redis)
            return [], True
        if replies == FENCED:
            log.warning("this rank was replaced or declared lost; it starts afresh")
            return [], True
        refused = []
        complete: list[str] = []
        overtaken: list[str] = []
        for chunk, reply in zip(output.chunks, replies):
            if reply != APPENDED:
                self.lost.append(RequestOutcome(chunk.request_id, chunk.admission, 0, lost=True))
                refused.append((chunk.slot, chunk.request_id, chunk.admission))
                (complete if reply == ALREADY_FINAL else overtaken).append(chunk.request_id)
        if complete:  # the idempotent case: an id submitted again after it finished
            log.info(
                "already complete, result kept as it is (an id submitted again is served once): %s",
                sorted(complete),
            )
        if overtaken:
            log.info(
                "result streams written further by another delivery; dropped here: %s",
                sorted(overtaken),
            )
        return refused, False
