"""Rendering chat messages into a prompt with the model's own chat template (jinja2, sandboxed).

Ranks publish the template they found beside the model (`tokenizer_config.json` or
`chat_template.jinja`) with its special tokens; the batcher renders each request's
`messages` the way `transformers`' `apply_chat_template` does, then tokenizes the text
without adding special tokens (the template writes them).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from schemas.messages import ChatMessage
from schemas.tools import Tool, call_text, tools_preamble


class ChatTemplateError(ValueError):
    """Messages the template refuses, or a model with no template."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class ChatTemplate:
    """A compiled template and the special tokens it may refer to."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = _strftime_now
        try:
            self.template = environment.from_string(source)
        except TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template does not parse: {exc}") from exc
        self.bos_token, self.eos_token = bos_token, eos_token
        self.takes_tools = "tools" in source  # the template reads `tools` itself

    @classmethod
    def from_json(cls, raw: str | bytes) -> ChatTemplate:
        """The form ranks publish: {"template", "bos_token", "eos_token"}."""
        data = json.loads(raw)
        return cls(data["template"], data.get("bos_token") or "", data.get("eos_token") or "")

    def render(self, messages: list[ChatMessage], tools: list[Tool] | None = None) -> str:
        """The prompt text for `messages`, ending with the assistant's turn opened. With
        `tools`, a template that takes them gets them as `apply_chat_template` passes them;
        for one that does not, they are offered in the system message, the assistant's calls
        are written as call blocks and `tool` answers as `<tool_response>` user turns."""
        if tools and not self.takes_tools:
            dumped = _without_tools(messages, tools)
        else:
            dumped = [_with_arguments_parsed(m.model_dump(exclude_none=True)) for m in messages]
        context: dict[str, Any] = {
            "messages": dumped,
            "add_generation_prompt": True,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        if tools and self.takes_tools:
            context["tools"] = [t.model_dump(exclude_none=True) for t in tools]
        try:
            return self.template.render(**context)
        except ChatTemplateError:
            raise
        except Exception as exc:  # the template is the operator's code; any failure is its
            raise ChatTemplateError(f"the model's chat template failed: {exc}") from exc


def _without_tools(messages: list[ChatMessage], tools: list[Tool]) -> list[dict[str, Any]]:
    """`messages` for a template with no tools: the tools offered in the system message,
    calls as call blocks in the assistant's text, answers as `<tool_response>` user turns."""
    out: list[dict[str, Any]] = []
    preamble = tools_preamble(tools)
    if messages and messages[0].role == "system":
        out.append({"role": "system", "content": f"{messages[0].content}\n\n{preamble}"})
        messages = messages[1:]
    else:
        out.append({"role": "system", "content": preamble})
    for message in messages:
        if message.role == "tool":
            text = f"<tool_response>\n{message.content}\n</tool_response>"
            out.append({"role": "user", "content": text})
        elif message.tool_calls:
            calls = [call_text(c.function.name, c.function.arguments) for c in message.tool_calls]
            text = "\n".join([message.content, *calls]) if message.content else "\n".join(calls)
            out.append({"role": "assistant", "content": text})
        else:
            out.append({"role": message.role, "content": message.content})
    return out


def _with_arguments_parsed(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates read it: each call's `arguments` as an object (they write
    it with `tojson`), its `function` also as `name` and `arguments` of the call itself."""
    calls = message.get("tool_calls")
    if calls:
        message["tool_calls"] = [
            {
                **call,
                "function": {
                    **call["function"],
                    "arguments": json.loads(call["function"]["arguments"]),
                },
                "name": call["function"]["name"],
                "arguments": json.loads(call["function"]["arguments"]),
            }
            for call in calls
        ]
    return message
