"""The application builder: `serve run serve_config.yaml` calls `build_app(args)`.

`args` (the config file's `args`) are validated by `AppArgs`; the result is the ingress bound
to the engine-replica deployment, which carries the class-gathering request router and the
telemetry hub as a deployment-scoped actor.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ray import serve
from ray.serve import Application
from ray.serve.config import DeploymentActorConfig, RequestRouterConfig

from app.ingress import Ingress
from app.router import ClassGatheringRouter
from app.telemetry_hub import TelemetryHub
from policies.registry import build_policy, parse_policy_config
from replicas.chunks import stream_interval_s
from replicas.control_loop import check_policy_fits
from replicas.engines.factory import engine_class
from replicas.engines.spec import LOCAL_ENGINE_ENV, REPO_ROOT, EngineSpec
from replicas.replica import HUB_ACTOR, EngineReplica
from replicas.tier_pool import validate_candidates


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engine: EngineSpec = Field(default_factory=EngineSpec)
    candidates: list[int] = Field(default_factory=lambda: [0, 1, 3, 7, 15])
    initial_k: int | None = None
    policy: dict[str, Any] = Field(default_factory=lambda: {"name": "goodput"})
    num_replicas: int = Field(2, ge=1)
    decide_every_steps: int = Field(4, ge=1)
    telemetry_period_s: float = Field(0.5, gt=0, le=1.0)
    """How often replicas push stats and refresh their cluster view (and routing stats)."""
    stream_interval_ms: float = Field(50.0, ge=0)
    """A streamed request's tokens go to the ingress at most once per interval (the first at
    once), merged: one Serve message per engine step costs more CPU than the step. 0 sends
    every step's tokens as they come. Ray Serve LLM's `stream_batching_interval_ms`."""
    max_ongoing_requests: int = Field(64, ge=1)
    max_queued_requests: int = 256
    """Requests queued per handle beyond the replicas' `max_ongoing_requests`; -1: no limit."""
    ingress_max_ongoing_requests: int = Field(512, ge=1)
    replica_num_cpus: float = Field(0, ge=0)
    replica_num_gpus: float = Field(0, ge=0)
    """GPUs Ray reserves for each engine replica: its tensor-parallel size on GPU presets, so
    replicas get GPUs of their own and land only on nodes that have them."""
    api_key: str | None = None
    """Bearer key for every route but /health; also read from SPECSERVE_API_KEY."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment for the engine replicas (e.g. OTEL_EXPORTER_OTLP_ENDPOINT)."""

    @field_validator("max_queued_requests")
    @classmethod
    def _queue_limit(cls, limit: int) -> int:
        # Serve takes -1 or a positive limit, and would refuse 0 only at deploy time.
        if limit != -1 and limit < 1:
            raise ValueError(f"max_queued_requests must be -1 (no limit) or at least 1, "
                             f"got {limit}")
        return limit

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, policy: dict[str, Any]) -> dict[str, Any]:
        return parse_policy_config(policy).model_dump()

    @model_validator(mode="after")
    def _replicas_can_start(self) -> AppArgs:
        """Refuse here what every replica would refuse in its constructor (after starting its
        engine): candidates the engine cannot run, a policy that cannot run over them (a
        static K that is not a candidate) or on the engine (`stability` on SGLang, which
        reports no per-request outcomes), a stream interval that is not a finite number."""
        candidates = validate_candidates(self.candidates, self.engine.effective_kmax,
                                         self.initial_k)
        check_policy_fits(build_policy(self.policy, candidates),
                          engine_class(self.engine.engine), self.engine.engine)
        stream_interval_s(self.stream_interval_ms)
        return self


def _replica_env(args: AppArgs) -> dict[str, str]:
    passthrough = {key: value for key, value in os.environ.items()
                   if key.startswith(("OTEL_", "VLLM_", "SPECSERVE_", "HF_"))}
    # The engine-core process of vLLM imports `replicas.engines.vllm_hooks` by name.
    return {**LOCAL_ENGINE_ENV, **passthrough, "PYTHONPATH": str(REPO_ROOT), **args.env}


def build_app(args: AppArgs | dict[str, Any]) -> Application:
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    engine_replica = serve.deployment(
        EngineReplica,
        name="EngineReplica",
        num_replicas=args.num_replicas,
        max_ongoing_requests=args.max_ongoing_requests,
        max_queued_requests=args.max_queued_requests,
        ray_actor_options={"num_cpus": args.replica_num_cpus,
                           "num_gpus": args.replica_num_gpus,
                           "runtime_env": {"env_vars": _replica_env(args)}},
        request_router_config=RequestRouterConfig(
            request_router_class=ClassGatheringRouter,
            request_routing_stats_period_s=args.telemetry_period_s,
            request_routing_stats_timeout_s=max(0.5, args.telemetry_period_s)),
        deployment_actors=[DeploymentActorConfig(name=HUB_ACTOR, actor_class=TelemetryHub)],
        user_config={"policy": args.policy, "candidates": args.candidates},
        health_check_period_s=5,
        graceful_shutdown_timeout_s=10,
    )
    ingress = serve.deployment(Ingress, name="Ingress",
                               max_ongoing_requests=args.ingress_max_ongoing_requests,
                               ray_actor_options={"num_cpus": 0, "runtime_env": {
                                   "env_vars": _replica_env(args)}})
    return ingress.bind(
        engine_replica.bind(engine=args.engine.model_dump(), candidates=args.candidates,
                            policy=args.policy, initial_k=args.initial_k,
                            decide_every_steps=args.decide_every_steps,
                            telemetry_period_s=args.telemetry_period_s,
                            stream_interval_ms=args.stream_interval_ms),
        model_name=args.engine.name, kmax=args.engine.effective_kmax, api_key=args.api_key)
