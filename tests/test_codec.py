"""The wire codec: round trips, version check, and how bad entries are sorted."""

from __future__ import annotations

import msgpack
import pytest

from npu_worker.output.records import StepRecord, TokenRow
from schemas.codec import CodecError, DeadLetter, Rejected, decode, decode_request, encode
from schemas.control import (
    PrefillChunk,
    RankStepPlan,
    RequestOutcome,
    SlotStop,
    StepCounts,
    StepResult,
)
from schemas.messages import FinishReason, GenerateRequest, ResultChunk, SamplingParams, Usage

pytestmark = pytest.mark.fast

MAX_BYTES = 1 << 20


def packed(**fields: object) -> bytes:
    return msgpack.packb({"v": 1, "id": "req-1", "prompt": "hi"} | fields)


def test_request_round_trips_through_msgpack() -> None:
    request = GenerateRequest(
        id="a.b:c-1",
        prompt_token_ids=[3, 4],
        sampling=SamplingParams(max_tokens=7, temperature=0.5, stop=["x"], seed=9),
        priority=2,
        metadata={"tenant": "t1"},
    )
    assert decode(GenerateRequest, encode(request)) == request


def test_final_chunk_round_trips_with_usage_and_reason() -> None:
    chunk = ResultChunk(
        id="r",
        seq=3,
        index=10,
        token_ids=[1, 2],
        text="é",
        finish_reason=FinishReason.STOP,
        usage=Usage(prompt_tokens=4, completion_tokens=12),
    )
    back = decode(ResultChunk, encode(chunk))
    assert back == chunk and back.is_final and back.finish_reason == "stop"


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"\xc1\xff garbage", "not msgpack"),
        (msgpack.packb([1, 2, 3]), "not a map"),
        (msgpack.packb({"prompt": "no id"}), "no usable `id`"),
        (msgpack.packb({"id": "has space", "prompt": "x"}), "no usable `id`"),
        (msgpack.packb({"id": 17, "prompt": "x"}), "no usable `id`"),
    ],
)
def test_entries_without_a_usable_id_are_dead_letters(raw: bytes, reason: str) -> None:
    with pytest.raises(DeadLetter, match=reason):
        decode_request(raw, MAX_BYTES)


@pytest.mark.parametrize(
    ("fields", "code", "field_name"),
    [
        ({"v": 3}, "unsupported_version", "`v`"),
        ({"prompt": None}, "invalid_request", "exactly one of"),
        ({"prompt_token_ids": [1]}, "invalid_request", "exactly one of"),
        ({"sampling": {"max_tokens": 0}}, "invalid_request", "`sampling.max_tokens`"),
        ({"sampling": {"temperature": -0.5}}, "invalid_request", "`sampling.temperature`"),
        ({"sampling": {"top_p": 0.0}}, "invalid_request", "`sampling.top_p`"),
        ({"sampling": {"top_p": 1.5}}, "invalid_request", "`sampling.top_p`"),
        ({"colour": "blue"}, "invalid_request", "`colour`"),
    ],
)
def test_parsable_bad_entries_are_rejected_naming_the_field(
    fields: dict, code: str, field_name: str
) -> None:
    with pytest.raises(Rejected) as info:
        decode_request(packed(**fields), MAX_BYTES)
    assert info.value.request_id == "req-1"
    assert info.value.code == code
    assert field_name in info.value.message


def test_entry_over_max_request_bytes_is_rejected_with_its_size() -> None:
    raw = packed(prompt="x" * 2000)
    with pytest.raises(Rejected) as info:
        decode_request(raw, 1000)
    assert info.value.code == "too_large"
    assert str(len(raw)) in info.value.message


def test_decode_names_the_expected_type_on_a_wrong_message() -> None:
    with pytest.raises(CodecError, match="ResultChunk"):
        decode(ResultChunk, msgpack.packb({"id": "x"}))


def test_step_results_and_records_round_trip_with_their_counts() -> None:
    counts = StepCounts(3, 17, 7, 2, 250, 17, 11, 12.5, 11.0, 0.25)
    result = StepResult(4, 99, 1, "inc", [RequestOutcome("r1", 2, 2, "stop")], counts)
    assert StepResult.decode(result.encode()) == result
    record = StepRecord(4, 99, 1, "inc", stops=[SlotStop(5, "r2", "cancelled", 1)], counts=counts)
    record.rows.append(TokenRow(3, 2, [10, 11], "stop"))
    assert StepRecord.decode(record.encode()) == record
    with pytest.raises(ValueError, match="not a step result"):
        StepResult.decode(msgpack.packb([4, 99, 1, "inc", [], [1, 2]]))


def test_step_plans_round_trip_with_each_prefill_chunks_request_id() -> None:
    chunks = [[PrefillChunk(0, 128, 72, "r0"), PrefillChunk(1, 0, 40, "r1")], []]
    plan = RankStepPlan(3, 8, 1, "inc", decode_launches=[[2, 3]], prefill=chunks)
    wire = msgpack.unpackb(plan.encode())
    assert wire[6] == [[[0, 128, 72, "r0"], [1, 0, 40, "r1"]], []]
    assert RankStepPlan.decode(plan.encode()) == plan
    three_fields = msgpack.packb([3, 8, 1, "inc", [], [], [[[0, 0, 10]]], []])
    with pytest.raises(ValueError, match="not a step plan"):
        RankStepPlan.decode(three_fields)
