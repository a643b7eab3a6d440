"""Build the engine adapter a spec names. Imports are lazy: each engine pulls heavy packages."""

from __future__ import annotations

from typing import Any

from replicas.engines.base import Engine
from replicas.engines.spec import EngineSpec


def engine_class(engine: str) -> type[Any]:
    """The adapter class of an engine name. Its module imports no engine package (each
    adapter imports its own when built), so the app's builder can read what it offers."""
    if engine == "vllm":
        from replicas.engines.vllm_engine import VllmEngine

        return VllmEngine
    if engine == "sglang":
        from replicas.engines.sglang_engine import SglangEngine

        return SglangEngine
    from replicas.engines.sim_engine import SimulatedEngine

    return SimulatedEngine


def build_engine(spec: EngineSpec, replica_rank: int = 0) -> Engine:
    """`replica_rank` lets CPU engines pin their threads to a core of their own (and gives
    each simulated replica its own random stream)."""
    adapter = engine_class(spec.engine)
    if spec.engine == "sim":  # built from its preset, not from a model
        return adapter.from_spec(spec, replica_rank=replica_rank)
    return adapter(spec, replica_rank=replica_rank)
