"""A run-time change of the engine replicas: Serve's `user_config`, or the body of the admin
route `POST /admin/policy`. What it may carry, each part checked as a replica applies it: the
ingress checks a change before any replica sees it, and each replica checks again (a
`user_config` reaches the replicas without passing the ingress)."""

from __future__ import annotations

from typing import Any

from policies.registry import parse_policy_config
from replicas.chunks import STREAM_INTERVAL_KEY, stream_interval_s
from replicas.tier_pool import validate_candidates

CHANGES = ("policy", "candidates", STREAM_INTERVAL_KEY)
# `initial_k` goes with `candidates`; `issued_at` orders run-time changes fleet-wide (the
# ingress stamps it, replacing any a client sent).
KEYS = (*CHANGES, "initial_k", "issued_at")


def check_change(user_config: Any, kmax: int) -> None:
    """ValueError naming what is wrong with a change (nothing is applied by checking it)."""
    if not isinstance(user_config, dict) or not set(CHANGES) & set(user_config):
        raise ValueError('send {"policy": {...}}, {"candidates": [...]} and/or '
                         f'{{"{STREAM_INTERVAL_KEY}": ...}}')
    if unknown := sorted(set(user_config) - set(KEYS)):
        raise ValueError(f"unknown keys {unknown}: a change carries {', '.join(CHANGES)} "
                         "(and initial_k with candidates)")
    if "initial_k" in user_config and "candidates" not in user_config:
        raise ValueError("initial_k goes with candidates: the tier a new candidate list "
                         "starts on")
    if STREAM_INTERVAL_KEY in user_config:
        stream_interval_s(user_config[STREAM_INTERVAL_KEY])
    if "policy" in user_config:
        parse_policy_config(user_config["policy"])
    if "candidates" in user_config:
        validate_candidates(user_config["candidates"], kmax, user_config.get("initial_k"))
