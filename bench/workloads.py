"""Prompt sets with known acceptance behaviour on the demo models (trained on Python source).

High-acceptance prompts end in a run of repeated lines: the model keeps repeating them and
prompt-lookup (ngram) drafting finds every continuation in the context. Low-acceptance prompts
open free-form code and are sampled at temperature 0.8, so drafts rarely match.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    text: str
    temperature: float


def _repeated(line: str, times: int = 24) -> str:
    return line * times


# Chosen by probing the demo target (greedy, K=7): each keeps the model repeating.
HIGH_TEXTS = (
    _repeated("import os\n"),
    _repeated("    pass\n"),
    _repeated("    return None\n"),
    _repeated("    None,\n"),
    _repeated("    True,\n"),
    _repeated("'a', "),
    _repeated("from os import path\n"),
    _repeated("# --------------------\n"),
)

LOW_TEXTS = (
    "def parse_header(line):\n    \"\"\"",
    "class Connection:\n    def __init__(self, host, port",
    "import re\n\n\ndef tokenize(text",
    "    def __repr__(self):\n        return",
    "def _check_arguments(args, kwargs):\n",
    "class Node:\n    \"\"\"A node in",
    "    if not isinstance(value, str):\n        raise",
    "def main(argv=None):\n    parser =",
)

HIGH = tuple(Prompt(text, temperature=0.0) for text in HIGH_TEXTS)
LOW = tuple(Prompt(text, temperature=0.8) for text in LOW_TEXTS)


def interleaved(first: Sequence[Prompt], second: Sequence[Prompt]) -> tuple[Prompt, ...]:
    """One of `first`, one of `second`, in turn: a mix of both kinds of text."""
    return tuple(p for pair in zip(first, second, strict=True) for p in pair)


# The HTTP benchmarks' mix: repetitive and free text, one of each in turn.
MIX = interleaved(HIGH, LOW)
# The concurrency sweep: a phase per concurrency, of at least `requests` requests and twice
# its concurrency (so every phase reaches it), the last named apart from the first.
SWEEP_CONCURRENCY = (1, 16, 64, 1)


def sweep_shape(requests: int) -> list[tuple[str, int, int]]:
    """(name, concurrency, requests) of each sweep phase."""
    last = len(SWEEP_CONCURRENCY) - 1
    return [(f"c{c}" + ("_end" if i == last else ""), c, max(requests, 2 * c))
            for i, c in enumerate(SWEEP_CONCURRENCY)]


# Greedy prompts for identity tests: one copy task, and free openings decoded greedily.
COPY_PROMPT = HIGH_TEXTS[0]
FREE_PROMPTS = LOW_TEXTS
