"""Shared fixtures for the application tests: one local Ray cluster with Serve per test module."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def serve_url() -> Iterator[str]:
    """Ray (2 CPUs, loopback only, no token auth, no dashboard) and Serve's HTTP proxy on a
    free 127.0.0.1 port; the module deploys its application (`serve.run` or `deploy_config`).

    Environment a module needs in the Ray processes must be set before this fixture runs.
    """
    import ray
    from ray import serve

    os.environ["RAY_AUTH_MODE"] = "disabled"
    # Config-file deployments build the app inside the cluster: it must import `app.builder`.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    os.environ["NO_PROXY"] = "127.0.0.1,localhost"  # the clients talk to loopback directly
    ray.init(_node_ip_address="127.0.0.1", num_cpus=2, include_dashboard=False,
             log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy_config(app: dict[str, Any], timeout_s: float = 600) -> None:
    """Deploy one application from its config-file form, as `serve run`/`serve deploy` do.

    Only this declarative path keeps running replicas when just a deployment's `user_config`
    changed (Serve then calls `reconfigure`); `serve.run` of a Python application always
    replaces them (random code version). Serve has no public Python call for it, so this uses
    the controller client that the CLI uses.
    """
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ApplicationStatus, ServeDeploySchema

    _get_global_client().deploy_apps(ServeDeploySchema(applications=[app]))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = serve.status().applications.get(app["name"])
        if status is not None and status.status == ApplicationStatus.RUNNING:
            return
        if status is not None and status.status == ApplicationStatus.DEPLOY_FAILED:
            raise RuntimeError(status.message)
        time.sleep(0.1)
    raise TimeoutError(f"application {app['name']} not running after {timeout_s} s")


def bare_ingress(engine: Any, *, model_name: str = "target", kmax: int = 15,
                 broadcast_timeout_s: float = 10.0, metrics: Any = None) -> Any:
    """The ingress class under Serve's ASGI wrapper (whose async __del__ wants a running
    replica), over a stand-in engine handle: its routes run without Ray or Serve."""
    from app.ingress import Ingress

    front = object.__new__(Ingress.__mro__[1])
    front.engine, front.model_name, front.kmax, front.api_key = engine, model_name, kmax, None
    front.broadcast_timeout_s, front.metrics = broadcast_timeout_s, metrics
    return front


def http_request(body: Any) -> Any:
    """A POST request whose body is `body` (bytes as they are, else its JSON), for
    `bare_ingress` routes."""
    import json

    from starlette.requests import Request

    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    messages = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": [],
                    "query_string": b""}, receive)
