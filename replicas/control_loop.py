"""The per-replica control loop: engine steps -> Signals -> policy -> tier pool.

Engine-agnostic and free of Ray: the replica deployment, the simulator harnesses and the tests
drive the same `ControlLoop`. Each `tick` drains the engine's step records; once at least
`decide_every_steps` steps have gathered (or at once, when a request of a new class arrives:
see `ControlLoop.tick`), they are folded into one `Signals` window, the policy decides, and the
tier pool switches if the answer differs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from policies.base import Policy
from policies.class_acceptance import ClassPrior
from policies.signals import (
    ClusterView,
    Decision,
    RequestWindows,
    Signals,
    StepCost,
    effective_concurrency,
)
from replicas.engines.base import Engine, StepRecord, add_per_position
from replicas.tier_pool import TierPool, TierSwitch


def add_steps_per_position(steps: list[StepRecord], accepted: list[int], drafted: list[int],
                           slots: list[int] | None = None) -> None:
    """Add the steps' accepted and drafted counts (and their open slots, when `slots` is
    given) into per-position totals, up to each total's length."""
    for step in steps:
        add_per_position(accepted, step.accepted_per_pos)
        add_per_position(drafted, step.drafted_per_pos)
        if slots is not None:
            add_per_position(slots, step.slots_per_pos)


def engine_load(last: StepRecord | None, held: int) -> tuple[int, int]:
    """(running, waiting) as a decision sees them: the engine's counts at its `last` step;
    and as waiting also those of the `held` requests on the replica that the engine did not
    run then (taken after the step, on their way in; or finished, the handler not closed)."""
    running = last.running if last else 0
    return running, max(last.waiting if last else 0, held - running)


def fold_steps(steps: list[StepRecord], candidates: tuple[int, ...], current_k: int,
               cluster: ClusterView | None = None,
               requests: RequestWindows | None = None,
               max_batch: int | None = None,
               class_prior: ClassPrior | None = None,
               draft_caps_apply: bool = False, new_class: bool = False,
               previous: StepRecord | None = None) -> Signals:
    """Sum a window of step records into Signals; per-position counts padded to max K.
    `previous`, the last step before the window, gives the engine's counts of a window
    without steps (a decision on an arrival).

    With a class prior, the requests the replica holds (`ClassPrior.class_of`) count: those
    the engine did not run at the last step count as waiting (this includes a request the
    engine finished whose handler has not closed yet), and those without verify outcomes yet
    get an empty row in `requests` (priced by their class)."""
    width = max(candidates)
    accepted, drafted, slots = [0] * width, [0] * width, [0] * width
    add_steps_per_position(steps, accepted, drafted, slots)
    class_prior = class_prior or ClassPrior()
    running, waiting = engine_load(steps[-1] if steps else previous, len(class_prior.class_of))
    if requests is not None:
        # Only as many as the batch has free slots, the first taken first: a queue beyond
        # them does not share this batch's steps (under overload it held hundreds).
        free = max(0, max_batch - len(requests)) if max_batch else None
        requests = requests.with_new(class_prior.class_of, free)
    return Signals(
        current_k=current_k, steps=len(steps),
        running=running, waiting=waiting,
        drafts=sum(s.drafts for s in steps),
        drafting_sequence_steps=sum(s.running for s in steps if s.k > 0),
        accepted_tokens=sum(s.accepted_tokens for s in steps),
        accepted_per_pos=tuple(accepted), drafted_per_pos=tuple(drafted),
        slots_per_pos=tuple(slots),
        # A step costs by the drafts it verified, not by its tier: prompt lookup on sampled
        # text leaves a deep tier's steps as cheap as K=0's. Steps of unknown length, and
        # steps that also prefilled prompts, are left out: a phase's burst of new prompts
        # charged to the depth in force made that tier look up to 10x dearer for a while.
        step_costs=tuple(StepCost(s.running, s.draft_depth, s.wall_s)
                         for s in steps if s.times_decoding),
        requests=RequestWindows() if requests is None else requests, cluster=cluster,
        max_batch=max_batch,
        class_prior=class_prior.rates, class_prior_fresh=class_prior.fresh,
        request_priors=tuple(class_prior.request_rates(request_id)
                             for request_id in requests.request_ids)
        if requests is not None and class_prior.by_class else (),
        draft_caps_apply=draft_caps_apply, new_class=new_class)


@dataclass
class LoopStats:
    decisions: int = 0
    last_decision_seconds: float = 0.0
    """Wall time of the last policy decision."""
    max_effective_concurrency: int = 0
    max_local_batch: int = 0
    last_signals: Signals | None = None


def check_policy_fits(policy: Policy, engine: Any, engine_name: str) -> None:
    """Raise ValueError if `engine` (an adapter, or its class) cannot serve `policy`: one
    that needs per-request outcomes (`Policy.needs_requests`) on an engine that reports none
    would never move K, and say only that it has no request history yet."""
    if policy.needs_requests and not hasattr(engine, "request_acceptance"):
        raise ValueError(f"{type(policy).__name__} needs per-request verify outcomes, "
                         f"which the {engine_name} engine does not report; "
                         "choose another policy")


class ControlLoop:
    def __init__(self, engine: Engine, pool: TierPool, policy: Policy,
                 decide_every_steps: int = 4,
                 max_batch: int | None = None,
                 class_prior: Callable[[], ClassPrior] | None = None,
                 on_switch_lag: Callable[[int], None] | None = None):
        self.engine = engine
        self.pool = pool
        self.decide_every_steps = decide_every_steps
        # Per-request outcomes, from engines that can attribute acceptance (see `Engine`).
        self._request_acceptance: Callable[[], RequestWindows] | None = \
            getattr(engine, "request_acceptance", None)
        self.check_policy(policy)
        self.policy = policy
        self.max_batch = max_batch
        self._class_prior = class_prior
        # Per-request draft caps, on engines that apply them (see `Decision.draft_caps`).
        self._applies_caps: bool = getattr(engine, "applies_draft_caps", False)
        self._caps_sent: dict[str, int] = {}
        self._pending: list[StepRecord] = []
        self._last_step: StepRecord | None = None
        self._classes_decided: set[str] = set()  # measured classes held at the last decision
        self.stats = LoopStats()
        # How late a switch takes effect: the tier switched to, and the steps the engine ran
        # at the old one since the decision (reported to `on_switch_lag` once the new K runs).
        self._switched_to: int | None = None
        self._stale_steps = 0
        self.on_switch_lag = on_switch_lag

    def _count_stale_steps(self, steps: list[StepRecord]) -> None:
        """Steps a switch decided before them ran at the old K: what the engine's reaction
        time costs (the decision window's own steps are not counted; they ran before it)."""
        if self._switched_to is None:
            return
        for step in steps:
            if step.k == self._switched_to:
                if self.on_switch_lag is not None:
                    self.on_switch_lag(self._stale_steps)
                self._switched_to = None
                return
            self._stale_steps += 1

    def effective_concurrency(self, held: int, cluster: ClusterView | None) -> int:
        """The effective concurrency a decision would see now (`held`: the requests on the
        replica, as `ClassPrior.class_of` gives them to `fold_steps`), between decisions too:
        the replica's gauge shows what the policy sees, not a second count."""
        return effective_concurrency(*engine_load(self._last_step, held), cluster)

    def check_policy(self, policy: Policy) -> None:
        check_policy_fits(policy, self.engine, self.engine.name)

    def replace_policy(self, policy: Policy) -> None:
        self.check_policy(policy)
        self.policy = policy
        self._pending.clear()
        self._classes_decided = set()  # the new policy has priced no class yet

    async def tick(self, cluster: ClusterView | None = None
                   ) -> tuple[list[StepRecord], Decision | None, TierSwitch | None]:
        """Drain steps; decide when a window is full, or at once when a request of a class
        the replica did not hold at the last decision arrived, a class some replica measured
        before, and the policy prices requests by class (`Policy.decides_on_arrival`): at a
        change of workload the new requests' class says which tier they want before they
        run a step, and waiting for a window of steps at the old tier cost a tenth of a
        second at each phase start over HTTP. (A class that leaves and comes back between
        two decisions is not new.) Returns (new steps, decision, switch)."""
        steps = self.engine.drain_steps()
        self._count_stale_steps(steps)
        self._pending.extend(steps)
        if steps:  # the engine's counts for a decision whose window holds no step
            self._last_step = steps[-1]
        # The class prior every tick only for a policy that decides on arrivals.
        class_prior = self._class_prior() if self._class_prior and \
            self.policy.decides_on_arrival else None
        arrived = class_prior is not None and \
            bool(class_prior.by_class.keys() - self._classes_decided)
        if len(self._pending) < self.decide_every_steps and not arrived:
            return steps, None, None
        if class_prior is None and self._class_prior:
            class_prior = self._class_prior()
        self._classes_decided = set(class_prior.by_class) if class_prior else set()
        engine_requests = self._request_acceptance() if self._request_acceptance and \
            self.policy.reads_requests else None
        signals = fold_steps(self._pending, self.pool.candidates, self.pool.active_k,
                             cluster, engine_requests, self.max_batch,
                             class_prior, self._applies_caps, arrived, self._last_step)
        self._pending = []
        started = time.perf_counter()
        decision = self.policy.decide(signals)
        self.stats.last_decision_seconds = time.perf_counter() - started
        self.stats.decisions += 1
        self.stats.last_signals = signals
        self.stats.max_effective_concurrency = max(self.stats.max_effective_concurrency,
                                                   signals.effective_concurrency)
        self.stats.max_local_batch = max(self.stats.max_local_batch, signals.local_batch)
        change = await self.pool.switch(decision.k) if decision.k in self.pool.candidates \
            else None
        if change is not None:
            self._switched_to, self._stale_steps = change.to_k, 0
        caps = decision.draft_caps or {}  # a policy without caps lifts the previous ones
        # Only requests with outcomes: an engine may not know a request just handed to it
        # (the simulator's queue), and caps it drops would not be sent again. A new
        # request's cap goes out at the first decision after its first step.
        if engine_requests is not None:
            known = set(engine_requests.request_ids)
            caps = {request_id: cap for request_id, cap in caps.items() if request_id in known}
        if self._applies_caps and caps != self._caps_sent:
            await self.engine.set_draft_caps(caps)
            self._caps_sent = caps
        return steps, decision, change
