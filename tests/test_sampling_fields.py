"""The HTTP layer's sampling fields: what it accepts, what it refuses and why, and that each
control it hands on means the same in the engine's request."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from app.ingress import ChatRequest, CompletionRequest
from replicas.engines.base import SAMPLING_CONTROLS, GenerationRequest


def completion(**fields: object) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})


def test_every_control_handed_on_has_the_same_default_on_both_sides():
    engine_defaults = {f.name: f.default for f in dataclasses.fields(GenerationRequest)}
    request = completion()
    for name in SAMPLING_CONTROLS:
        assert getattr(request, name) == engine_defaults[name], name


def test_null_means_the_default_as_in_openais_api():
    request = completion(temperature=None, top_p=None, n=None, presence_penalty=None,
                         frequency_penalty=None, repetition_penalty=None, top_k=None,
                         min_tokens=None, ignore_eos=None)
    assert request == completion()
    chat = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user",
                                                                  "content": "hi"}],
                                       "temperature": None})
    assert chat.temperature == 1.0


@pytest.mark.parametrize(("fields", "reason"), [
    ({"min_p": 0.1}, "speculative decoding"),
    ({"max_tokens": 4, "min_tokens": 5}, "exceeds max_tokens"),
    ({"top_k": -2}, "greater than or equal"),
    ({"top_k": 2**63}, "less than or equal"),
    ({"presence_penalty": 2.5}, "less than or equal"),
    ({"repetition_penalty": 0}, "greater than"),
    ({"model": None}, "model"),
])
def test_a_control_outside_what_the_engines_do_is_refused_with_its_reason(fields, reason):
    with pytest.raises(ValidationError, match=reason):
        completion(**fields)


def test_the_controls_within_range_are_kept():
    request = completion(top_k=-1, min_p=0, presence_penalty=-2, frequency_penalty=2,
                         repetition_penalty=1.3, min_tokens=16)
    assert (request.top_k, request.presence_penalty, request.repetition_penalty,
            request.min_tokens) == (-1, -2, 1.3, 16)
