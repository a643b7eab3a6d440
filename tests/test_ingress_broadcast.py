"""The ingress's calls to every replica (`/metrics`, `/admin/*`): a failing replica is left out
of a scrape, not a 500; replicas too slow to answer are a 503, not a request that hangs; a
run-time change that is not valid is a 400 before any replica is called."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from app.ingress import APIError
from tests.conftest import bare_ingress, http_request


class Replicas:
    """Stands in for the engine deployment's handle: `broadcast(...).results_async(...)`."""

    def __init__(self, answers: list, delay_s: float = 0.0):
        self.answers, self.delay_s = answers, delay_s

    def broadcast(self, method: str, *args):
        async def results_async(timeout_s: float | None = None, return_exceptions=False):
            if timeout_s is not None and self.delay_s > timeout_s:
                await asyncio.sleep(timeout_s)
                raise TimeoutError("Timed out waiting for broadcast results.")
            if not return_exceptions and any(isinstance(a, BaseException) for a in self.answers):
                raise next(a for a in self.answers if isinstance(a, BaseException))
            return list(self.answers)
        return SimpleNamespace(results_async=results_async)


def test_a_failing_replica_is_left_out_of_what_the_others_answer():
    front = bare_ingress(Replicas([{"replica_id": "a"}, RuntimeError("dying"),
                                   {"replica_id": "c"}]))
    assert asyncio.run(front._from_every_replica("stats")) == [{"replica_id": "a"},
                                                               {"replica_id": "c"}]


def test_replicas_too_slow_to_answer_are_a_503():
    front = bare_ingress(Replicas([{"replica_id": "a"}], delay_s=1.0), broadcast_timeout_s=0.05)
    with pytest.raises(APIError) as raised:
        asyncio.run(front._from_every_replica("metrics_snapshot"))
    assert raised.value.status == 503


@pytest.mark.parametrize("policy", ["goodput", None, [], {"name": "nope"}])
def test_a_policy_that_is_not_a_policy_config_is_a_400_before_any_replica_changes(policy):
    """Not even the candidates sent with it reach a replica (the broadcast would fail)."""
    front = bare_ingress(Replicas([AssertionError("no replica may be called")]))
    with pytest.raises(APIError) as raised:
        asyncio.run(front.set_policy(http_request({"policy": policy,
                                                   "candidates": [0, 1, 3]})))
    assert raised.value.status == 400 and "policy" in raised.value.message


@pytest.mark.parametrize("interval", ["fast", -5, None])
def test_a_stream_interval_that_is_not_a_duration_is_a_400_before_any_replica_changes(
        interval):
    front = bare_ingress(Replicas([AssertionError("no replica may be called")]))
    with pytest.raises(APIError) as raised:
        asyncio.run(front.set_policy(http_request({"stream_interval_ms": interval})))
    assert raised.value.status == 400 and "stream_interval_ms" in raised.value.message


def test_a_stream_interval_alone_reaches_every_replica():
    sent: list[dict] = []

    class Recording(Replicas):
        def broadcast(self, method: str, *args):
            sent.append({"method": method, **(args[0] if args else {})})
            return super().broadcast(method, *args)

    front = bare_ingress(Recording([None]))
    asyncio.run(front.set_policy(http_request({"stream_interval_ms": 0})))
    assert sent[0]["method"] == "reconfigure" and sent[0]["stream_interval_ms"] == 0


def ray_wrapped(error: Exception) -> Exception:
    """What a Serve handle returns for an exception raised in a replica: a RayTaskError that
    is also an instance of the cause's class, its text the replica's traceback."""
    from ray.exceptions import RayTaskError

    return RayTaskError("reconfigure", "Traceback ... secret frames", error).as_instanceof_cause()


def test_a_change_every_replica_refuses_as_invalid_is_a_400_with_the_reason():
    """A static K outside the replicas' tiers is only found by them: each leaves itself as
    it was, and the client gets their reason, not a 500 or a traceback."""
    reason = "static K=5 is not one of the candidate tiers [0, 1, 3, 7]"
    front = bare_ingress(Replicas([ray_wrapped(ValueError(reason))] * 2))
    with pytest.raises(APIError) as raised:
        asyncio.run(front.set_policy(http_request({"policy": {"name": "static", "k": 5}})))
    assert (raised.value.status, raised.value.message) == (400, reason)


def test_a_change_that_fails_on_some_replicas_only_is_a_server_fault():
    front = bare_ingress(Replicas([None, ray_wrapped(ValueError("odd replica"))]))
    with pytest.raises(APIError) as raised:
        asyncio.run(front.set_policy(http_request({"policy": {"name": "static", "k": 3}})))
    assert raised.value.status == 500 and "1 of 2" in raised.value.message


@pytest.mark.parametrize(("change", "reason"), [
    ({"policy": {"name": "ema"}, "candidate": [0, 1]}, "unknown keys ['candidate']"),
    ({"policy": {"name": "ema"}, "initial_k": 1}, "initial_k goes with candidates"),
    ({"candidates": "0137"}, "a list of integers"),
    ({"candidates": [0, 1.5, 3]}, "a list of integers"),
])
def test_a_change_with_a_key_or_value_no_replica_would_take_is_a_400_at_once(change, reason):
    """A typo'd key was a 200 that changed nothing; a string of digits became a tier list."""
    front = bare_ingress(Replicas([AssertionError("no replica may be called")]))
    with pytest.raises(APIError) as raised:
        asyncio.run(front.set_policy(http_request(change)))
    assert raised.value.status == 400 and reason in raised.value.message
