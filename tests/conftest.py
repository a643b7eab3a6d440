"""Shared fixtures for the application tests: one local Ray cluster with Serve per test module."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def serve_url() -> Iterator[str]:
    """Ray (2 CPUs, loopback only, no token auth, no dashboard) and Serve's HTTP proxy on a
    free 127.0.0.1 port; the module deploys its application with `serve.run`.

    Environment a module needs in the Ray processes must be set before this fixture runs.
    """
    import ray
    from ray import serve

    os.environ["RAY_AUTH_MODE"] = "disabled"
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
