"""The policy protocol: Signals in, Decision out."""

from __future__ import annotations

from typing import Protocol

from policies.signals import Decision, Signals


class Policy(Protocol):
    """A speculation policy. Pure: no I/O, no clocks, no engine or Ray imports.

    A policy may keep state between calls (EMA values, learned step costs, dwell counters);
    everything it knows arrives through `decide`.
    """

    name: str

    def decide(self, signals: Signals) -> Decision: ...
