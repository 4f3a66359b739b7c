"""Small factories shared by the tests: reference generation and stream checks."""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from tokenizers import Tokenizer

from npu_worker.engine import RankEngine
from npu_worker.output.processor import OutputProcessor
from npu_worker.runner import LaunchRunner
from npu_worker.weights.loader import LoadedModel, load_model
from npu_worker.weights.presets import resolve_model_dir
from schemas.codec import decode
from schemas.config import Settings
from schemas.control import RankStepPlan, StepResult
from schemas.messages import ResultChunk
from tests.reference import ReferenceCompletion, generate_alone

if TYPE_CHECKING:
    from producer.client import Client
    from tests.conftest import StartPool

# float32 rows computed in different batch positions may differ by rounding; a top-2 gap
# under this is a near-tie that may resolve either way (docs/architecture.md §7).
TIE_TOLERANCE = 1e-3


def load_reference_model(settings: Settings) -> LoadedModel:
    """The pool's model, loaded in this process on the CPU."""
    return load_model(
        resolve_model_dir(settings.model), settings.dtype, torch.device("cpu"), settings.max_kv_len
    )


def reference_runner(loaded: LoadedModel, settings: Settings) -> LaunchRunner:
    """Launches of the same shapes as the pool's ranks, for lone-request references, on
    slots that reserve every position (a pool's cache of blocks is computed another way)."""
    shapes = replace(
        settings.launch_shapes(), block_size=0, kv_cache_memory=0, kv_cache_fraction=0.0
    )
    return LaunchRunner(loaded.model, shapes)


def reference(
    loaded: LoadedModel,
    runner: LaunchRunner,
    settings: Settings,
    prompt_ids: list[int],
    max_tokens: int,
) -> ReferenceCompletion:
    """Greedy tokens of the request run alone."""
    return generate_alone(
        runner, prompt_ids, max_tokens, set(loaded.config.eos_token_ids), settings.max_model_len
    )


@dataclass(slots=True)
class LocalStep:
    """What one step of a LocalRank wrote: its chunks, decoded, and its step result."""

    chunks: list[ResultChunk]
    result: StepResult


class LocalRank:
    """A rank's model thread and output processing in this process, with no Redis: the
    engine's records go straight through the output processor, as the output process does."""

    def __init__(
        self,
        runner: LaunchRunner,
        tokenizer: Tokenizer,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        rank: int = 0,
        lockstep: bool = False,
    ) -> None:
        self.engine = RankEngine(runner, eos_token_ids, max_model_len, rank, lockstep)
        self.output = OutputProcessor(tokenizer)

    def execute(self, plan: RankStepPlan) -> LocalStep:
        """Run one plan; the chunks it publishes and its step result."""
        out = self.output.process(self.engine.execute(plan))
        self.engine.drop(out.ended)
        chunks = [decode(ResultChunk, chunk.payload) for chunk in out.chunks]
        return LocalStep(chunks, out.result)

    @property
    def busy_slots(self) -> list[int]:
        """Slots of requests still running."""
        return sorted(self.engine.slots)


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    """Token ids that avoid the special tokens (ids 0 and 1 of the tiny tokenizer)."""
    return [rng.randrange(2, vocab_size) for _ in range(length)]


def check_stream(chunks: list[ResultChunk]) -> list[int]:
    """Assert the stream guarantees (contiguous seq and index, one final chunk); return tokens."""
    assert chunks, "empty result stream"
    tokens: list[int] = []
    for seq, chunk in enumerate(chunks):
        assert chunk.seq == seq, f"seq {chunk.seq} at position {seq}"
        assert chunk.index == len(tokens), f"chunk {seq} index {chunk.index} != {len(tokens)}"
        tokens += chunk.token_ids
    finals = [c for c in chunks if c.finish_reason is not None]
    assert len(finals) == 1 and finals[0] is chunks[-1], "exactly one final chunk, at the end"
    return tokens


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0, what: str = "") -> None:
    """Poll `condition` until it holds; fail the test with `what` if it never does."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or condition}")
        time.sleep(0.02)


def interrupt_once_shown(
    process: subprocess.Popen[bytes], marker: bytes, count: int, timeout_s: float = 120.0
) -> tuple[bytes, bytes]:
    """Read a live view's stdout until `marker` has appeared `count` times, then Ctrl-C it
    (so the signal never lands while the interpreter is still starting); its (stdout,
    stderr) once it exits. Fails with what it printed if it shows too little or never exits."""
    assert process.stdout is not None and process.stderr is not None
    seen = bytearray()
    failure = ""
    deadline = time.monotonic() + timeout_s
    while seen.count(marker) < count:
        if process.poll() is not None:
            failure = f"exited {process.returncode} before showing {marker!r} {count} times"
            break
        if time.monotonic() > deadline:
            failure = f"showed {marker!r} {seen.count(marker)} of {count} times in {timeout_s}s"
            break
        ready, _, _ = select.select([process.stdout], [], [], 0.5)
        if ready:
            seen += os.read(process.stdout.fileno(), 65536)
    process.send_signal(signal.SIGINT)
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        failure = failure or f"did not exit within {timeout_s}s of Ctrl-C"
    out = bytes(seen) + out
    assert not failure, f"{failure}:\n{out.decode()[-2000:]}\n{err.decode()[-2000:]}"
    return out, err


def check_prefix_hits_match_misses(
    start_pool: StartPool,
    client: Client,
    vocab_size: int,
    seed: int,
    cached: int,
    **settings: Any,
) -> None:
    """Six prompts sharing a 300-token system prompt, greedy and seeded sampling in turn,
    on a pool with prefix caching on, then on one with it off (the first prompt alone, then
    the rest at once): the misses cache nothing, every hit after the first caches `cached`
    tokens, and each request's 10 tokens and logprobs are the same bit for bit."""
    rng = random.Random(seed)
    system = random_prompt(rng, 300, vocab_size)
    prompts = [system + random_prompt(rng, rng.randint(4, 40), vocab_size) for _ in range(6)]
    options: list[dict[str, Any]] = [
        {"temperature": 0.9, "seed": seed + i} if i % 2 else {"temperature": 0.0}
        for i in range(len(prompts))
    ]
    served: dict[bool, list[tuple[list[int], list[Any], int]]] = {}
    for caching in (True, False):
        pool = start_pool(prefix_caching=caching, **settings)
        results = []
        for batch in ([0], list(range(1, len(prompts)))):
            ids = [
                client.submit(
                    prompt_token_ids=prompts[i],
                    max_tokens=10,
                    ignore_eos=True,
                    logprobs=2,
                    **options[i],
                )
                for i in batch
            ]
            for request_id in ids:
                chunks = list(client.stream(request_id, timeout_s=180))
                logprobs = [entry for chunk in chunks for entry in chunk.logprobs or []]
                usage = chunks[-1].usage
                assert usage is not None
                results.append((check_stream(chunks), logprobs, usage.cached_tokens))
        served[caching] = results
        pool.supervised = False
        pool.processes.stop(timeout_s=30)
    hits, misses = served[True], served[False]
    assert [n for _, _, n in misses] == [0] * len(prompts)
    assert hits[0][2] == 0 and all(n == cached for _, _, n in hits[1:]), hits
    for (tokens, logprobs, _), (want_tokens, want_logprobs, _) in zip(hits, misses, strict=True):
        assert len(tokens) == len(logprobs) == 10
        assert tokens == want_tokens
        assert logprobs == want_logprobs
