"""The policy protocol: Signals in, Decision out."""

from __future__ import annotations

from typing import Protocol

from policies.signals import Decision, Signals


class Policy(Protocol):
    """A speculation policy. Pure: no I/O, no clocks, no engine or Ray imports.

    A policy may keep state between calls (EMA values, learned step costs, dwell counters);
    everything it knows arrives through `decide`.
    """

    reads_requests: bool
    """Whether `decide` reads `Signals.requests`; engines build those per-request windows
    only for policies that do (a batch's windows at every decision are not free)."""
    needs_requests: bool
    """Whether `decide` cannot move K without `Signals.requests` (it reads them); the control
    loop refuses such a policy on an engine that reports no per-request outcomes (SGLang's),
    where it would keep its first K for good."""
    decides_on_arrival: bool
    """Whether the control loop asks for a decision as soon as a request of a class the
    replica did not hold arrives, before a window of steps has gathered (a policy that prices
    requests by their class: `Signals.request_priors`). Such a decision's window may hold no
    step at all."""

    def decide(self, signals: Signals) -> Decision: ...
