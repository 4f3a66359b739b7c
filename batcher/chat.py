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

    @classmethod
    def from_json(cls, raw: str | bytes) -> ChatTemplate:
        """The form ranks publish: {"template", "bos_token", "eos_token"}."""
        data = json.loads(raw)
        return cls(data["template"], data.get("bos_token") or "", data.get("eos_token") or "")

    def render(self, messages: list[ChatMessage]) -> str:
        """The prompt text for `messages`, ending with the assistant's turn opened."""
        context: dict[str, Any] = {
            "messages": [m.model_dump() for m in messages],
            "add_generation_prompt": True,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        try:
            return self.template.render(**context)
        except ChatTemplateError:
            raise
        except Exception as exc:  # the template is the operator's code; any failure is its
            raise ChatTemplateError(f"the model's chat template failed: {exc}") from exc
