"""`goodput`: pick the K that maximises expected tokens per second, from measured costs.

    score(K) = B * (1 + q * sum_{k<K} p[k]) / step_time(B, K)

B is the replica's concurrency (by default its *effective* concurrency from the cluster view:
running + waiting + routed-not-admitted), q the share of sequence-steps that proposed drafts
at all (prompt lookup proposes nothing where the context has no match), p[k] the share of
proposals with more than k tokens accepted, and step_time(B, K) the engine step time, learned
online by the drafts a step verified: a tier K verifies the draft positions below K that
the drafter fills (every one for a draft model; prompt lookup fills fewer deep positions on a
copy and few of any on text without repeats, where a deep tier then costs about what K=0
does; see `policies.step_cost.DraftFill`).

The estimators live beside this module: `policies.step_cost` (step time per batch and draft
depth, the drafter's fill per position) and `policies.acceptance` (per-position acceptance of
the replica and of each running request). This one scores the tiers and decides.

Follows SmartSpec/TurboSpec (argmax of goodput over profiled latency) and vLLM's original
dynamic-SD proposal (argmax (1 + sum a_j) / ITL(B, K)). Differences:
- p[k] comes from per-position windows that count only drafts that reached position k, so the
  estimate stays unbiased when K changes; positions never drafted are filled from a prior (what
  the request classes now on the replica showed before, else the cluster's mean), else
  extrapolated geometrically. The class prior comes first: under class-gathering routing the
  cluster's mean describes other classes' traffic. The prior lends its conditional rates
  p[k] / p[k-1], carried on from this replica's own p[k-1], not its absolute ones (see
  `_continue`).
- Nothing measures positions deeper than the current K: at K=0 nothing shows that drafts
  started to land again, and at a shallow K the geometric extrapolation undersells drafters
  whose acceptance comes in runs (prompt lookup: a copied span lands whole). So after
  `probe_interval_steps` on a tier whose next tier's positions have no fresh evidence, the
  policy runs that next tier for one dwell period to measure (bounded exploration: at most two
  switches per interval; nothing else switches during a dwell). A probe that finds nothing
  doubles the interval before the next (up to `max_probe_backoff` times), and one that finds
  drafts landing (the policy holds the tier for an interval, or goes deeper) restores it:
  traffic whose drafts never land is not probed every interval for as long as it lasts
  (over HTTP, sampled text at concurrency 1: a median of 6 switches a round, from 20). The
  backoff applies only while the replica's requests have a class prior, whose hint (below)
  brings it up when drafts would land; without one the probe is its only way to see that. A
  request of a new class does not restore it: at concurrency 1 every request is one (the
  replica held none at the decision before), and a class known to land drafts brings the
  replica up by its hint, not by a probe. At K=0 the request classes now on the replica are
  a hint too: when their past acceptance (the fleet's, else this replica's) says a tier would
  win, the policy goes straight to the one it says wins instead of waiting out the interval.
  An old prior does not replace the probe (a class's traffic may change), a fresh one does:
  when another replica measured the next tier's positions for the request classes now here
  within the last few telemetry periods (`class_prior_fresh`), the probe would only repeat it,
  so the fleet probes a class about once an interval instead of once per replica.
- A batch that mixes requests whose drafts land with requests whose drafts fail is scored by
  its steady state, from the per-request outcomes an engine reports (vLLM's and the
  simulator do; see `BatchAcceptance.steady`): 1 + q * sum p[k] is the mean
  over the batch as it is now, and a deeper K changes the batch (the landing requests
  finish sooner and the others take their slots).
- Step costs are measured on this replica every step (seeded by a profile table), not only
  profiled once, as the machine's level now times a shape per batch and depth, so tiers
  measured in different spells of a shared machine are compared at one level; the shape is
  interpolated piecewise in batch size so the regime knee is kept (see `StepCostModel`).
- A switch margin and a minimum dwell stop ping-pong; K=0 is an ordinary candidate. The
  dwell does not hold a tier when a request of a new class arrives (`Signals.new_class`):
  its class prices it before its first step (see `ControlLoop.tick`). The
  burden of proof is on drafting: a drafting tier within `DRAFT_TIE` of the floor whose
  drafts buy less than the margin in tokens is left for it without the margin (see
  `_buys_nothing`), unless its drafter leaves its slots nearly empty, so its steps cost the
  floor's (see `_idle_drafter`).
- With `tpot_slo_ms`, only the tokens of requests the tier keeps within that time per
  output token count (DistServe's goodput; see `GoodputConfig.tpot_slo_ms`).
- At K=0 on traffic whose drafts do not land, no tier is scored when a bound shows none
  could beat K=0 by the margin (see `_hold_k0`): the decision scoring would make, without
  the CPU that the engines share on a small machine.
- A shift in first-position acceptance beyond `shift_threshold` restarts the acceptance
  estimate (and sets the lagging prior aside for a few decisions): at a phase change
  the decayed windows would otherwise hold the old traffic for several decisions.
"""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from policies.acceptance import (
    AcceptanceWindow,
    BatchAcceptance,
    batch_acceptance,
    extended_rates,
    most_tokens_without_landings,
)
from policies.signals import Decision, Signals, StepCost
from policies.step_cost import DraftFill, StepCostModel

# A drafting tier whose drafts buy (nearly) nothing is kept only while it beats the floor
# (K=0, or the smallest drafting tier: see `GoodputPolicy._floor`) by this share. The switch
# margin guards a move either way against noise, but a tier whose drafts buy nothing ties
# the floor: predicted cost never falls as K grows, so a tier measured cheaper than K=0 was,
# earlier and on a faster spell of the machine, scores the same as K=0 and the margin would
# hold it (over HTTP both replicas kept K=3 through a sampled phase where nothing landed).
# Only against the floor: between two drafting tiers that tie, the deeper one keeps measuring
# the deep positions (a replay that also left deep tiers for shallower ties fell from 1.52x
# to 1.36x the best static).
DRAFT_TIE = 0.01
# Steps a measured (batch, depth) point needs before `GoodputPolicy.learned_profile` reports
# it: a point seen a few times holds the jitter of those few steps (and its prior's share).
LEARNED_PROFILE_MIN_STEPS = 20
# Per-request draft caps tried for each K (see `GoodputPolicy._evaluate`): a request drafts
# the positions whose drafts land with at least this chance. Free text lands at a few percent
# a position, code-like text at tens of percent for the first few, copies near 1.
CAP_THRESHOLDS = (0.05, 0.15, 0.3, 0.5)


class GoodputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Literal["goodput"] = "goodput"
    concurrency_source: Literal["local", "effective"] = "effective"
    switch_margin: float = Field(0.05, ge=0)
    """A new K must beat the current one's score by this share."""
    min_dwell_steps: int = Field(8, ge=0)
    """Engine steps to stay on a tier after switching."""
    acceptance_decay: float = Field(0.7, gt=0, le=1)
    """Per-decision decay of the per-position acceptance windows, and of what else describes
    the traffic: the share of sequence-steps that proposed drafts (`draft_share`) and the
    drafter's fill per position (`DraftFill`)."""
    shift_threshold: float = Field(0.3, gt=0, le=1)
    """When a window's first-position acceptance differs from the decayed estimate by more
    than this, the traffic changed (a new phase, a new mix): the estimate restarts from that
    window instead of decaying towards it. 1 never restarts. Also how far this replica's own
    first-position acceptance may be from the prior's before the prior is set aside as
    describing other traffic (`AcceptanceWindow.uses_prior`)."""
    prior_strength: float = Field(4.0, ge=0)
    """The prior counts as this many drafts at every position."""
    probe_interval_steps: int = Field(256, ge=1)
    """After this many engine steps on a tier, measure the next deeper tier when its positions
    have no fresh evidence (from K=0: the smallest positive tier)."""
    max_probe_backoff: int = Field(8, ge=1)
    """Each probe in a row that finds nothing doubles the interval before the next, up to this
    many times `probe_interval_steps` (1: a probe every interval)."""
    cost_decay: float = Field(0.999, gt=0, le=1)
    """Per-observation decay of a measured step cost's shape (the EWMA takes 1 - decay of each
    new step; a profiled point starts worth 1 / (1 - decay) steps): slow, because step wall
    times on a shared machine jitter by tens of percent, and its speed, which moves within
    seconds, is learned apart (see `StepCostModel`). 1 never forgets: a profile stays as
    given."""
    draft_caps: bool = True
    """Cap each request's drafts at the positions worth verifying, where the engine can
    (`Signals.draft_caps_apply`): in a batch that mixes requests whose drafts land with
    requests whose drafts fail, one K for all either starves the first or makes every step
    verify the second's failing drafts."""
    min_draft_cap: int = Field(1, ge=1)
    """Drafts a capped request still verifies: its evidence that drafts land again (a cap of
    0 would measure nothing, and the cap would never lift)."""
    profile: list[tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=0)],
                        Annotated[float, Field(gt=0)]]] = Field(default_factory=list)
    """Seed step costs: (batch, draft tokens per sequence, seconds) rows, e.g. from
    `bench.engine_bench` at tiers the drafter fills (there the depth is K). A batch of at
    least 1, a depth of at least 0 and a positive time: costs divide the tokens."""
    tpot_slo_ms: float | None = Field(None, gt=0)
    """A bound on time per output token. When set, K is scored by the tokens a second of the
    requests it keeps within the bound (a request's step seconds over the tokens it gains a
    step), not of all: a deeper tier that lifts the batch's tokens/s by slowing the requests
    whose drafts fail past the bound does not pay (DistServe's goodput). While no tier keeps
    any request within it (a batch too large for the bound), every token counts again."""

def _scores(parts: dict[int, tuple[float, float]], batch: int) -> dict[int, float]:
    """Tokens/s per K from `GoodputPolicy._evaluate`'s (tokens per sequence-step, seconds)."""
    return {k: batch * length / seconds for k, (length, seconds) in parts.items()}


class GoodputPolicy:
    reads_requests = True
    needs_requests = False  # without them it scores the batch's mean as it is now
    decides_on_arrival = True

    def __init__(self, config: GoodputConfig, candidates: tuple[int, ...]):
        self.config = config
        self.candidates = candidates
        self.costs = StepCostModel(config.cost_decay)
        for batch, depth, seconds in config.profile:
            self.costs.seed(StepCost(batch, depth, seconds))
        self.acceptance_width = max(1, max(candidates))
        self.acceptance = AcceptanceWindow(self.acceptance_width, config.acceptance_decay,
                                           config.prior_strength, config.shift_threshold)
        self._steps_on_tier = 0
        self._share = (0.0, 0.0)  # decayed (sequence-steps that proposed, that could have)
        self.fill = DraftFill(self.acceptance_width, config.acceptance_decay)
        self._steps = 0
        self._last_drafted = [0] * max(1, max(candidates))  # step count when last drafted
        self._probe_backoff = 1  # the probe interval's multiplier (see `max_probe_backoff`)
        # (tier, step count) of the last probe, until `_judge_probe` has judged it
        self._probed: tuple[int, int] | None = None

    def _batch(self, signals: Signals) -> int:
        return signals.verify_batch(signals.effective_concurrency if
                                    self.config.concurrency_source == "effective"
                                    else signals.local_batch)

    def scores(self, signals: Signals, rates: list[float], share: float | None = None
               ) -> dict[int, float]:
        """Expected tokens/s per candidate (empty until some step cost is known; only the
        tokens within `tpot_slo_ms` when set), with drafts proposed at a share `share` of
        the sequence-steps (default: the measured `draft_share`)."""
        return _scores(self._evaluate(signals, rates, share)[0], self._batch(signals))

    def _evaluate(self, signals: Signals, rates: list[float], share: float | None = None
                  ) -> tuple[dict[int, tuple[float, float]], dict[int, dict[str, int]]]:
        """Per candidate (see `scores`): (tokens per sequence-step, step seconds);
        and per K the per-request draft caps assumed there (none: every request drafts K).

        Where the engine applies caps (see `GoodputConfig.draft_caps`), each K is scored
        with the best of a few cap sets: each request drafts the positions that land with at
        least a threshold (`CAP_THRESHOLDS`), or all K. Scored, not derived from a marginal
        price: the step cost is not linear in the drafts (flat up to a knee on a GPU), and a
        price taken from the average slope capped a copy-only batch at one draft. Cap sets
        are tried from the loosest threshold up, and each must beat the best score so far
        (uncapped, or a looser set) by the switch margin: the least capping that pays."""
        ks = self.candidates
        share = self.draft_share if share is None else share
        landing = [share * rate for rate in rates]
        batch = self._batch(signals)
        requests = batch_acceptance(signals.requests, landing, self.config.prior_strength,
                                    signals.request_priors, signals.current_k)
        if requests is None:  # no per-request outcomes: the batch's mean as it is now
            options = [(None, [1 + sum(landing[:k]) for k in ks],
                        [self.fill.verified(k) for k in ks])]
        else:
            per_step, per_sequence = requests.steady(ks, None, self.fill.verified_each)
            options = [(None, per_step.tolist(), per_sequence.tolist())]
            if self.config.draft_caps and signals.draft_caps_apply:
                # A set of caps per threshold, all scored at once.
                caps = requests.caps(np.array(CAP_THRESHOLDS), self.config.min_draft_cap)
                per_step, per_sequence = requests.steady(ks, caps, self.fill.verified_each)
                options += zip(caps, per_step.tolist(), per_sequence.tolist(), strict=True)
        # A tier costs what the drafts it would verify cost (see `DraftFill`).
        depths = {d for _, _, drafts in options for d in drafts}
        seconds = self.costs.predict_row(batch, tuple(depths))
        bound_s = None if self.config.tpot_slo_ms is None else self.config.tpot_slo_ms / 1000
        parts, chosen = self._best_options(options, ks, seconds, requests, bound_s,
                                           signals.current_k)
        if bound_s is not None and parts and not any(length for length, _ in parts.values()):
            # No tier keeps any request within the bound: the most tokens drain the queue.
            parts, chosen = self._best_options(options, ks, seconds, requests, None,
                                               signals.current_k)
        ids = signals.requests.request_ids
        return parts, {k: {} if caps is None else {
            request_id: cap for request_id, cap in zip(ids, caps.tolist(), strict=True)
            if cap < k} for k, caps in chosen.items()}

    def _best_options(self, options: list[tuple[np.ndarray | None, list[float], list[float]]],
                      ks: tuple[int, ...], seconds: dict[float, float],
                      requests: BatchAcceptance | None, bound_s: float | None, current: int
                      ) -> tuple[dict[int, tuple[float, float]], dict[int, np.ndarray | None]]:
        """Per K, the best of `options` (caps, tokens per sequence-step, drafts per sequence
        at each K): its (tokens per sequence-step, step seconds), counting only the tokens
        of requests within `bound_s` per token when given; and the caps it takes.

        The bound is looser by the switch margin on the `current` tier and tighter by it on
        the others: a request's tokens count or not, so a step time that jitters across
        the bound moves a score by the request's whole share, which the margin on scores
        alone does not absorb."""
        parts: dict[int, tuple[float, float]] = {}
        chosen: dict[int, np.ndarray | None] = {}
        band = 1 + self.config.switch_margin
        for caps, lengths, drafts in options:
            # Caps must earn the switch margin over the looser choice before them: a batch of
            # one class differs request to request only by the noise of 30-step windows.
            needed = 1.0 if caps is None else band
            for k, length, depth in zip(ks, lengths, drafts, strict=True):
                cost = seconds.get(depth)
                if cost is None:
                    continue
                if bound_s is not None:
                    banded_s = bound_s * band if k == current else bound_s / band
                    # A batch mean without per-request outcomes: all of its tokens or none.
                    length *= float(cost <= banded_s * length) if requests is None else \
                        requests.share_within(k, caps, cost, banded_s)
                if k in parts and length / cost <= needed * parts[k][0] / parts[k][1]:
                    continue
                parts[k] = (length, cost)
                chosen[k] = caps
        return parts, chosen

    def learned_profile(self) -> list[tuple[int, int, float]]:
        """The step costs this replica now predicts, as `GoodputConfig.profile` rows
        (batch, draft tokens per sequence, seconds): the points it measured (from
        `LEARNED_PROFILE_MIN_STEPS` steps up) and the seeded ones, all at its level now
        (see `StepCostModel.profile_rows`). A deployment's `profile` replaced by them starts
        from this machine's costs rather than the shipped ones."""
        return [(cost.batch, cost.depth, round(cost.seconds, 6))
                for cost in self.costs.profile_rows(LEARNED_PROFILE_MIN_STEPS)]

    @property
    def draft_share(self) -> float:
        """Share of sequence-steps at K > 0 that proposed drafts (1 until measured)."""
        proposed, ran = self._share
        return proposed / ran if ran else 1.0

    def decide(self, signals: Signals) -> Decision:
        self.acceptance.update(signals.accepted_per_pos, signals.drafted_per_pos)
        if signals.drafting_sequence_steps:
            decay = self.config.acceptance_decay
            self._share = (self._share[0] * decay + min(signals.drafts,
                                                        signals.drafting_sequence_steps),
                           self._share[1] * decay + signals.drafting_sequence_steps)
            self.fill.update(signals.drafted_per_pos, signals.slots_per_pos)
        for cost in signals.step_costs:
            self.costs.observe(cost)
        self._steps_on_tier += signals.steps
        self._steps += signals.steps
        for pos, drafted in enumerate(signals.drafted_per_pos):
            if drafted:
                self._last_drafted[pos] = self._steps
        current = signals.current_k
        prior = signals.class_prior or (signals.cluster.acceptance_prior if signals.cluster
                                        else ())
        rates = self.acceptance.rates(prior)
        most = self._most_tokens_at_k0(signals, rates)
        if most <= 1 + self.config.switch_margin:
            held = self._hold_k0(signals, rates, most)
            if held is not None:
                return held
        parts, caps_by_k = self._evaluate(signals, rates)
        if current not in parts:
            return Decision(current, "no cost data yet")
        scores = _scores(parts, self._batch(signals))
        best = max(scores, key=lambda k: (scores[k], -k))  # ties go to the smaller K
        inputs = {**self._observed(signals, rates),
                  "score_current": scores[current], "score_best": scores[best],
                  # Why a score is what it is: tokens per sequence-step and the step's ms.
                  "tokens_current": parts[current][0], "tokens_best": parts[best][0],
                  "step_ms_current": 1000 * parts[current][1],
                  "step_ms_best": 1000 * parts[best][1],
                  # Every tier's score and tokens per sequence-step: a decision log (or a
                  # switch's span) shows how near the tiers it did not take came, and why.
                  **{f"score_k{k}": score for k, score in scores.items()},
                  **{f"tokens_k{k}": length for k, (length, _) in parts.items()}}
        if caps_by_k.get(current):  # requests whose drafts are capped below K
            inputs["capped_requests"] = float(len(caps_by_k[current]))
        # The dwell holds a tier against noisy measurements; a new class's arrival is news.
        if self._in_dwell(signals):
            return Decision(current, "dwell", inputs, caps_by_k.get(current))
        decision = self._decide_after_dwell(signals, current, scores, best, inputs, caps_by_k,
                                            parts)
        self._judge_probe(current, decision.k, backs_off=bool(signals.class_prior))
        return decision

    def _observed(self, signals: Signals, rates: list[float]) -> dict[str, float]:
        """A decision's inputs that score no tier: what the replica measured and estimates."""
        current = signals.current_k
        inputs = {"batch": float(self._batch(signals)),
                  "first_draft": rates[0], "draft_share": self.draft_share,
                  # The share of the current tier's slots the drafter is expected to fill.
                  "draft_fill": self.fill.verified(current) / current if current
                  else self.fill.share}
        if signals.drafting_sequence_steps:  # what the window just ran gave, beside the estimate
            inputs["tokens_measured"] = 1 + signals.accepted_tokens / \
                signals.drafting_sequence_steps
        if signals.step_costs:
            inputs["step_ms_measured"] = 1000 * float(np.mean(
                [cost.seconds for cost in signals.step_costs]))
        if signals.class_prior:
            inputs["class_hint"] = signals.class_prior[0]
        return inputs

    def _in_dwell(self, signals: Signals) -> bool:
        return self._steps_on_tier < self.config.min_dwell_steps and not signals.new_class

    def _most_tokens_at_k0(self, signals: Signals, rates: list[float]) -> float:
        """At K=0, the most tokens a sequence-step any tier could make for this batch when
        none of its requests landed a draft in its window: the most that the guesses the
        tiers would be scored by give (this replica's rates, the classes' hint, each
        request's class; see `most_tokens_without_landings`). Infinite elsewhere, and with
        `tpot_slo_ms`, whose bound can take K=0's own tokens out of its score."""
        if signals.current_k != 0 or self.config.tpot_slo_ms is not None or \
                signals.requests.accepted.any():
            return float("inf")
        return most_tokens_without_landings(
            [rates, signals.class_prior, *signals.request_priors], self.acceptance_width)

    def _hold_k0(self, signals: Signals, rates: list[float], most: float) -> Decision | None:
        """K=0 kept without scoring a tier, when drafts could buy at most the switch margin
        in tokens a sequence-step (`most`): a deeper tier's step never costs less than K=0's
        (see `StepCostModel`), so neither its score nor the classes' hint can beat K=0 by the
        margin, and the decision is K=0's whatever the scores. Traffic whose drafts do not
        land (sampled text) sits here, and scoring every tier twice (the tiers and the
        hint) at each of its decisions took most of the policy's CPU, on the cores the
        engines share (over HTTP, stop 69). None where the scored decision would do more
        than hold K=0: no cost data yet, or a probe due."""
        batch = self._batch(signals)
        if not self.costs.predict_row(batch, (self.fill.verified(0),)):
            return None
        inputs = {**self._observed(signals, rates), "most_tokens": most}
        if self._in_dwell(signals):
            return Decision(0, "dwell", inputs, {})
        if self._probe_due(signals, 0) is not None:
            return None
        self._judge_probe(0, 0, backs_off=bool(signals.class_prior))
        return Decision(0, f"drafts could buy at most {most - 1:.3f} tokens a sequence-step",
                        inputs, {})

    def _judge_probe(self, current: int, new: int, backs_off: bool) -> None:
        """After a probe's dwell: it found drafts landing if the policy goes deeper, or holds
        the probed tier for a probe interval; it found nothing if the policy leaves it sooner
        (a tier that only ties the one below is left within a few decisions). A fruitless
        probe lengthens the interval only where the backoff applies (`backs_off`: a class
        prior), so a replica that gains one later does not start at a long interval earned
        while the probe was its only eye on the traffic."""
        if self._probed is None:
            return
        tier, at = self._probed
        held = self._steps - at >= self.config.probe_interval_steps
        if current < tier:  # sent just now (or it never took effect)
            if new != tier:
                self._probed = None
        elif new > tier or held:
            self._probe_backoff, self._probed = 1, None
        elif new < tier:
            if backs_off:
                self._probe_backoff = min(2 * self._probe_backoff,
                                          self.config.max_probe_backoff)
            self._probed = None

    def _decide_after_dwell(self, signals: Signals, current: int, scores: dict[int, float],
                            best: int, inputs: dict[str, float],
                            caps_by_k: dict[int, dict[str, int]],
                            parts: dict[int, tuple[float, float]]) -> Decision:
        deeper = [k for k in self.candidates if k > current]
        expected = self._tier_the_classes_expect(signals, deeper) \
            if current == 0 and deeper else None
        if expected is not None:
            self._steps_on_tier = 0
            tier, caps = expected
            return Decision(tier, "probe: these request classes landed drafts before",
                            inputs, caps)
        probe = self._probe_due(signals, current)
        if probe is not None:
            self._steps_on_tier = 0
            self._probed = (probe, self._steps)
            # The probe's first window goes out uncapped, to measure the new positions (the
            # dwell decisions after it send the tier's caps again).
            return Decision(probe, "probe: measure the next tier's positions", inputs)
        if best != current and scores[best] > scores[current] * (1 + self.config.switch_margin):
            self._steps_on_tier = 0
            return Decision(best, f"goodput {scores[best]:.0f} > {scores[current]:.0f} tok/s",
                            inputs, caps_by_k.get(best))
        floor = self._floor(signals)
        if floor < current and scores[floor] * (1 + DRAFT_TIE) >= scores[current] and \
                self._buys_nothing(parts, current, floor) and \
                not self._idle_drafter(signals, current, floor):
            self._steps_on_tier = 0  # drafting must earn its margin; this tier buys nothing
            return Decision(floor, f"drafts at K={current} buy nothing over K={floor}",
                            inputs, caps_by_k.get(floor))
        return Decision(current, "current tier is within the margin of the best", inputs,
                        caps_by_k.get(current))

    def _probe_due(self, signals: Signals, current: int) -> int | None:
        """The next deeper tier, when its positions are due a probe: the policy has run
        `current` for the probe interval, nothing drafted them for as long, and no other
        replica measured them for these request classes just now."""
        deeper = [k for k in self.candidates if k > current]
        # The backoff only where request classes' past acceptance can bring the replica up
        # when the traffic changes (the class hint); without it the probe is the only way to
        # see a phase change (the cpu-demo transition replay, which has no classes, made 1568
        # tok/s backed off against 2390 without: 64 requests a phase, stop 41).
        interval = self.config.probe_interval_steps * \
            (self._probe_backoff if signals.class_prior else 1)
        if deeper and self._steps_on_tier >= interval and \
                self._steps - self._last_drafted[deeper[0] - 1] >= interval and \
                not self._fleet_measured(signals, deeper[0]):
            return deeper[0]
        return None

    def _buys_nothing(self, parts: dict[int, tuple[float, float]], tier: int, floor: int
                      ) -> bool:
        """Whether `tier`'s drafts buy less than the switch margin in tokens a sequence-step
        over `floor`'s. Only such a tier is left for a tie with the floor: a tier whose
        drafts do land and whose price ties it (a draft model on sampled text: K=1 lands
        0.27 a step at 1.1-1.3x K=0's step) ties on a price the app measures with tens of
        percent of jitter, and leaving it without the margin sent both replicas of the
        draft-model transition from K=1 to K=0 24 times in two rounds over HTTP, the price
        noise sending them back."""
        return parts[tier][0] <= parts[floor][0] * (1 + self.config.switch_margin)

    def _idle_drafter(self, signals: Signals, tier: int, floor: int) -> bool:
        """Whether `tier` verifies less than one draft per sequence a step (the drafter
        leaves its slots nearly all empty: prompt lookup on text without repeats) and is
        predicted to cost what `floor` does. Such a tier is not left for a tie: its steps are
        the floor's steps, and it keeps drafting where a match turns up, so a copy that
        starts lands at once (at K=0 it would first wait for a probe or a class hint). A
        tier that fills its slots and is measured as cheap as the floor is still left: its
        drafts are verified, and the measurement is a fast spell of the machine."""
        depth, floor_depth = self.fill.verified(tier), self.fill.verified(floor)
        if depth >= 1:
            return False
        seconds = self.costs.predict_row(self._batch(signals), (floor_depth, depth))
        return floor_depth in seconds and \
            seconds[depth] <= seconds[floor_depth] * (1 + DRAFT_TIE)

    def _floor(self, signals: Signals) -> int:
        """Where a tier whose drafts buy nothing goes without the margin: K=0, when the
        request classes' hint can bring the replica back once drafts would land again
        (K=0 drafts nothing, so measures nothing); else the smallest drafting tier."""
        if signals.class_prior:
            return self.candidates[0]
        return min((k for k in self.candidates if k > 0), default=self.candidates[0])

    def _fleet_measured(self, signals: Signals, tier: int) -> bool:
        """Whether other replicas measured `tier`'s positions for these request classes just
        now, and the prior built from them is in use: then a probe here would only repeat
        their measurement."""
        return signals.class_prior_fresh >= tier and \
            self.acceptance.uses_prior(signals.class_prior)

    def _tier_the_classes_expect(self, signals: Signals, deeper: list[int]
                                 ) -> tuple[int, dict[str, int]] | None:
        """At K=0: the tier that would win if drafts landed as these request classes' did
        before, when one would beat K=0 by the margin, with the draft caps the hint gives
        there. Straight there, not through the smallest tier: a high phase that starts while
        the replica runs K=0 lasts a few seconds, and each tier on the way costs a dwell
        (half a second at batch 8 on this machine). Checked only after a few dwells without
        drafting, so a hint that turns out wrong (the classes' statistics then fall) costs
        one dwell now and then. Scored as any decision is (each request by its own class
        where known, the batch's steady state), so a tier the hint picks is one the next
        decision keeps."""
        if not signals.class_prior or self._steps - self._last_drafted[0] < 4 * \
                self.config.min_dwell_steps:
            return None
        hint = extended_rates(signals.class_prior, self.acceptance_width)
        # `draft_share` describes the traffic before K=0 and may be stale: the hint alone.
        parts, caps_by_k = self._evaluate(signals, hint, share=1.0)
        # Against K=0 of the same evaluation: with `tpot_slo_ms` both then count the same
        # tokens (the fallback to every token may hold in one evaluation and not another).
        hinted = _scores(parts, self._batch(signals))
        best = max(deeper, key=lambda k: (hinted.get(k, -1.0), -k))
        if best not in hinted or 0 not in hinted or \
                hinted[best] <= hinted[0] * (1 + self.config.switch_margin):
            return None
        return best, caps_by_k[best]
