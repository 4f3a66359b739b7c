"""Tool calls on the wire (docs/architecture.md §6): the tools a chat request offers, the
calls an assistant made, and the one text form calls take in a completion.

A model calls a tool by writing `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(the form of Hermes, Qwen2.5 and most open chat models' templates); one call per block,
several blocks for parallel calls. `tool_choice` `required` or a named function becomes a
constraint whose grammar admits only such blocks, with arguments valid against the
function's `parameters`; `auto` lets the model choose, and `parse_tool_calls` finds what it
wrote.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from schemas.constraints import Grammar

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
MAX_TOOLS = 128
_BLOCK = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.DOTALL)


class _Tools(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ToolFunction(_Tools):
    """A function the model may call: its name, what it does, and its arguments' schema."""

    name: Annotated[str, Field(pattern=TOOL_NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    strict: bool | None = None


class Tool(_Tools):
    """One offered tool (OpenAI's `{"type": "function", "function": {...}}`)."""

    type: Literal["function"] = "function"
    function: ToolFunction


class FunctionName(_Tools):
    """A function named by `tool_choice`."""

    name: Annotated[str, Field(pattern=TOOL_NAME_PATTERN)]


class NamedToolChoice(_Tools):
    """`tool_choice` naming the one function to call."""

    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(_Tools):
    """The function a call names and its arguments, a JSON text."""

    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"arguments are not JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise ValueError("arguments must be a JSON object")
        return value


class ToolCall(_Tools):
    """A call an assistant made: its id (a later `tool` message answers it by that id)."""

    id: Annotated[str, Field(min_length=1, max_length=128)]
    type: Literal["function"] = "function"
    function: CalledFunction


def call_text(name: str, arguments: str | dict[str, Any]) -> str:
    """A call in the completion's text form."""
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': args})}\n{CALL_CLOSE}"


def call_constraint(tools: list[Tool], choice: ToolChoice, parallel: bool) -> Grammar:
    """The constraint of `required` (any offered function) or a named function: one call
    block (several with `parallel`), arguments valid against the function's parameters."""
    functions = [t.function for t in tools]
    if isinstance(choice, NamedToolChoice):
        functions = [f for f in functions if f.name == choice.function.name]
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": f.name}, "arguments": f.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema: dict[str, Any] = dict(options[0]) if len(options) == 1 else {"anyOf": options}
    schema["x-guidance"] = {"whitespace_flexible": False}  # no free white space to wander in
    repeat = ' ("\\n" call)*' if parallel else ""
    lark = (
        f"start: call{repeat}\n"
        f'call: "{CALL_OPEN}\\n" body "\\n{CALL_CLOSE}"\n'
        f"body: %json {json.dumps(schema)}\n"
    )
    return Grammar(grammar=lark)


def parse_tool_calls(text: str, id_prefix: str) -> tuple[str | None, list[ToolCall]]:
    """(the text outside call blocks, or None if only calls; the calls whose block holds a
    JSON object with a `name` and `arguments`). Call ids are `{id_prefix}-{i}`."""
    calls: list[ToolCall] = []
    for block in _BLOCK.findall(text):
        try:
            call = json.loads(block)
        except ValueError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        args = call.get("arguments", call.get("parameters", {}))
        function = CalledFunction(name=call["name"], arguments=json.dumps(args))
        calls.append(ToolCall(id=f"{id_prefix}-{len(calls)}", function=function))
    if not calls:
        return text, []
    rest = _BLOCK.sub("", text).strip()
    return rest or None, calls


def tools_preamble(tools: list[Tool]) -> str:
    """The system text that offers `tools` to a model whose chat template has no tools."""
    listed = "\n".join(json.dumps(t.model_dump(exclude_none=True)) for t in tools)
    return (
        "You may call these tools, described as JSON schemas:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call one, reply with a JSON object of its name and arguments in tool_call tags:\n"
        f'{CALL_OPEN}\n{{"name": <function name>, "arguments": <arguments object>}}\n{CALL_CLOSE}'
    )
