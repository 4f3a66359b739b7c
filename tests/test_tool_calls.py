"""Tool calls: the text form split as it streams (any split of the text gives the calls and
content of the whole), rendering through templates with and without tools, and through the
gateway with the `openai` package — `required`, a named function and `auto`, a follow-up
`tool` message, streamed deltas that reassemble to valid arguments."""

from __future__ import annotations

import json

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batcher.chat import ChatTemplate
from producer.gateway.tool_calls import CallSplitter, whole_message
from schemas.messages import ChatMessage, GenerateRequest
from schemas.tools import Tool, ToolFunction, call_text
from tests.conftest import StartGateway, StartPool

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]

TEXTS = [
    "plain text, no calls",
    call_text("add", {"a": 1, "b": 2}),
    "Let me check.\n" + call_text("get_weather", {"city": "Oslo", "unit": "c"}) + "\n",
    call_text("add", {"a": 1, "b": 2}) + "\n" + call_text("add", {"a": 3, "b": 4}),
    "a <tool_call> that is {not json} </tool_call> and < tool_call> text <tool_cal",
    "x < y <tool_call>\n" + json.dumps({"name": "add", "arguments": {"a": 5}}) + "\n</tool_call>",
]


@pytest.mark.fast
@settings(max_examples=200, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(0, 200), max_size=12))
def test_any_split_of_a_streamed_answer_gives_the_calls_of_the_whole(
    text: str, cuts: list[int]
) -> None:
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    splitter = CallSplitter("r")
    content, calls = "", []
    for piece in pieces:
        more, deltas = splitter.feed(piece)
        content += more
        calls += deltas
    content += splitter.finish()
    message, called = whole_message(text, "r")
    assert called == bool(calls)
    if called:
        assert [c["function"] for c in calls] == [c["function"] for c in message["tool_calls"]]
        assert [c["id"] for c in calls] == [c["id"] for c in message["tool_calls"]]
        assert content.strip() == (message["content"] or "")
    else:
        assert content == text


@pytest.mark.fast
def test_templates_with_and_without_tools_render_the_calls_and_answers() -> None:
    messages = [
        ChatMessage(role="user", content="add 1 and 2"),
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c1", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
                ],
            }
        ),
        ChatMessage(role="tool", content="3", tool_call_id="c1"),
    ]
    tools = [Tool(function=ToolFunction.model_validate(ADD["function"]))]
    plain = ChatTemplate(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
    )
    text = plain.render(messages, tools)
    assert text.startswith("<system>You may call these tools")
    assert '"name": "add"' in text and "<tool_response>\n3\n</tool_response>" in text
    assert call_text("add", '{"a": 1, "b": 2}') in text
    aware = ChatTemplate(
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}"
        "{% if m.role == 'tool' %}({{ m.tool_call_id }}={{ m.content }}){% endif %}{% endfor %}"
    )
    assert aware.render(messages, tools) == '[add]add{"a": 1, "b": 2}(c1=3)'
    with pytest.raises(ValueError, match="not in `tools`"):
        GenerateRequest(
            id="x",
            messages=messages[:1],
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "add"}},  # type: ignore[arg-type]
        )
    with pytest.raises(ValueError, match="not JSON"):
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "tool_calls": [{"id": "c", "function": {"name": "add", "arguments": "{"}}],
            }
        )


def api_for(gateway_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway_url + "/v1", api_key="unused", max_retries=0)


def _weather_ok(arguments: str) -> bool:
    args = json.loads(arguments)
    return set(args) == {"city", "unit"} and args["unit"] in "cf" and len(args["city"]) <= 10


def test_tool_choice_required_named_and_auto_through_the_gateway(
    start_pool: StartPool, start_gateway: StartGateway
) -> None:
    model = start_pool(ranks=1).settings.model
    api = api_for(start_gateway().url)
    tools = [WEATHER, ADD]
    required = api.chat.completions.create(
        model=model, messages=ASK, tools=tools, tool_choice="required", max_tokens=120,
        parallel_tool_calls=False,
    )  # fmt: skip
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "add")
    if calls[0].function.name == "get_weather":
        assert _weather_ok(calls[0].function.arguments)
    named = api.chat.completions.create(
        model=model,
        messages=ASK,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=120,
    )
    call = (named.choices[0].message.tool_calls or [])[0]
    assert call.function.name == "get_weather" and _weather_ok(call.function.arguments)
    # the follow-up: the assistant's call and the tool's answer, then a plain reply
    follow = api.chat.completions.create(
        model=model,
        messages=[
            *ASK,
            {"role": "assistant", "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21"},
        ],
        tools=tools,
        tool_choice="none",
        max_tokens=8,
    )
    assert follow.choices[0].message.tool_calls is None
    assert follow.choices[0].finish_reason in ("stop", "length")
    # auto: the answer is parsed for calls (here a grammar makes the model write one)
    forced = call_text("add", {"a": 2, "b": 3}).replace("\n", "\\n").replace('"', '\\"')
    auto = api.chat.completions.create(
        model=model,
        messages=ASK,
        tools=tools,
        tool_choice="auto",
        max_tokens=150,
        extra_body={"structured_outputs": {"grammar": f'start: "Sure." "{forced}"'}},
    )
    message = auto.choices[0].message
    assert auto.choices[0].finish_reason == "tool_calls"
    assert message.content == "Sure."
    assert [
        (c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []
    ] == [("add", {"a": 2, "b": 3})]


def test_streamed_tool_call_deltas_reassemble_to_valid_arguments(
    start_pool: StartPool, start_gateway: StartGateway
) -> None:
    model = start_pool(ranks=1).settings.model
    api = api_for(start_gateway().url)
    for seed in range(3):
        stream = api.chat.completions.create(
            model=model,
            messages=ASK,
            tools=[WEATHER, ADD],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=200,
            temperature=0.8,
            seed=seed,
            stream=True,
        )
        names: dict[int, str] = {}
        arguments: dict[int, str] = {}
        finish = None
        for chunk in stream:
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                for delta in choice.delta.tool_calls or []:
                    if delta.function and delta.function.name:
                        names[delta.index] = delta.function.name
                    if delta.function and delta.function.arguments:
                        arguments[delta.index] = (
                            arguments.get(delta.index, "") + delta.function.arguments
                        )
        assert finish == "tool_calls" and names
        for index, name in names.items():
            args = json.loads(arguments[index])
            if name == "get_weather":
                assert _weather_ok(arguments[index])
            else:
                assert set(args) == {"a", "b"} and all(0 <= v <= 99 for v in args.values())
