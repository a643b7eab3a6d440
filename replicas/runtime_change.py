"""A run-time change of the engine replicas: Serve's `user_config`, or the body of the admin
route `POST /admin/policy`. What it may carry, each part parsed as a replica applies it: the
ingress parses a change before any replica sees it (to refuse a bad one with a 400), and each
replica parses it again to apply it (a `user_config` reaches the replicas without passing the
ingress)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policies.registry import parse_policy_config
from replicas.chunks import STREAM_INTERVAL_KEY, stream_interval_s
from replicas.tier_pool import validate_candidates

CHANGES = ("policy", "candidates", STREAM_INTERVAL_KEY)
# `initial_k` goes with `candidates`; `issued_at` orders run-time changes fleet-wide (the
# ingress stamps it, replacing any a client sent).
KEYS = (*CHANGES, "initial_k", "issued_at")


@dataclass(frozen=True)
class RuntimeChange:
    """The parts of a change, checked; None where the change leaves a part as it is."""

    policy: Any = None
    """A validated policy config model (`policies.registry.parse_policy_config`)."""
    candidates: tuple[int, ...] | None = None
    initial_k: int | None = None
    stream_interval_s: float | None = None


def parse_change(user_config: Any, kmax: int) -> RuntimeChange:
    """The change's parts; ValueError naming what is wrong with it (nothing is applied)."""
    if not isinstance(user_config, dict) or not set(CHANGES) & set(user_config):
        raise ValueError('send {"policy": {...}}, {"candidates": [...]} and/or '
                         f'{{"{STREAM_INTERVAL_KEY}": ...}}')
    if unknown := sorted(set(user_config) - set(KEYS)):
        raise ValueError(f"unknown keys {unknown}: a change carries {', '.join(CHANGES)} "
                         "(and initial_k with candidates)")
    if "initial_k" in user_config and "candidates" not in user_config:
        raise ValueError("initial_k goes with candidates: the tier a new candidate list "
                         "starts on")
    interval = user_config.get(STREAM_INTERVAL_KEY)
    initial_k = user_config.get("initial_k")
    return RuntimeChange(
        policy=parse_policy_config(user_config["policy"]) if "policy" in user_config
        else None,
        candidates=validate_candidates(user_config["candidates"], kmax, initial_k)
        if "candidates" in user_config else None,
        initial_k=initial_k,
        stream_interval_s=stream_interval_s(interval) if STREAM_INTERVAL_KEY in user_config
        else None)
