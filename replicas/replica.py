"""The engine-replica deployment: engine + tier pool + policy + control loop, behind Ray Serve.

One instance per Serve replica. Requests stream through `generate`; a background task drains
engine steps every `TICK_S`, feeds the control loop (which may switch tier), records metrics,
and every telemetry period pushes stats to the telemetry hub and takes back the cluster view.
`reconfigure` (Serve's user_config, or a broadcast from the ingress's admin route) swaps the
policy and the candidate tiers, and sets the stream interval, without touching the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ray import serve

from observability import tracing
from observability.metrics import ReplicaMetrics
from policies.class_acceptance import DEFAULT_CLASS, ClassAcceptance, ClassPrior, class_counts
from policies.registry import build_policy, parse_policy_config
from policies.signals import ClusterView, Decision
from replicas.chunks import Chunk, coalesce, stream_interval_s
from replicas.control_loop import ControlLoop, add_steps_per_position
from replicas.engines.base import (
    SAMPLING_CONTROLS,
    EngineInputError,
    GenerationRequest,
    period_windows,
)
from replicas.engines.factory import build_engine
from replicas.engines.spec import EngineSpec
from replicas.runtime_change import RuntimeChange, parse_change
from replicas.tier_pool import TierPool, TierSwitch

# Serve's logger: lines land in the replica's log file with Serve's request context, and the
# deployment's `logging_config` sets their level (DEBUG shows every tier decision).
logger = logging.getLogger("ray.serve")

TICK_S = 0.02
HUB_ACTOR = "telemetry_hub"
FIRST_VIEW_TIMEOUT_S = 1.0


def _load_tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def max_chat_characters(tokenizer: Any, context: int) -> int:
    """The most characters a conversation's text can have and still fit `context` tokens:
    no token is longer than the longest vocabulary entry (vLLM bounds a text prompt so)."""
    return context * max(map(len, tokenizer.get_vocab()))


class EngineReplica:
    async def __init__(self, engine: dict[str, Any], candidates: list[int],
                       policy: dict[str, Any], initial_k: int | None = None,
                       decide_every_steps: int = 4, telemetry_period_s: float = 0.5,
                       stream_interval_ms: float = 50.0):
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        rank = getattr(context.rank, "rank", context.rank) or 0  # an object since ray 2.60
        spec = EngineSpec(**{**engine, "tiers": tuple(candidates)})
        self.model_name = spec.name
        self.engine = build_engine(spec, replica_rank=int(rank))
        await self.engine.start()
        self.pool = TierPool(self.engine, candidates, initial_k)
        await self.pool.apply_initial()
        self.metrics = ReplicaMetrics(self.replica_id, self.pool.candidates)
        config = parse_policy_config(policy)
        self.loop = ControlLoop(self.engine, self.pool, build_policy(config, self.pool.candidates),
                                decide_every_steps, max_batch=spec.max_num_seqs,
                                class_prior=self._class_prior,
                                on_switch_lag=self.metrics.record_switch_lag_steps)
        self.policy_config = config.model_dump()
        self._profile: list[tuple[int, int, float]] = []  # see `_with_known_profile`
        self._remember_profile(config)
        tracing.configure_tracing("specserve-replica")
        self.active_spans = tracing.ActiveSpans()
        self.telemetry_period_s = telemetry_period_s
        self.stream_interval_s = stream_interval_s(stream_interval_ms)
        # Requests in the handler per (router id, request class): routers take the others'.
        self._ongoing_by_router: Counter[tuple[str | None, str]] = Counter()
        self.cluster: ClusterView | None = None
        self._window = ([0] * self.engine.kmax, [0] * self.engine.kmax)
        self._hub: Any = None
        self._hub_call: Any = None
        self._hub_lock = asyncio.Lock()
        self.max_routed = 0
        # Loaded now: importing transformers inside a request would stall this event loop.
        # Its own, not the engine's: vLLM's can be a Mistral tokenizer, whose chat rendering
        # returns ids in another form.
        self._tokenizer = await asyncio.to_thread(_load_tokenizer, spec.model)
        self._max_chat_chars = await asyncio.to_thread(max_chat_characters, self._tokenizer,
                                                       self.engine.max_model_len)
        # Chat is rendered here, off the event loop (a long conversation would stall the
        # replica's other streams), one at a time, as vLLM's server renders in one thread.
        self._template_thread = ThreadPoolExecutor(max_workers=1,
                                                   thread_name_prefix="chat-template")
        # Run-time (admin) changes carry `issued_at`; the newest one applied so far.
        self._applied_issued_at = 0.0
        self._config_lock = asyncio.Lock()
        self._serve_configs_seen = 0
        self._request_class: dict[str, str] = {}
        self._classes = ClassAcceptance()
        self._control = asyncio.create_task(self._control_forever())
        logger.info("replica %s ready: engine=%s candidates=%s K=%d", self.replica_id,
                    self.engine.name, self.pool.candidates, self.pool.active_k)

    # ---- requests -------------------------------------------------------------------------

    async def _render_chat(self, messages: list[dict[str, Any]],
                           template_kwargs: dict[str, Any] | None = None) -> tuple[int, ...]:
        """The chat template's token ids, with nothing added: the template writes any BOS
        itself (vLLM's server tokenizes chat the same way; encoding the rendered text again
        would put a second BOS before a Llama 3 prompt's). `template_kwargs` are the
        request's variables for the template (`chat_template_kwargs`, such as Qwen3's
        `enable_thinking`); the ingress refused those that name this call's own options.
        Rendered in the template thread, off the event loop, and only if the messages' text
        could fit the context: a megabyte of it would hold the thread for most of a second
        and every other chat on the replica behind it. Nor are more messages rendered than
        the context has tokens: each renders to one at least (its role's markers), and
        empty ones hold no characters to count."""
        if len(messages) > self.engine.max_model_len:
            raise EngineInputError(
                f"this model's context is {self.engine.max_model_len} tokens, and the request "
                f"has {len(messages)} messages, each of which takes one token at least")
        characters = sum(len(message["content"]) for message in messages)
        if characters > self._max_chat_chars:
            raise EngineInputError(
                f"this model's context is {self.engine.max_model_len} tokens, and the messages "
                f"hold {characters} characters, more than {self._max_chat_chars}, which is the "
                f"most that many tokens can hold")

        def render() -> tuple[int, ...]:
            try:
                rendered = self._tokenizer.apply_chat_template(
                    messages, tokenize=True, add_generation_prompt=True, return_dict=True,
                    **(template_kwargs or {}))
            except Exception as error:  # a role or order the template refuses, or none
                raise EngineInputError(f"the model's chat template refused the messages: "
                                       f"{error}") from error
            return tuple(rendered["input_ids"])

        return await asyncio.get_running_loop().run_in_executor(self._template_thread, render)

    async def generate(self, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream one request: yields {"text", "token_ids", ...} chunks, or one {"error"}."""
        source = (payload.get("router_id"), payload.get("request_class", DEFAULT_CLASS))
        span = tracing.start_replica_span(
            payload.get("trace_context"), request_id=payload["request_id"],
            replica_id=self.replica_id, model=self.model_name, k_start=self.pool.active_k)
        before = self.engine.counters()
        # Counted only once nothing before the `try` can raise: its `finally` uncounts.
        self._ongoing_by_router[source] += 1
        self._request_class[payload["request_id"]] = source[1]
        self.active_spans.add(span)
        prompt_tokens = completion_tokens = 0
        error: BaseException | None = None
        finished = False
        try:
            if payload.get("logprobs") is not None and not self.engine.returns_logprobs:
                raise EngineInputError(f"logprobs are not available from the "
                                       f"{self.engine.name} engine")
            chat = payload.get("messages")
            chat_ids = await self._render_chat(chat, payload.get("chat_template_kwargs")) \
                if chat is not None else None
            max_tokens = payload["max_tokens"]
            if max_tokens is None and chat_ids is not None:  # to the end of the context
                max_tokens = self.engine.max_model_len - len(chat_ids)
                if max_tokens < 1:  # said here: the engine's error would name max_tokens
                    raise EngineInputError(
                        f"this model's context is {self.engine.max_model_len} tokens and "
                        f"the messages take {len(chat_ids)}, leaving none to generate")
            request = GenerationRequest(
                request_id=payload["request_id"],
                prompt=payload.get("prompt") if chat is None else None,
                prompt_token_ids=chat_ids,
                max_tokens=max_tokens, temperature=payload["temperature"],
                top_p=payload["top_p"], seed=payload.get("seed"),
                stop=tuple(payload.get("stop") or ()), logprobs=payload.get("logprobs"),
                ignore_eos=payload.get("ignore_eos", False),
                request_class=source[1],
                **{name: payload[name] for name in SAMPLING_CONTROLS if name in payload})
            # A chunk per interval, not per step; a caller that did not ask to stream gets
            # two (see `replicas.chunks`).
            interval = self.stream_interval_s if payload.get("stream", True) else math.inf
            async with contextlib.aclosing(coalesce(self._chunks(request), interval)) as chunks:
                async for chunk in chunks:
                    prompt_tokens, completion_tokens = chunk["prompt_tokens"], \
                        chunk["completion_tokens"]
                    finished = bool(chunk["finish_reason"])
                    yield chunk
        except EngineInputError as bad_input:
            error = bad_input
            yield {"error": {"message": str(bad_input), "type": "invalid_request_error",
                             "code": 400}}
        except BaseException as failed:  # the engine failed, or the client went away
            error = failed
            raise
        finally:
            if not finished:  # free the engine slot (a no-op for a request it never took)
                with contextlib.suppress(Exception):
                    await self.engine.abort(payload["request_id"])
            self._ongoing_by_router[source] -= 1
            if not self._ongoing_by_router[source]:
                del self._ongoing_by_router[source]
            self._request_class.pop(payload["request_id"], None)
            self.active_spans.discard(span)
            after = self.engine.counters()
            tracing.finish_span(
                span, error=error, prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens, k_end=self.pool.active_k,
                draft_tokens=after.draft_tokens - before.draft_tokens,
                accepted_tokens=after.accepted_tokens - before.accepted_tokens,
                verify_steps=after.drafts - before.drafts)

    async def _chunks(self, request: GenerationRequest) -> AsyncGenerator[Chunk, None]:
        async for chunk in self.engine.generate(request):
            yield {"text": chunk.text, "token_ids": list(chunk.token_ids),
                   "prompt_tokens": chunk.prompt_tokens,
                   "completion_tokens": chunk.completion_tokens,
                   "finish_reason": chunk.finish_reason,
                   "logprobs": [{"token": entry.token, "logprob": entry.logprob,
                                 "top": [list(pair) for pair in entry.top]}
                                for entry in chunk.logprobs] if chunk.logprobs else None}

    # ---- control ----------------------------------------------------------------------------

    async def _control_forever(self) -> None:
        last_push = 0.0
        while True:
            try:
                await self._control_once()
                if time.monotonic() - last_push >= self.telemetry_period_s:
                    last_push = time.monotonic()
                    self._update_class_acceptance()  # once a period, hub or not
                    await self._exchange_with_hub()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bad tick must never take the replica down
                logger.exception("control tick failed")
            await asyncio.sleep(TICK_S)

    async def _control_once(self) -> None:
        steps, decision, change = await self.loop.tick(self.cluster)
        if steps:
            self.metrics.record_steps(steps)
            add_steps_per_position(steps, *self._window)
        if decision is not None:
            logger.debug("decision K=%d -> %d: %s %s", self.pool.active_k if change is None
                         else change.from_k, decision.k, decision.reason, decision.inputs)
            self.metrics.record_decision_seconds(self.loop.stats.last_decision_seconds)
        if change is not None:
            self._note_switch(change, decision)
        self.metrics.set_effective_concurrency(self._effective_concurrency())
        counters = self.engine.counters()
        self.metrics.set_engine_load(counters.running, counters.waiting)

    def _note_switch(self, change: TierSwitch, decision: Decision) -> None:
        """Every tier switch is counted once and marked on every in-flight request span."""
        self.metrics.record_switch(change)
        self.active_spans.record_tier_switch(change, decision)

    def _effective_concurrency(self) -> int:
        """What the policy sees (the requests in the handler count as `fold_steps` counts
        them, from the same mapping)."""
        return self.loop.effective_concurrency(len(self._request_class), self.cluster)

    async def _exchange_with_hub(self) -> None:
        """Push stats, read the cluster view; never waits on a slow or missing hub."""
        async with self._hub_lock:  # the control task and start-up both exchange
            await self._exchange_unlocked()

    async def _exchange_unlocked(self) -> None:
        if self._hub_call is not None:
            done, _ = await asyncio.wait([self._hub_call], timeout=0)
            if not done:
                return  # the previous exchange is still in flight
            try:
                view = self._hub_call.result()
            except Exception as error:  # hub restarting or gone: keep the local signals
                logger.warning("replica %s lost the telemetry hub (%r); deciding on local "
                               "signals until it is back", self.replica_id, error)
                self.cluster, self._hub, view = None, None, None
            self._hub_call = None
            if view is not None:
                await self._apply_view(view)
        if self._hub is None:
            try:  # a blocking name lookup: keep it off this event loop
                self._hub = await asyncio.to_thread(serve.get_deployment_actor, HUB_ACTOR)
            except Exception as error:  # not up yet, or restarting: tried again next period
                logger.debug("replica %s: no telemetry hub yet (%r)", self.replica_id, error)
                return
        accepted, drafted = self._window
        self._window = ([0] * len(accepted), [0] * len(drafted))
        stats = {key: value for key, value in self.record_routing_stats().items()
                 if key != "hub"}
        # The per-class acceptance goes to the hub (the fleet's class hint), not to routers.
        self._hub_call = asyncio.ensure_future(self._hub.push.remote(
            self.replica_id, {**stats, "class_acceptance": dict(self._classes.own),
                              "class_fresh": self._classes.own_fresh,
                              "window_accepted": accepted, "window_drafted": drafted}))

    async def _first_view(self) -> None:
        """At start-up: one bounded exchange, so the policy starts from the cluster's prior."""
        await self._exchange_with_hub()
        if self._hub_call is not None:
            await asyncio.wait([self._hub_call], timeout=FIRST_VIEW_TIMEOUT_S)
            await self._exchange_with_hub()  # applies the view if it arrived

    async def _apply_view(self, view: dict[str, Any]) -> None:
        self.max_routed = max(self.max_routed, view.get("routed", 0))
        self.cluster = ClusterView.from_hub(view)
        self._classes.fleet = view.get("class_acceptance") or {}
        self._classes.fleet_fresh = view.get("class_fresh") or {}
        override = view.get("policy_override")
        if override:  # a fleet-wide change made while this replica was away (or before it started)
            await self._apply_in_order(override, override["issued_at"])

    # ---- Serve hooks --------------------------------------------------------------------------

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Change policy, candidate tiers and/or stream interval at run time: no restart, no
        engine rebuild.

        Called by Serve with the deployment's `user_config` (at start and on every redeploy)
        and by the ingress's admin route (a broadcast carrying `issued_at`). Admin changes go
        to the hub, so replicas started later apply them too; a redeployed user_config
        supersedes them (the hub forgets the override).
        """
        if not user_config:
            return
        issued_at = user_config.get("issued_at")
        if not await self._apply_in_order(user_config, issued_at):
            return  # applied already (from the hub), or older than a change applied since
        if issued_at is not None:
            self._tell_hub("set_policy_override", user_config)
        else:
            if self._serve_configs_seen:  # a redeploy, not this replica's start-up config
                self._tell_hub("clear_policy_override", time.time())
            else:  # start-up: take the cluster's prior and any newer fleet-wide change
                await self._first_view()
            self._serve_configs_seen += 1

    async def _apply_in_order(self, user_config: dict[str, Any], issued_at: float | None
                              ) -> bool:
        """Apply a change unless it, or a newer run-time change, was applied already (a
        deployment's user_config, without `issued_at`, always applies). One at a time: the
        admin broadcast and the hub's view can bring the same change at once, and applying
        one awaits the tier pool, where the other would start over it."""
        async with self._config_lock:
            if issued_at is not None and issued_at <= self._applied_issued_at:
                return False
            await self._apply_config(user_config)
            if issued_at is not None:
                self._applied_issued_at = issued_at
            return True

    def _tell_hub(self, method: str, argument: Any) -> None:
        if self._hub is not None:
            with contextlib.suppress(Exception):  # best effort: the hub may be restarting
                getattr(self._hub, method).remote(argument)

    async def _apply_config(self, user_config: dict[str, Any]) -> None:
        # Everything is checked, and a new policy built, before anything changes: a bad
        # interval, policy or tier list, or a key no change carries, leaves the replica as it
        # was.
        change = parse_change(user_config, self.engine.kmax)
        if change.policy is not None or change.candidates is not None:
            await self._apply_policy_change(change)
        if change.stream_interval_s is not None:  # streams started before keep theirs
            self.stream_interval_s = change.stream_interval_s
        logger.info("replica %s reconfigured: %s", self.replica_id, user_config)

    async def _apply_policy_change(self, change: RuntimeChange) -> None:
        """New candidate tiers and/or a new policy, the policy rebuilt over the tiers."""
        candidates = self.pool.candidates if change.candidates is None else change.candidates
        config = self._with_known_profile(parse_policy_config(self.policy_config)
                                          if change.policy is None else change.policy)
        # A policy chooses among the tiers it was built with: new candidates rebuild it
        # (its learned state starts over, as on a change of policy).
        policy = build_policy(config, candidates)
        self.loop.check_policy(policy)  # one this engine cannot serve is refused here
        if change.candidates is not None:
            switch = await self.pool.set_candidates(candidates, change.initial_k)
            self.metrics.set_candidates(self.pool.candidates)
            if switch is not None:
                self._note_switch(switch, Decision(switch.to_k, "candidate tiers changed"))
        self.loop.replace_policy(policy)
        self.policy_config = config.model_dump()
        self._remember_profile(config)
        if config.name == "static":  # apply at once rather than at the next decision
            switch = await self.pool.switch(self.loop.policy.k)
            if switch is not None:
                self._note_switch(switch, Decision(switch.to_k, "reconfigured to static"))

    def _with_known_profile(self, config: Any) -> Any:
        """A `goodput` config sent without `profile` takes the last one this replica was
        given (the deployment's, or one sent since): step costs belong to the machine, not
        to a policy, and without them `goodput` prices only the tiers it has measured since
        (it holds K until then). An explicit `profile: []` is kept as sent."""
        if config.name != "goodput" or "profile" in config.model_fields_set or \
                not self._profile:
            return config
        return config.model_copy(update={"profile": self._profile})

    def _remember_profile(self, config: Any) -> None:
        if config.name == "goodput" and config.profile:
            self._profile = list(config.profile)

    def _update_class_acceptance(self) -> None:
        """Per request class, decayed per-position acceptance from the recent verify
        outcomes of the requests running now and of those that finished since the last
        period."""
        if hasattr(self.engine, "request_acceptance"):
            self._classes.observe(class_counts(*period_windows(self.engine, self._request_class),
                                               self.engine.kmax))

    def _class_prior(self) -> ClassPrior:
        """What the classes of the requests on this replica showed before."""
        return self._classes.prior(Counter(self._request_class.values()), self._request_class)

    def record_routing_stats(self) -> dict[str, Any]:
        counters = self.engine.counters()
        return {"running": counters.running, "waiting": counters.waiting,
                "ongoing": len(self._request_class), "active_k": self.pool.active_k,
                # Routers price the requests that would wait behind a full batch.
                "max_num_seqs": self.loop.max_batch,
                # Routers take the other routers' share, in all and per class, and count
                # their own themselves, fresher.
                "ongoing_by_router": self._ongoing_by_router_report(),
                "hub": self._hub}  # routers report what they routed to it

    def _ongoing_by_router_report(self) -> dict[str | None, dict[str, int]]:
        """Requests in the handler as {router id: {request class: count}}."""
        report: dict[str | None, dict[str, int]] = {}
        for (router, request_class), count in self._ongoing_by_router.items():
            report.setdefault(router, {})[request_class] = count
        return report

    def stats(self) -> dict[str, Any]:
        counters = self.engine.counters()
        return {"replica_id": self.replica_id, "engine": self.engine.name,
                "active_k": self.pool.active_k, "candidates": list(self.pool.candidates),
                "switch_count": self.pool.switch_count, "policy": self.policy_config,
                "stream_interval_ms": round(1000 * self.stream_interval_s, 3),
                "max_effective_concurrency": self.loop.stats.max_effective_concurrency,
                "max_local_batch": self.loop.stats.max_local_batch,
                "max_routed": self.max_routed,
                "cluster_view": self.cluster is not None,
                "effective_concurrency": self._effective_concurrency(),
                "class_acceptance": dict(self._classes.own),
                "fleet_class_acceptance": dict(self._classes.fleet),
                "counters": {key: value for key, value in counters.__dict__.items()
                             if not isinstance(value, list)},
                # The step costs the policy learned, for a policy that learns them
                # (`goodput`): a profile to start the next deployment from.
                "learned_profile": learned() if (learned := getattr(
                    self.loop.policy, "learned_profile", None)) else None}

    def metrics_snapshot(self) -> dict[str, Any]:
        return self.metrics.snapshot()

    async def check_health(self) -> None:
        """Serve's periodic health check: a dead engine or control loop gets the replica
        restarted (its tier pool is rebuilt and it takes the cluster prior again)."""
        if self._control.done():
            raise RuntimeError("the replica's control loop stopped")
        await self.engine.check_health()

    async def ready(self) -> bool:
        """For the ingress's /health: answers only when this replica can serve."""
        await self.check_health()
        return True

    async def __del__(self) -> None:
        self._control.cancel()
        self.metrics.shutdown()
        self._template_thread.shutdown(wait=False)
        await self.engine.shutdown()
