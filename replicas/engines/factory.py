"""Build the engine adapter a spec names. Imports are lazy: each engine pulls heavy packages."""

from __future__ import annotations

from replicas.engines.base import Engine
from replicas.engines.spec import EngineSpec


def build_engine(spec: EngineSpec, replica_rank: int = 0) -> Engine:
    """`replica_rank` lets CPU engines pin their threads to a core of their own (and gives
    each simulated replica its own random stream)."""
    if spec.engine == "vllm":
        from replicas.engines.vllm_engine import VllmEngine

        return VllmEngine(spec, replica_rank=replica_rank)
    if spec.engine == "sglang":
        from replicas.engines.sglang_engine import SglangEngine

        return SglangEngine(spec, replica_rank=replica_rank)
    from replicas.engines.sim_engine import SimulatedEngine

    return SimulatedEngine.from_spec(spec, replica_rank=replica_rank)
