"""Chat requests: `messages` rendered with the model's own template, as `transformers` does."""

from __future__ import annotations

import msgpack
import pytest
from transformers import PreTrainedTokenizerFast

from batcher.chat import ChatTemplate, ChatTemplateError
from npu_worker.weights.loader import read_chat_template
from npu_worker.weights.presets import resolve_model_dir
from producer.client import Client
from schemas.messages import ChatMessage, FinishReason
from tests.helpers import check_stream

CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Redis streams are"},
    {"role": "assistant", "content": "append-only logs."},
    {"role": "user", "content": "And the pool?"},
]


def test_chat_request_gets_the_tokens_of_its_messages_rendered_by_transformers(
    start_pool, client: Client
) -> None:
    start_pool(max_model_len=256)
    path = resolve_model_dir("tiny")
    hf = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    hf.chat_template = read_chat_template(path)["template"]  # type: ignore[index]
    hf.bos_token, hf.eos_token = "<|bos|>", "<|eos|>"
    prompt_ids = hf.apply_chat_template(
        CONVERSATION, add_generation_prompt=True, tokenize=True, return_dict=False
    )

    chat_id = client.submit(messages=CONVERSATION, max_tokens=12, ignore_eos=True)
    by_ids = client.submit(prompt_token_ids=list(prompt_ids), max_tokens=12, ignore_eos=True)
    chat = check_stream(list(client.stream(chat_id, timeout_s=60)))
    plain = check_stream(list(client.stream(by_ids, timeout_s=60)))
    assert chat == plain and len(chat) == 12

    done = client.chat(CONVERSATION, max_tokens=12, ignore_eos=True, timeout_s=60)
    assert done.token_ids == chat
    assert done.usage is not None and done.usage.prompt_tokens == len(prompt_ids)


def test_bad_messages_are_rejected_naming_the_field(start_pool, client: Client) -> None:
    start_pool()
    # a raw XADD: the client itself refuses an empty list before sending anything
    client.redis.xadd(
        client.keys.requests,
        {"m": msgpack.packb({"v": 1, "id": "no-turns", "messages": []})},
    )
    chunks = list(client.stream("no-turns", timeout_s=30))
    assert chunks[-1].finish_reason == FinishReason.REJECTED
    assert chunks[-1].error is not None and "`messages` is empty" in chunks[-1].error.message
    with pytest.raises(ValueError, match="messages"):
        client.submit(messages=[{"role": "user"}])


@pytest.mark.fast
def test_template_errors_become_chat_template_errors() -> None:
    strict = ChatTemplate(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first turn must be the user') }}"
        "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    assert strict.render([ChatMessage(role="user", content="hi")]) == "hi"
    with pytest.raises(ChatTemplateError, match="first turn must be the user"):
        strict.render([ChatMessage(role="assistant", content="hi")])
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for %}")
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        sandboxed.render([ChatMessage(role="user", content="hi")])
