"""Structured output and the sampling rules through the gateway, driven by the `openai`
package: `response_format` on both endpoints, `beta.chat.completions.parse` with a pydantic
model, vLLM's `structured_outputs`, `logit_bias` and the penalties."""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from producer.client import Client
from tests.conftest import StartGateway, StartPool

ASK = [{"role": "user", "content": "Describe a pet as JSON."}]


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog", "fish"]
    legs: int = Field(ge=0, le=8)


def api_for(gateway_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway_url + "/v1", api_key="unused", max_retries=0)


def test_response_format_and_parse_give_validated_objects(
    start_pool: StartPool, start_gateway: StartGateway
) -> None:
    model = start_pool(ranks=1).settings.model
    api = api_for(start_gateway().url)
    for seed in range(3):
        parsed = api.beta.chat.completions.parse(
            model=model, messages=ASK, response_format=Pet, max_tokens=80, seed=seed
        )
        message = parsed.choices[0].message
        assert isinstance(message.parsed, Pet), message
        assert Pet.model_validate_json(message.content or "") == message.parsed
    whole = api.completions.create(
        model=model,
        prompt="{",
        max_tokens=60,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert isinstance(json.loads(whole.choices[0].text), dict)
    streamed = api.chat.completions.create(
        model=model,
        messages=ASK,
        max_tokens=80,
        stream=True,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "pet", "schema": Pet.model_json_schema(), "strict": True},
        },
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    Pet.model_validate_json(text)


def test_structured_outputs_regex_choice_and_grammar(
    start_pool: StartPool, start_gateway: StartGateway
) -> None:
    model = start_pool(ranks=1).settings.model
    api = api_for(start_gateway().url)

    def ask(structured: dict[str, object]) -> str:
        reply = api.chat.completions.create(
            model=model,
            messages=ASK,
            max_tokens=40,
            extra_body={"structured_outputs": structured},
        )
        assert reply.choices[0].finish_reason == "stop"
        return reply.choices[0].message.content or ""

    assert re.fullmatch(r"[a-z]{2,5}@[a-z]{3}\.org", ask({"regex": r"[a-z]{2,5}@[a-z]{3}\.org"}))
    assert ask({"choice": ["yes", "no", "maybe"]}) in ("yes", "no", "maybe")
    grammar = 'start: "[" item ("," item)* "]"\nitem: /[xyz]/'
    assert re.fullmatch(r"\[[xyz](,[xyz])*\]", ask({"grammar": grammar}))
    for bad, param in [
        ({"regex": "("}, "structured_outputs"),
        ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ]:
        with pytest.raises(openai.BadRequestError) as caught:
            ask(bad)
        assert caught.value.param == param, caught.value.body


def test_logit_bias_and_penalties_reach_the_pool(
    start_pool: StartPool, start_gateway: StartGateway, client: Client
) -> None:
    model = start_pool(ranks=1).settings.model
    api = api_for(start_gateway().url)
    forced = api.completions.create(
        model=model, prompt="hi", max_tokens=5, temperature=0, logit_bias={"77": 100}
    )
    direct = client.generate("hi", max_tokens=5, logit_bias={"77": 100})
    assert forced.choices[0].text == direct.text and direct.token_ids == [77] * 5
    options = {"presence_penalty": 1.0, "frequency_penalty": 0.5}
    through = api.completions.create(
        model=model,
        prompt="hi",
        max_tokens=12,
        temperature=0,
        extra_body={"repetition_penalty": 1.4, "ignore_eos": True},
        **options,  # type: ignore[arg-type]
    )
    want = client.generate("hi", max_tokens=12, ignore_eos=True, repetition_penalty=1.4, **options)
    assert through.choices[0].text == want.text


def test_n_choices_are_each_a_seeded_stream_whole_and_streamed(
    start_pool: StartPool, start_gateway: StartGateway, client: Client
) -> None:
    model = start_pool(ranks=1).settings.model
    api = api_for(start_gateway().url)
    asked = {"model": model, "prompt": "Once", "max_tokens": 10, "n": 3, "seed": 11}
    first = api.completions.create(temperature=1.0, **asked)  # type: ignore[call-overload]
    again = api.completions.create(temperature=1.0, **asked)  # type: ignore[call-overload]
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == [0, 1, 2]
    # choice i is the pool request with seed + i, as a lone request gives it
    for i, text in enumerate(texts):
        alone = client.generate("Once", max_tokens=10, temperature=1.0, seed=11 + i)
        assert text == alone.text
    assert len(set(texts)) > 1
    assert first.usage is not None and first.usage.completion_tokens == 30
    streamed = api.chat.completions.create(
        model=model,
        messages=ASK,
        max_tokens=10,
        n=3,
        seed=11,
        temperature=1.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts: dict[int, str] = {0: "", 1: "", 2: ""}
    finishes: dict[int, str | None] = {}
    usage = None
    for chunk in streamed:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            parts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert set(finishes) == {0, 1, 2} and usage is not None
    whole = api.chat.completions.create(
        model=model, messages=ASK, max_tokens=10, n=3, seed=11, temperature=1.0
    )
    assert [c.message.content for c in whole.choices] == [parts[0], parts[1], parts[2]]
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model=model, prompt="x", n=17)
    assert caught.value.param == "n"
