"""The ingress's calls to every replica (`/metrics`, `/admin/*`): a failing replica is left out
of a scrape, not a 500; replicas too slow to answer are a 503, not a request that hangs."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from app.ingress import APIError, Ingress


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


def ingress_over(replicas: Replicas, timeout_s: float = 10.0) -> Ingress:
    # The class under Serve's ASGI wrapper (whose async __del__ wants a running replica):
    # no Serve replica is needed for these calls.
    front = object.__new__(Ingress.__mro__[1])
    front.engine, front.broadcast_timeout_s = replicas, timeout_s
    return front


def test_a_failing_replica_is_left_out_of_what_the_others_answer():
    front = ingress_over(Replicas([{"replica_id": "a"}, RuntimeError("dying"),
                                   {"replica_id": "c"}]))
    assert asyncio.run(front._from_every_replica("stats")) == [{"replica_id": "a"},
                                                               {"replica_id": "c"}]


def test_replicas_too_slow_to_answer_are_a_503():
    front = ingress_over(Replicas([{"replica_id": "a"}], delay_s=1.0), timeout_s=0.05)
    with pytest.raises(APIError) as raised:
        asyncio.run(front._from_every_replica("metrics_snapshot"))
    assert raised.value.status == 503
