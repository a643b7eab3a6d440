"""The HTTP layer's request fields: what it accepts, what it refuses and why, that each
sampling control it hands on means the same in the engine's request, and chat content in
OpenAI's two forms, and vLLM's chat template variables."""

from __future__ import annotations

import dataclasses
import inspect
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from app.ingress import TEMPLATE_CALL_OPTIONS, ChatRequest, CompletionRequest
from replicas.engines.base import SAMPLING_CONTROLS, EngineInputError, GenerationRequest
from replicas.engines.spec import DEMO_TARGET
from replicas.replica import EngineReplica, max_chat_characters


def completion(**fields: object) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})


def test_every_control_handed_on_has_the_same_default_on_both_sides():
    engine_defaults = {f.name: f.default for f in dataclasses.fields(GenerationRequest)}
    request = completion()
    for name in SAMPLING_CONTROLS:
        assert getattr(request, name) == engine_defaults[name], name


def test_stop_strings_are_bounded_in_number_not_in_length():
    """A megabyte of one-character stop strings would have vLLM check a quarter of a
    million of them after every step, on the loop all of a replica's streams share."""
    assert completion(stop=["x"] * 64).stops() == ["x"] * 64
    assert completion(stop="x" * 1000).stops() == ["x" * 1000]
    with pytest.raises(ValidationError, match="at most 64 items"):
        completion(stop=["x"] * 65)


def test_null_means_the_default_as_in_openais_api():
    request = completion(temperature=None, top_p=None, n=None, presence_penalty=None,
                         frequency_penalty=None, repetition_penalty=None, top_k=None,
                         min_tokens=None, ignore_eos=None, stream=None, logprobs=None,
                         echo=None)
    assert request == completion()
    chat = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user",
                                                                  "content": "hi"}],
                                       "temperature": None, "stream": None,
                                       "logprobs": None})
    assert (chat.temperature, chat.stream, chat.logprobs) == (1.0, False, False)


@pytest.mark.parametrize(("fields", "reason"), [
    ({"min_p": 0.1}, "speculative decoding"),
    ({"max_tokens": 4, "min_tokens": 5}, "exceeds max_tokens"),
    ({"top_k": -2}, "greater than or equal"),
    ({"top_k": 2**63}, "less than or equal"),
    ({"presence_penalty": 2.5}, "less than or equal"),
    ({"repetition_penalty": 0}, "greater than"),
    ({"model": 5}, "valid string"),
])
def test_a_control_outside_what_the_engines_do_is_refused_with_its_reason(fields, reason):
    with pytest.raises(ValidationError, match=reason):
        completion(**fields)


@pytest.mark.parametrize(("fields", "message"), [
    ({"max_tokens": "5"}, "valid integer"),
    ({"max_tokens": True}, "valid integer"),
    ({"max_tokens": 2.0}, "valid integer"),
    ({"stream": "yes"}, "valid boolean"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "valid boolean"),
    ({"temperature": float("nan")}, "finite number"),
    ({"top_p": float("inf")}, "finite number"),
])
def test_a_value_of_the_wrong_type_is_refused_not_coerced(fields, message):
    """As OpenAI's API: pydantic's lax mode would serve "5" as 5 tokens and true as 1."""
    with pytest.raises(ValidationError, match=message):
        completion(**fields)
    with pytest.raises(ValidationError, match="valid string"):
        chat(5)
    assert completion(temperature=1, max_tokens=5).temperature == 1.0  # an int is a float


def test_options_of_a_feature_not_asked_for_are_refused_not_ignored():
    """As vLLM: stream_options without a stream, top_logprobs without logprobs."""
    with pytest.raises(ValidationError, match="stream_options can only be set when stream"):
        completion(stream_options={"include_usage": True})
    with pytest.raises(ValidationError, match="stream_options can only be set when stream"):
        chat("hi", stream=False, stream_options={"include_usage": True})
    with pytest.raises(ValidationError, match="top_logprobs can only be set when logprobs"):
        chat("hi", top_logprobs=2)
    with pytest.raises(ValidationError, match="top_logprobs can only be set when logprobs"):
        chat("hi", logprobs=False, top_logprobs=0)
    assert completion(stream=True, stream_options={"include_usage": True}).stream_options
    assert chat("hi", logprobs=True, top_logprobs=2).top_logprobs == 2
    assert chat("hi", stream_options=None, top_logprobs=None).top_logprobs is None


def test_the_controls_within_range_are_kept():
    request = completion(top_k=-1, min_p=0, presence_penalty=-2, frequency_penalty=2,
                         repetition_penalty=1.3, min_tokens=16)
    assert (request.top_k, request.presence_penalty, request.repetition_penalty,
            request.min_tokens) == (-1, -2, 1.3, 16)


def chat(content: object, **fields: object) -> ChatRequest:
    return ChatRequest.model_validate({"model": "m", "messages": [{"role": "user",
                                                                  "content": content}],
                                       **fields})


@pytest.mark.parametrize(("fields", "reason"), [
    ({"logit_bias": {"50256": -100}}, "logit_bias is not supported: vLLM does not apply it"),
    ({"response_format": {"type": "json_object"}}, "structured output"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool calling"),
    ({"functions": [{"name": "f"}]}, "function calling"),
    ({"echo": True}, "echo is not supported"),
    ({"suffix": "}"}, "suffix is not supported"),
    ({"best_of": 2}, "only best_of=1"),
    # vLLM's own fields, which its clients send.
    ({"stop_token_ids": [2]}, "stop_token_ids is not supported: only stop strings"),
    ({"include_stop_str_in_output": True}, "include_stop_str_in_output is not supported"),
    ({"skip_special_tokens": False}, "special tokens are always skipped"),
    ({"spaces_between_special_tokens": False}, "special tokens are always skipped"),
    ({"bad_words": ["import"]}, "bad_words is not supported"),
    ({"allowed_token_ids": [1, 2]}, "allowed_token_ids is not supported"),
    ({"prompt_logprobs": 1}, "prompt logprobs are not returned"),
    ({"prompt_logprobs": 0}, "prompt logprobs are not returned"),  # vLLM: the chosen token's
    ({"guided_json": {}}, "structured output"),  # vLLM: any JSON
    ({"truncate_prompt_tokens": 8}, "prompts are never truncated"),
    ({"structured_outputs": {"json": {"type": "object"}}}, "structured output"),
    ({"guided_json": {"type": "object"}}, "structured output"),
    ({"guided_regex": "[a-z]+"}, "structured output"),
    ({"guided_choice": ["yes", "no"]}, "structured output"),
    ({"guided_grammar": "root ::= 'a'"}, "structured output"),
])
def test_a_field_that_would_change_the_output_but_is_not_applied_is_refused(fields, reason):
    with pytest.raises(ValidationError, match=reason) as refused:
        completion(**fields)
    assert refused.value.errors()[0]["loc"] == (next(iter(fields)),), "param names the field"


def test_those_fields_at_values_that_ask_for_nothing_are_accepted():
    completion(logit_bias={}, echo=False, suffix="", best_of=1, tools=[], functions=None,
               stop_token_ids=[], include_stop_str_in_output=False, skip_special_tokens=True,
               spaces_between_special_tokens=True, bad_words=None, prompt_logprobs=None)
    assert chat("hi", response_format={"type": "text"}, logit_bias=None,
                structured_outputs=None, guided_choice=[]).messages


def test_chat_content_parts_are_joined_as_text():
    parts = [{"type": "text", "text": "def add(a, b):"}, {"type": "text", "text": "    return"}]
    assert chat(parts).messages[0].content == "def add(a, b):\n    return"
    assert chat(parts).messages[0].model_dump() == chat("def add(a, b):\n    return"
                                                       ).messages[0].model_dump()


@pytest.mark.parametrize(("content", "reason"), [
    ([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}], "part 0 is 'image_url'"),
    ([{"type": "text", "text": "a"}, {"type": "input_audio"}], "part 1 is 'input_audio'"),
    ([{"type": "text"}], "needs a string 'text'"),
    (["plain string in a list"], "part 0 is 'str'"),
])
def test_chat_content_other_than_text_is_refused_naming_the_part(content, reason):
    with pytest.raises(ValidationError, match=reason):
        chat(content)


@pytest.mark.parametrize(("prompt", "reason"), [
    ([1, 2, 3], "prompts of token ids are not supported here; send text"),
    ([[1, 2, 3]], "prompts of token ids"),
    (["a", "b"], "exactly one prompt per request"),
    ([], "exactly one prompt per request"),
    ("", "prompt must not be empty"),
    ([""], "prompt must not be empty"),
    (5, "valid string"),
])
def test_a_prompt_other_than_one_text_is_refused_naming_the_prompt(prompt, reason):
    with pytest.raises(ValidationError, match=reason) as refused:
        completion(prompt=prompt)
    assert refused.value.errors()[0]["loc"] == ("prompt",)


def test_a_list_of_one_prompt_is_that_prompt():
    assert completion(prompt=["def f("]).prompt == "def f("


def test_chat_template_kwargs_are_template_variables_only():
    """vLLM's `chat_template_kwargs` are handed to the template; a name of the tokenizer
    call's own options would change what the call returns, so it is refused."""
    assert chat("hi", chat_template_kwargs={"enable_thinking": False}).chat_template_kwargs \
        == {"enable_thinking": False}
    with pytest.raises(ValidationError, match="may not set return_dict, tokenize"):
        chat("hi", chat_template_kwargs={"tokenize": False, "return_dict": False, "x": 1})
    from transformers import PreTrainedTokenizerBase

    options = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters)
    # Besides its own parameters: the messages' other name, and the one it hands its
    # renderer (`render_jinja_template(conversations=...)`).
    assert (options - {"self", "kwargs"}) | {"messages", "conversations"} \
        == TEMPLATE_CALL_OPTIONS


async def test_the_replica_renders_the_requests_template_variables_off_its_event_loop():
    """Chat is rendered with the request's template variables, in the replica's template
    thread: a long conversation's template and encoding would stall the replica's other
    streams on its event loop."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET)
    tokenizer.chat_template = ("{% if persona %}{{ persona }}: {% endif %}"
                               "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    threads = []
    render = tokenizer.apply_chat_template

    def recording(*args, **kwargs):
        threads.append(threading.current_thread())
        return render(*args, **kwargs)

    tokenizer.apply_chat_template = recording
    replica = _chat_renderer(tokenizer)
    messages = [{"role": "user", "content": "def f("}]
    try:
        plain = await EngineReplica._render_chat(replica, messages)
        styled = await EngineReplica._render_chat(replica, messages, {"persona": "pirate"})
    finally:
        replica._template_thread.shutdown()
    assert tokenizer.decode(plain) == "def f("
    assert tokenizer.decode(styled) == "pirate: def f("
    assert len(threads) == 2
    assert all(thread is not threading.main_thread() for thread in threads)


def _chat_renderer(tokenizer: Any, context: int = 1024) -> SimpleNamespace:
    """What `EngineReplica._render_chat` reads of a replica, as its start-up sets it."""
    return SimpleNamespace(
        _tokenizer=tokenizer, _template_thread=ThreadPoolExecutor(1),
        engine=SimpleNamespace(max_model_len=context),
        _max_chat_chars=max_chat_characters(tokenizer, context))


async def test_a_conversation_too_long_for_the_context_is_refused_before_rendering():
    """Messages with more text than the context's tokens could hold are refused as bad
    input without rendering (a megabyte holds the template thread for most of a second);
    one that fits is rendered, even past the context in tokens (said later, by count)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET)
    replica = _chat_renderer(tokenizer, context=16)
    longest = replica._max_chat_chars
    assert longest == 16 * 45  # the demo vocabulary's longest entry has 45 characters
    try:
        fits = await EngineReplica._render_chat(
            replica, [{"role": "system", "content": "a " * (longest // 4)},
                      {"role": "user", "content": "b" * (longest // 2)}])
        with pytest.raises(EngineInputError, match=f"more than {longest}"):
            await EngineReplica._render_chat(
                replica, [{"role": "system", "content": "a" * (longest // 2)},
                          {"role": "user", "content": "b" * (longest // 2 + 1)}])
        # Empty messages hold no characters, and each still takes a token.
        with pytest.raises(EngineInputError, match="has 17 messages"):
            await EngineReplica._render_chat(replica, [{"role": "user", "content": ""}] * 17)
    finally:
        replica._template_thread.shutdown()
    assert len(fits) > 16
