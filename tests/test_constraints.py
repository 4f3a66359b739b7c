"""Constrained output and the per-request logit rules, on a real pool: every kind of
constraint validates, plain rows beside constrained ones keep their tokens bit for bit (MTP
on and off), a constraint that cannot compile is refused at admission, `logit_bias` bans and
forces, and `repetition_penalty` gives `transformers`' tokens."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

import msgpack
import pytest
import torch
from pydantic import BaseModel, Field, ValidationError

from producer.client import Client
from schemas.keys import Keys
from tests.conftest import StartPool
from tests.helpers import check_stream, load_reference_model, reference_runner
from tests.reference import ReferenceCompletion, first_divergence, generate_alone

transformers = pytest.importorskip("transformers")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 5}, "zip": {"type": "boolean"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "role", "tags", "home"],
}


class Home(BaseModel):
    city: str = Field(max_length=5)


class Person(BaseModel):
    name: str = Field(max_length=6)
    role: Literal["admin", "user", "guest"]
    home: Home


def _valid_person(value: object) -> bool:
    if not isinstance(value, dict) or set(value) - set(PERSON["properties"]):
        return False
    ok = isinstance(value["name"], str) and len(value["name"]) <= 6
    ok &= isinstance(value["age"], int) and 0 <= value["age"] <= 120
    ok &= value["role"] in ("admin", "user", "guest")
    ok &= 1 <= len(value["tags"]) <= 3 and all(t in "abc" for t in value["tags"])
    home = value["home"]
    ok &= isinstance(home, dict) and isinstance(home["city"], str) and len(home["city"]) <= 5
    return bool(ok) and set(home) <= {"city", "zip"}


CONSTRAINED = [
    ({"type": "json_schema", "json_schema": PERSON, "strict": True}, _valid_person),
    ({"type": "json_object"}, lambda v: isinstance(v, dict)),
    ({"type": "regex", "pattern": r"[0-9]{3}-[0-9]{4}"}, None),
    ({"type": "choice", "choices": ["red", "green", "blue"]}, None),
    ({"type": "grammar", "grammar": 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/'}, None),
]


def _check(kind: dict, validator: object, text: str) -> None:
    if kind["type"] == "regex":
        assert re.fullmatch(kind["pattern"], text), text
    elif kind["type"] == "choice":
        assert text in kind["choices"], text
    elif kind["type"] == "grammar":
        assert re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})*\)", text), text
    else:
        assert callable(validator) and validator(json.loads(text)), text


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
def test_constrained_rows_validate_and_plain_rows_beside_them_keep_their_tokens(
    mtp: bool, start_pool: StartPool, client: Client
) -> None:
    start_pool(ranks=1, decode_batch=8, mtp=mtp)
    plain = [[5 + i, 9, 13, 2 * i + 3] for i in range(6)]
    alone = [client.generate(prompt_token_ids=p, max_tokens=24, ignore_eos=True) for p in plain]
    # the same plain requests again, in the same launches as constrained ones (greedy and
    # sampled, several of each kind)
    constrained = [
        (
            kind,
            check,
            client.submit(f"n{i}", max_tokens=120, temperature=t, seed=i, constraint=kind),
        )
        for i, (kind, check) in enumerate(CONSTRAINED * 2)
        for t in (0.0, 0.9)
    ]
    beside = [client.submit(prompt_token_ids=p, max_tokens=24, ignore_eos=True) for p in plain]
    for request_id, want in zip(beside, alone):
        assert check_stream(list(client.stream(request_id, timeout_s=120))) == want.token_ids
    for kind, check, request_id in constrained:
        done = client.result(request_id, timeout_s=120)
        assert done.finish_reason == "stop", (kind["type"], done)
        _check(kind, check, done.text)


def test_a_pydantic_model_constrains_and_result_parses(
    start_pool: StartPool, client: Client
) -> None:
    start_pool(ranks=1)
    done = client.generate("someone", max_tokens=100, constraint=Person)
    assert isinstance(done.parsed, Person)
    assert Person.model_validate_json(done.text) == done.parsed
    assert client.generate("plain", max_tokens=3).parsed is None


def test_a_constraint_that_cannot_compile_is_refused_by_client_and_by_the_batcher(
    start_pool: StartPool, client: Client, redis_client: object
) -> None:
    with pytest.raises(ValidationError, match="regex does not compile"):
        client.submit("x", constraint={"type": "regex", "pattern": "(unclosed"})
    with pytest.raises(ValidationError, match="grammar does not compile"):
        client.submit("x", constraint={"type": "grammar", "grammar": "start: nowhere"})
    start_pool(ranks=1)
    keys = Keys()
    bad = {
        "v": 1,
        "id": "bad-schema",
        "prompt_token_ids": [5, 6],
        "constraint": {
            "type": "json_schema",
            "json_schema": {"type": "object", "minProperties": "x"},
        },
    }
    redis_client.xadd(keys.requests, {"m": msgpack.packb(bad)})  # type: ignore[attr-defined]
    done = client.result("bad-schema", timeout_s=60)
    assert done.finish_reason == "rejected" and done.error is not None
    assert "constraint" in done.error.message and "does not compile" in done.error.message
    assert client.generate(prompt_token_ids=[5, 6], max_tokens=2).finish_reason == "length"


def test_logit_bias_bans_and_forces_tokens(start_pool: StartPool, client: Client) -> None:
    start_pool(ranks=1)
    prompt = [7, 8, 9]
    free = client.generate(prompt_token_ids=prompt, max_tokens=8, ignore_eos=True)
    banned = client.generate(
        prompt_token_ids=prompt,
        max_tokens=8,
        ignore_eos=True,
        logit_bias={str(t): -100 for t in set(free.token_ids)},
    )
    assert not set(banned.token_ids) & set(free.token_ids)
    forced = client.generate(
        prompt_token_ids=prompt, max_tokens=8, ignore_eos=True, logit_bias={"77": 100}
    )
    assert forced.token_ids == [77] * 8
    with pytest.raises(ValidationError, match="outside"):
        client.submit(prompt_token_ids=prompt, logit_bias={"5": 101})
    outside = client.generate(prompt_token_ids=prompt, logit_bias={"99999": 1})
    assert outside.finish_reason == "rejected" and outside.error is not None
    assert "logit_bias" in outside.error.message


def test_greedy_with_repetition_penalty_is_transformers_generate(
    start_pool: StartPool, client: Client, tmp_path: Path
) -> None:
    from tests.test_hf_parity import build_checkpoint

    model = build_checkpoint("llama3", tmp_path / "llama3")
    start_pool(model=str(tmp_path / "llama3"), ranks=1, max_model_len=512)
    changed = []
    for prompt, penalty in [([5, 6, 7, 5, 6], 1.3), ([40, 41], 1.8), ([9] * 20, 0.7)]:
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=30,
            do_sample=False,
            repetition_penalty=penalty,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
        want = out.sequences[0, len(prompt) :].tolist()
        gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
        got = client.generate(
            prompt_token_ids=prompt, max_tokens=30, ignore_eos=True, repetition_penalty=penalty
        )
        problem = first_divergence(got.token_ids, ReferenceCompletion(want, gaps), 1e-3)
        assert problem is None, (penalty, problem)
        plain = client.generate(prompt_token_ids=prompt, max_tokens=30, ignore_eos=True)
        changed.append(plain.token_ids != got.token_ids)
    assert any(changed)  # the penalty is not a no-op


def test_presence_frequency_and_bias_are_openais_rule(
    start_pool: StartPool, client: Client
) -> None:
    """Greedy tokens under the penalties equal a lone run whose logits are changed by
    OpenAI's rule, written here as a loop: logit[t] -= count[t] * frequency +
    (count[t] > 0) * presence, over the output, then + bias[t]."""
    pool = start_pool(ranks=1)
    loaded = load_reference_model(pool.settings)
    runner = reference_runner(loaded, pool.settings)
    prompt, bias = [7, 8, 9, 7], {77: 8.0, 78: 7.5, 79: 7.0, 12: -2.0}

    for presence, frequency in [(1.5, 0.0), (0.0, 1.2), (-0.5, 0.8)]:

        def openai_rule(
            logits: torch.Tensor,
            output: list[int],
            presence: float = presence,
            frequency: float = frequency,
        ) -> torch.Tensor:
            out = logits.clone()
            for token in set(output):
                out[token] -= output.count(token) * frequency + presence
            for token, value in bias.items():
                out[token] += value
            return out

        want = generate_alone(
            runner, prompt, 24, set(), pool.settings.max_model_len, adjust=openai_rule
        )
        got = client.generate(
            prompt_token_ids=prompt,
            max_tokens=24,
            ignore_eos=True,
            presence_penalty=presence,
            frequency_penalty=frequency,
            logit_bias={str(t): b for t, b in bias.items()},
        )
        problem = first_divergence(got.token_ids, want, 1e-3)
        assert problem is None, (presence, frequency, problem)


def test_submit_flags_constrain_the_text(
    start_pool: StartPool, redis_url: str, tmp_path: Path
) -> None:
    from tests.test_cli_requests import cli

    start_pool(ranks=1)
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    done = cli(redis_url, "submit", "someone", "--json-schema", str(schema), "--max-tokens", "150")
    assert done.returncode == 0, done.stderr
    assert _valid_person(json.loads(done.stdout))
    phone = cli(redis_url, "submit", "call", "--regex", "[0-9]{3}-[0-9]{4}")
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}\n", phone.stdout), phone
    bad = cli(redis_url, "submit", "x", "--regex", "(")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert "regex does not compile" in bad.stderr
    missing = cli(redis_url, "submit", "x", "--json-schema", str(tmp_path / "none.json"))
    assert missing.returncode == 1 and "cannot read" in missing.stderr
