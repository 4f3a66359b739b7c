"""Bad input never crashes anything: each kind gets its exact outcome, and the pool keeps
serving (docs/architecture.md §7)."""

from __future__ import annotations

import msgpack
from tokenizers import Tokenizer

from batcher.book import RequestBook
from batcher.durability import Delivery, ensure_groups
from batcher.scheduler import PlannerConfig, PoolState
from npu_worker.weights.tiny import ensure_tiny_model
from producer.client import Client
from schemas.codec import encode
from schemas.config import Settings
from schemas.keys import FIELD, GROUP, Keys
from schemas.messages import FinishReason, ResultChunk, Usage
from tests.helpers import check_stream, wait_until

KEYS = Keys()
GOOD = {"v": 1, "prompt_token_ids": [5, 6, 7], "sampling": {"max_tokens": 4}}

# request id -> (fields over GOOD, expected error code, text the message must contain)
REJECTED = {
    "version": ({"v": 2}, "unsupported_version", "field `v`: unknown schema version 2"),
    "both-prompts": ({"prompt": "hi"}, "invalid_request", "exactly one of"),
    "no-prompt": ({"prompt_token_ids": None}, "invalid_request", "exactly one of"),
    "vocab": (
        {"prompt_token_ids": [5, 99999]},
        "invalid_request",
        "token id 99999 is outside the vocabulary of 512",
    ),
    "too-long": (
        {"prompt_token_ids": [5] * 300},
        "prompt_too_long",
        "300 tokens leave no room for a completion within max_model_len=256",
    ),
    "zero-tokens": (
        {"sampling": {"max_tokens": 0}},
        "invalid_request",
        "field `sampling.max_tokens`",
    ),
    "negative-tokens": (
        {"sampling": {"max_tokens": -1}},
        "invalid_request",
        "field `sampling.max_tokens`",
    ),
    "over-limit": (
        {"sampling": {"max_tokens": 257}},
        "invalid_request",
        "`sampling.max_tokens`: 257 exceeds max_model_len=256",
    ),
    "negative-temperature": (
        {"sampling": {"temperature": -1.0}},
        "invalid_request",
        "field `sampling.temperature`",
    ),
    "nan-temperature": (
        {"sampling": {"temperature": float("nan")}},
        "invalid_request",
        "field `sampling.temperature`",
    ),
    "top-p-zero": ({"sampling": {"top_p": 0.0}}, "invalid_request", "field `sampling.top_p`"),
    "top-p-high": ({"sampling": {"top_p": 1.01}}, "invalid_request", "field `sampling.top_p`"),
    "unknown-field": ({"colour": "blue"}, "invalid_request", "field `colour`"),
    "bool-ids": (
        {"prompt_token_ids": [True, False]},
        "invalid_request",
        "field `prompt_token_ids.0`: Input should be a valid integer",
    ),
    "bool-stop-ids": (
        {"sampling": {"stop_token_ids": [True]}},
        "invalid_request",
        "field `sampling.stop_token_ids.0`",
    ),
    "too-large": (
        {"metadata": {f"k{i}": "x" * 30 for i in range(30)}, "prompt_token_ids": [5] * 200},
        "too_large",
        "over max_request_bytes=1024",
    ),
}


def request_prompt(fields: dict) -> list[int]:
    """The prompt ids of a REJECTED case."""
    return (GOOD | fields).get("prompt_token_ids") or []


DEAD = [
    (b"\xc1 not msgpack at all", "not msgpack"),
    (msgpack.packb([1, 2, 3]), "not a map"),
    (msgpack.packb({"v": 1, "prompt": "no id"}), "no usable `id`"),
    (msgpack.packb({"v": 1, "id": "bad id!", "prompt": "x"}), "no usable `id`"),
]


def test_every_kind_of_bad_entry_gets_its_outcome_and_good_requests_still_complete(
    start_pool, client: Client, redis_client
) -> None:
    start_pool(ranks=1, max_model_len=256, max_request_bytes=1024)
    for raw, _ in DEAD:
        redis_client.xadd(KEYS.requests, {"m": raw})
    redis_client.xadd(KEYS.requests, {"not_m": b"wrong field"})
    for request_id, (fields, _, _) in REJECTED.items():
        request = GOOD | {"id": request_id} | fields
        redis_client.xadd(KEYS.requests, {"m": msgpack.packb(request)})

    for request_id, (fields, code, text) in REJECTED.items():
        chunks = list(client.stream(request_id, timeout_s=60))
        assert len(chunks) == 1, request_id
        final = chunks[0]
        assert final.finish_reason == FinishReason.REJECTED, request_id
        assert final.error is not None and final.error.code == code, (request_id, final.error)
        assert text in final.error.message, (request_id, final.error.message)
        prompt = request_prompt(fields)
        read = request_id in ("vocab", "too-long", "over-limit")  # rejected after tokenizing
        assert final.usage is not None, request_id
        want = Usage(prompt_tokens=len(prompt) if read else 0, completion_tokens=0)
        assert final.usage == want, (request_id, final.usage)

    wait_until(lambda: redis_client.xlen(KEYS.dead) == len(DEAD) + 1, what="dead letters")
    reasons = [f[b"reason"].decode() for _, f in redis_client.xrange(KEYS.dead)]
    for (_, reason), got in zip(DEAD, reasons):
        assert reason in got
    assert "no field `m`" in reasons[-1]

    good = client.generate(prompt="still serving", max_tokens=5, timeout_s=60)
    assert good.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    wait_until(lambda: redis_client.xlen(KEYS.requests) == 0, what="every entry deleted")


def test_a_duplicate_id_of_a_running_request_is_a_dead_letter_and_the_original_completes(
    start_pool, client: Client, redis_client
) -> None:
    start_pool(ranks=1, max_model_len=512)
    client.submit(prompt_token_ids=[9] * 20, request_id="twin", max_tokens=200, ignore_eos=True)
    wait_until(lambda: redis_client.xlen(KEYS.result("twin")) > 2, what="twin to be running")
    redis_client.xadd(KEYS.requests, {"m": msgpack.packb(GOOD | {"id": "twin"})})
    tokens = check_stream(list(client.stream("twin", timeout_s=120)))
    assert len(tokens) == 200
    wait_until(lambda: redis_client.xlen(KEYS.dead) == 1, what="the duplicate's dead letter")
    ((_, fields),) = redis_client.xrange(KEYS.dead)
    assert "duplicates a request in progress" in fields[b"reason"].decode()
    wait_until(lambda: redis_client.xlen(KEYS.requests) == 0, what="every entry deleted")


def test_an_id_submitted_again_once_its_final_chunk_is_written_is_kept_not_dead(
    redis_client,
) -> None:
    """Between a request's final chunk and its rank's step result the pool still tracks it;
    the same id submitted again in that moment is served once (its result kept), not a
    duplicate of a request in progress."""
    settings = Settings(model="tiny", max_model_len=256)
    planner = PlannerConfig(1, 4, 4, 4, 128, 1)
    book = RequestBook(redis_client, KEYS, settings, PoolState(planner))
    tokenizer = Tokenizer.from_file(str(ensure_tiny_model() / "tokenizer.json"))
    book.use_model(tokenizer, None, tokenizer.get_vocab_size())
    ensure_groups(redis_client, KEYS)
    stream = KEYS.request_stream(0)

    def delivered() -> Delivery:
        redis_client.xadd(stream, {FIELD: msgpack.packb(GOOD | {"id": "again"})})
        ((_, [(entry_id, fields)]),) = redis_client.xreadgroup(GROUP, "pool", {stream: ">"})
        return Delivery(entry_id, fields, 1, stream)

    book.accept([delivered()], resume=False)
    final = ResultChunk(id="again", seq=0, index=0, token_ids=[5], finish_reason="length")
    redis_client.xadd(KEYS.result("again"), {FIELD: encode(final), "seq": 0, "final": 1})
    again = delivered()
    book.accept([again], resume=False)
    assert redis_client.xlen(KEYS.dead) == 0
    assert again.entry_id not in [e for e, _ in redis_client.xrange(stream)]  # settled
    assert redis_client.xpending(stream, GROUP)["pending"] == 1
