"""Policies: golden behaviour against the systems they follow, and properties that must hold."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from policies.acceptance import (
    PRIOR_PAUSE_UPDATES,
    AcceptanceWindow,
    BatchAcceptance,
    batch_acceptance,
    most_tokens_without_landings,
)
from policies.base import Policy
from policies.batch_table import lookup
from policies.ema import EmaConfig, EmaPolicy
from policies.goodput import GoodputConfig, GoodputPolicy
from policies.registry import POLICY_NAMES, build_policy
from policies.signals import (
    REQUEST_WINDOW,
    ClusterView,
    Decision,
    RequestAcceptance,
    RequestWindows,
    Signals,
    StepCost,
)
from policies.stability import StabilityConfig, StabilityPolicy, request_lengths
from policies.step_cost import DraftFill, StepCostModel

CANDIDATES = (0, 1, 3, 7, 15)


def steady_lengths(requests: RequestWindows, landing: list[float], prior_strength: float,
                   ks: tuple[int, ...], request_priors=()) -> dict[int, float] | None:
    """Tokens per sequence-step at each depth once the batch's mix has settled there, as
    `goodput` reads them (`BatchAcceptance.steady`, every request drafting K)."""
    batch = batch_acceptance(requests, landing, prior_strength, request_priors)
    return None if batch is None else dict(zip(ks, batch.steady(ks)[0].tolist(), strict=True))


def window(k: int, acceptance: float, batch: int = 4, steps: int = 4,
           cluster: ClusterView | None = None, proposing: float = 1.0) -> Signals:
    """Expected counts of a window where a share `proposing` of the sequence-steps propose
    drafts and each draft position lands with probability `acceptance` given the previous one
    landed (p[k] = acceptance ** (k + 1))."""
    drafts = round(batch * steps * proposing) if k else 0
    accepted = tuple(round(drafts * acceptance ** (pos + 1)) if pos < k else 0
                     for pos in range(15))
    drafted = tuple(drafts if pos < k else 0 for pos in range(15))
    return Signals(current_k=k, steps=steps, running=batch, waiting=0,
                   drafts=drafts, accepted_tokens=sum(accepted),
                   drafting_sequence_steps=batch * steps if k else 0,
                   slots_per_pos=tuple(batch * steps if pos < k else 0 for pos in range(15)),
                   accepted_per_pos=accepted, drafted_per_pos=drafted, cluster=cluster)


# ---- EMA: SGLang's worked thresholds with candidates [1, 3, 7] --------------------------------

def ema_slot(current: int, ema: float):
    policy = EmaPolicy(EmaConfig.model_validate({"1": [1, 3, 7], "warmup_batches": 0,
                                                 "update_interval": 1}), (1, 3, 7))
    slot = policy.slot_for(1)
    slot.current, slot.ema, slot.alpha = current, ema, 0.0  # freeze the EMA at `ema`
    slot.update(ema)
    return slot.current


@pytest.mark.parametrize(("current", "ema", "expected"), [
    (7, 2.25, 3), (7, 2.26, 7),      # 7 -> 3 at ema <= 2.25
    (3, 2.51, 7), (3, 2.5, 3),       # 3 -> 7 at ema > 2.5
    (1, 0.51, 3), (1, 0.5, 1),       # 1 -> 3 at ema > 0.5
    (7, 0.2, 1),                     # may drop several tiers at once
])
def test_ema_reproduces_sglang_thresholds(current, ema, expected):
    assert ema_slot(current, ema) == expected


def test_ema_probes_up_from_zero_and_waits_for_warmup():
    policy = EmaPolicy(EmaConfig.model_validate({"1": [0, 1, 3], "warmup_batches": 10,
                                                 "update_interval": 5}), CANDIDATES)
    slot = policy.slot_for(1)
    slot.current = 0
    decisions = [policy.decide(window(0, 0.0, batch=1, steps=1)).k for _ in range(10)]
    assert decisions == [0] * 10, "no switch during warm-up"
    decisions = [policy.decide(window(0, 0.0, batch=1, steps=1)).k for _ in range(5)]
    assert decisions[-1] == 1, "from 0 the policy always probes the next tier"


def test_ema_feeds_a_window_to_the_slot_whose_k_it_ran_at():
    """As SGLang routes each verified batch to its batch size's slot: steps run at the large
    batch's K=0 must not pull the small-batch slot's EMA down when the batch shrinks back."""
    policy = EmaPolicy(EmaConfig(concurrency_source="local"), CANDIDATES)
    small = policy.slot_for(2)
    small.current, small.ema, small.batches = 7, 6.0, 100
    assert policy.decide(window(7, 0.95, batch=2)).k == 7
    assert policy.decide(window(7, 0.95, batch=64)).k == 0, "SGLang's slot 64 holds K=0"
    ema_before = small.ema
    decision = policy.decide(window(0, 0.0, batch=2))
    assert small.ema == ema_before, "the K=0 steps fed the slot that chose K=0"
    assert decision.k == 7


def test_ema_averages_over_every_drafting_sequence_step():
    """SGLang's mean is over every request of the verified batch; a prompt-lookup sequence
    without a match accepts nothing, so rare well-accepted proposals do not lift the EMA."""
    policy = EmaPolicy(EmaConfig(concurrency_source="local"), CANDIDATES)
    slot = policy.slot_for(1)
    slot.current, slot.ema, slot.alpha = 7, 0.0, 1.0  # the EMA is the last batch's mean
    sparse = window(7, 0.9, batch=1, steps=16, proposing=0.25)
    policy.decide(sparse)
    per_step = sparse.accepted_tokens / sparse.drafting_sequence_steps
    assert slot.ema == pytest.approx(per_step)
    assert slot.ema < 0.5 * sparse.accepted_tokens / sparse.drafts


def test_ema_accepts_sglang_json_as_is():
    config = EmaConfig.model_validate(
        {"1": {"candidate_steps": [1, 3, 7], "down_hysteresis": -0.5}, "8": [0, 1],
         "ema_alpha": 0.3})
    assert config.slots[1].candidate_steps == [1, 3, 7]
    assert config.slots[1].down_hysteresis == -0.5
    assert config.slots[8].candidate_steps == [0, 1]
    assert config.ema_alpha == 0.3


@pytest.mark.parametrize("config", [
    {"1": {"candidate_steps": [1, 3], "update_interval": 0}},  # divided by zero at update
    {"1": {"candidate_steps": [1, 3], "ema_alpha": 5}},  # the EMA grows without bound
    {"1": {"candidate_steps": [1, 3], "ema_alpha": 0}},
    {"1": {"candidate_steps": [1, 3], "warmup_batches": -1}},
    {"1": {"candidate_steps": [1, 3], "ceiling_coeff": -1}},
    {"slots": {}},  # no slot serves any batch (IndexError at the first decision)
])
def test_ema_slot_overrides_are_held_to_the_global_limits(config):
    with pytest.raises(ValidationError):
        EmaConfig.model_validate(config)


# ---- batch_table: vLLM's schema and semantics ----------------------------------------------------

def test_batch_table_follows_vllm_lookup():
    rows = [(1, 16, 3), (32, 128, 2)]
    assert [lookup(rows, b) for b in (1, 16, 20, 31, 32, 500)] == [3, 3, 3, 3, 2, 2]


def test_effective_concurrency_counts_the_engine_now_and_requests_in_transit():
    """The engine's own counts come from the window's last step, not from the cluster view
    (a telemetry period old); the view adds only what is on its way here."""
    engine_now = Signals(**{**window(3, 0.8, batch=2).__dict__, "waiting": 1})
    assert engine_now.effective_concurrency == 3
    routed = Signals(**{**engine_now.__dict__, "cluster": ClusterView(in_transit=4)})
    assert routed.effective_concurrency == 7
    assert routed.local_batch == 2


def test_batch_table_effective_vs_local():
    config = {"name": "batch_table", "num_speculative_tokens_per_batch_size": [[1, 4, 7],
                                                                              [5, 64, 1]]}
    busy = ClusterView(in_transit=18)  # 2 running here, 18 on their way
    local = build_policy({**config, "concurrency_source": "local"}, CANDIDATES)
    effective = build_policy(config, CANDIDATES)
    assert local.decide(window(7, 0.9, batch=2, cluster=busy)).k == 7
    assert effective.decide(window(7, 0.9, batch=2, cluster=busy)).k == 1


@pytest.mark.parametrize("rows", [[[2, 4, 1]], [[1, 8, 3], [4, 9, 1]], []])
def test_batch_table_rejects_what_vllm_rejects(rows):
    with pytest.raises(ValueError):
        build_policy({"name": "batch_table", "num_speculative_tokens_per_batch_size": rows},
                     CANDIDATES)


# ---- goodput ------------------------------------------------------------------------------------

PROFILE = [(b, k, 0.007 + 0.001 * b + 0.00025 * k + 0.00005 * b * k)
           for b in (1, 8, 32) for k in CANDIDATES]


def goodput(**overrides) -> GoodputPolicy:
    """No dwell and no margin, so the answer does not depend on the path taken to it."""
    settings_ = {"profile": PROFILE, "min_dwell_steps": 0, "switch_margin": 0.0, **overrides}
    return GoodputPolicy(GoodputConfig(**settings_), CANDIDATES)


def settle(policy: GoodputPolicy, acceptance: float, batch: int, rounds: int = 30) -> int:
    k = 3
    for _ in range(rounds):
        k = policy.decide(window(k, acceptance, batch=batch)).k
    return k


@pytest.mark.parametrize("row", [(1, 0, 0.0), (1, 3, -0.01), (0, 1, 0.01), (1, -1, 0.01)])
def test_goodput_refuses_a_profile_row_it_could_not_divide_by(row):
    """A zero or negative step time, or no batch, would divide the tokens by nothing at the
    first step measured: the config is refused (a 400 at the admin route), not the replica."""
    with pytest.raises(ValueError):
        build_policy({"name": "goodput", "profile": [(1, 0, 0.002), row]}, CANDIDATES)


def test_goodput_speculates_deep_when_drafts_land_and_stops_when_they_miss():
    assert settle(goodput(), acceptance=1.0, batch=1) == 15
    assert settle(goodput(), acceptance=0.0, batch=8) == 0


def test_goodput_probes_again_after_a_long_stretch_at_zero():
    policy = goodput(probe_interval_steps=40)
    assert settle(policy, acceptance=0.0, batch=8, rounds=8) == 0
    ks = [policy.decide(window(0, 0.0, batch=8)).k for _ in range(12)]
    assert ks.count(1) == 1 and set(ks) == {0, 1}, "one probe of the smallest tier"


def probe_steps(policy: Policy, acceptance: float, decisions: int,
                signals_at: Callable[[int, float], Signals] | None = None) -> list[int]:
    """Engine steps (4 a decision) at which `policy`, held at K=0 on traffic whose drafts
    land with `acceptance`, sends a probe; `signals_at(k, acceptance)` is a decision's window
    (default: `window` at batch 8)."""
    signals_at = signals_at or (lambda k, acceptance: window(k, acceptance, batch=8))
    at, k = [], 0
    for decision in range(decisions):
        new = policy.decide(signals_at(k, acceptance)).k
        if new > k:
            at.append(4 * (decision + 1))
        k = new
    return at


def of_a_class_without_landing_drafts(k: int, acceptance: float) -> Signals:
    """`window` at batch 8, its requests of a class whose drafts landed at 2% before (so the
    class hint never brings the replica up from K=0)."""
    return Signals(**{**window(k, acceptance, batch=8).__dict__, "class_prior": (0.02,)})


def test_goodput_probes_less_often_while_probes_find_nothing():
    at = probe_steps(goodput(probe_interval_steps=40, max_probe_backoff=4), 0.0, 200,
                     of_a_class_without_landing_drafts)
    gaps = np.diff(at).tolist()
    # The first probe after one interval (40 steps), the next 80 later, then 160 (the cap),
    # each plus the probe's window at K=1 and the rounding to whole windows of 4 steps.
    assert len(gaps) >= 3 and at[0] < 2 * 40 < gaps[0] < 4 * 40 <= gaps[1] == gaps[-1]
    assert np.diff(probe_steps(goodput(probe_interval_steps=40, max_probe_backoff=1), 0.0, 200,
                               of_a_class_without_landing_drafts)).max() < 2 * 40, \
        "1 keeps the interval"
    # Without a class prior no hint brings the replica up when drafts land again: the probe
    # is the only way to see it, at every interval.
    assert np.diff(probe_steps(goodput(probe_interval_steps=40, max_probe_backoff=4),
                               0.0, 200)).max() < 2 * 40


def test_goodput_fruitless_probes_without_a_class_prior_earn_no_backoff_for_later():
    """Probes that found nothing while no class prior existed leave the interval as it was:
    once the requests bring a prior, the backoff starts from one interval."""
    policy = goodput(probe_interval_steps=40, max_probe_backoff=8)
    assert len(probe_steps(policy, 0.0, 200)) >= 4, "fruitless probes, no prior"
    at = probe_steps(policy, 0.0, 100, of_a_class_without_landing_drafts)
    assert at[0] < 2 * 40 + 8 and np.diff(at)[0] < 4 * 40


def test_goodput_probe_interval_comes_back_when_a_probe_finds_drafts_landing():
    policy = goodput(probe_interval_steps=40, max_probe_backoff=8)
    assert probe_steps(policy, 0.0, 150, of_a_class_without_landing_drafts)[-1] > \
        150 * 4 - 8 * 40 - 8, "still probing"
    k, decisions = 0, 0
    while k == 0:  # drafts land now: the next probe, at most 8 intervals on, finds them
        k = policy.decide(of_a_class_without_landing_drafts(k, 0.9)).k
        decisions += 1
    assert 4 * decisions <= 8 * 40 + 8
    for _ in range(10):
        k = policy.decide(of_a_class_without_landing_drafts(k, 0.9)).k
    assert k > 0, "the policy stays where the probe found drafts landing"
    assert np.diff(probe_steps(policy, 0.0, 100, of_a_class_without_landing_drafts)).min() \
        < 2 * 40, "the interval is back"


def test_goodput_probes_the_next_tier_when_nothing_measured_it():
    # Stuck at K=1 with mediocre first-position acceptance, the geometric extrapolation
    # never favours K=3; once an interval has passed it measures K=3, once.
    policy = goodput(probe_interval_steps=40, switch_margin=0.5)
    ks = [policy.decide(window(1, 0.55, batch=8)).k for _ in range(12)]
    assert ks.count(3) == 1 and ks[-1] == 1


def test_goodput_leaves_the_probe_to_the_fleet_when_it_just_measured_the_next_tier():
    """Another replica with these request classes measured K=3's positions within the last
    few telemetry periods: probing here would repeat it. Not when the class prior is set
    aside (this replica's first position contradicts it), nor when the evidence is older."""
    def ks(class_prior: tuple[float, ...], fresh: int) -> list[int]:
        policy = goodput(probe_interval_steps=40, switch_margin=0.5)
        signals = Signals(**{**window(1, 0.55, batch=8).__dict__, "class_prior": class_prior,
                             "class_prior_fresh": fresh})
        return [policy.decide(signals).k for _ in range(12)]

    like_here = (0.55, 0.3, 0.16)
    assert set(ks(like_here, fresh=3)) == {1}
    assert ks(like_here, fresh=1).count(3) == 1, "position 2 not measured lately: probe"
    assert ks((0.98, 0.95, 0.9), fresh=3).count(3) == 1, "a contradicted prior is no evidence"


def test_goodput_at_zero_goes_where_the_request_classes_landed_drafts_before():
    def at_zero(hint: tuple[float, ...]) -> list[int]:
        policy = goodput()
        settle(policy, acceptance=0.0, batch=8, rounds=8)  # to K=0, nothing drafted since
        signals = Signals(**{**window(0, 0.0, batch=8).__dict__, "class_prior": hint})
        return [policy.decide(signals).k for _ in range(10)]

    # Straight to the tier the classes' past acceptance makes best, not through K=1.
    assert at_zero((0.95,))[0] == 15, "greedy-copy classes arrived: deep at once"
    assert at_zero((0.6, 0.2))[0] == 3 and at_zero((0.4, 0.05))[0] == 1
    assert set(at_zero((0.01,))) == {0} and set(at_zero(())) == {0}


def without_landings(batch: int, drafts: int) -> RequestWindows:
    """`batch` requests whose last 30 steps each drafted `drafts` positions and landed none."""
    return RequestWindows.of([RequestAcceptance(f"r{i}", (0,) * 30, (drafts,) * 30)
                              for i in range(batch)])


@settings(max_examples=60, deadline=None)
@given(landing=st.lists(st.floats(0, 1), min_size=1, max_size=15),
       prior=st.lists(st.floats(0, 1), max_size=15), batch=st.integers(1, 8),
       drafts=st.integers(0, 15), prior_strength=st.sampled_from([0.0, 1.0, 4.0]))
def test_tokens_without_landings_never_exceed_the_guesses_bound(landing, prior, batch, drafts,
                                                                prior_strength):
    """No request that landed nothing can be priced above what its guess gives, at any
    depth and in any mix: the bound `goodput` holds K=0 by without scoring."""
    landing = sorted(landing, reverse=True) + [0.0] * (15 - len(landing))
    priors = tuple(tuple(prior) if i % 2 else () for i in range(batch))
    lengths = steady_lengths(without_landings(batch, drafts), landing, prior_strength,
                             CANDIDATES, priors)
    bound = most_tokens_without_landings([landing, *priors], 15)
    assert lengths is None or max(lengths.values()) <= bound + 1e-9


def of_sampled_requests(k: int, acceptance: float) -> Signals:
    """`of_a_class_without_landing_drafts` with the engine's per-request windows: eight
    requests of that class, none of which landed a draft."""
    return Signals(**{**of_a_class_without_landing_drafts(k, acceptance).__dict__,
                      "requests": without_landings(8, 0), "request_priors": ((0.02,),) * 8})


def test_goodput_holds_zero_without_scoring_where_drafts_cannot_pay():
    """At K=0, with no request landing a draft and every guess (the replica's rates, the
    classes' hint, each request's class) worth less than the switch margin in tokens, no tier
    can beat K=0 by the margin: the policy keeps K=0 without scoring a tier, and decides
    exactly as scoring would, probes included."""
    def run(scored: bool) -> list[Decision]:
        policy = goodput(switch_margin=0.05, probe_interval_steps=40, max_probe_backoff=4)
        if scored:  # the bound never holds: every decision is scored
            policy._most_tokens_at_k0 = lambda signals, rates: math.inf
        k, decisions = 0, []
        for _ in range(120):
            decisions.append(policy.decide(of_sampled_requests(k, 0.0)))
            k = decisions[-1].k
        return decisions

    held, scored = run(scored=False), run(scored=True)
    assert [d.k for d in held] == [d.k for d in scored]
    assert len({d.k for d in held}) > 1, "the probes still go out"
    holds = [d for d in held if d.reason.startswith("drafts could buy at most")]
    assert len(holds) > 60
    assert all("score_k3" not in d.inputs and d.inputs["most_tokens"] <= 1.05 for d in holds)
    # A request that landed a draft, or a class whose drafts landed, is scored as before.
    landed = RequestWindows.of([RequestAcceptance("r0", (0,) * 29 + (1,), (1,) * 30)])
    policy = goodput(switch_margin=0.05)
    signals = Signals(**{**of_sampled_requests(0, 0.0).__dict__, "requests": landed,
                         "request_priors": ((0.02,),)})
    assert "score_k1" in policy.decide(signals).inputs
    copy_class = Signals(**{**of_sampled_requests(0, 0.0).__dict__, "class_prior": (0.5,)})
    assert "score_k1" in goodput(switch_margin=0.05).decide(copy_class).inputs


def test_goodput_prices_unmeasured_positions_by_the_request_classes_not_the_fleet():
    """A chat-like replica (each position lands with 0.45 given the last) in a copy-heavy
    fleet: the fleet's prior prices the positions beyond K as copy traffic, so the policy
    tries deeper tiers than its traffic warrants; its requests' class prior settles it."""
    fleet = ClusterView(acceptance_prior=(0.7,) + (0.6,) * 14)
    chat = tuple(0.45 ** (k + 1) for k in range(15))

    def tiers(class_prior: tuple[float, ...]) -> list[int]:
        policy, k, ks = goodput(), 1, []
        for _ in range(20):
            signals = window(k, 0.45, batch=8, cluster=fleet)
            k = policy.decide(Signals(**{**signals.__dict__, "class_prior": class_prior})).k
            ks.append(k)
        return ks

    def switches(ks: list[int]) -> int:
        return sum(a != b for a, b in zip([1, *ks], ks, strict=False))

    misled = tiers(())
    assert switches(misled) >= 3 and max(misled) > 3, "the fleet's prior lures it deeper"
    settled = tiers(chat)
    assert switches(settled) == 1 and settled[-1] == 3


def test_goodput_counts_only_the_steps_that_proposed_drafts():
    """Prompt lookup proposes nothing without a match: drafts that land well but rarely are
    worth little, so a deep tier's gain over K=0 stays small where frequent proposals make it
    large."""
    frequent, rare = goodput(), goodput()
    assert settle(frequent, acceptance=0.9, batch=8) >= 7
    k = 3
    for _ in range(30):
        k = rare.decide(window(k, 0.9, batch=8, proposing=0.05)).k
    assert rare.draft_share == pytest.approx(2 / 32)  # 2 of 8 x 4 proposed
    rates = [0.9 ** (pos + 1) for pos in range(15)]
    gain = {policy: policy.scores(window(15, 0.9, batch=8), rates)
            for policy in (frequent, rare)}
    assert gain[rare][15] / gain[rare][0] < 1.5 < gain[frequent][15] / gain[frequent][0]


# Measured on this machine by an earlier run of bench.engine_bench (copy text, batch 8 and 32).
MEASURED = [(8, 0, 0.0124), (8, 1, 0.0161), (8, 3, 0.0180), (8, 7, 0.0209), (8, 15, 0.0203),
            (32, 0, 0.0235), (32, 1, 0.0294), (32, 3, 0.0429), (32, 7, 0.0604),
            (32, 15, 0.0512)]


def mixed_batch(copy: int, sampled: int, k: int = 3, steps: int = 30) -> RequestWindows:
    """Per-request windows at depth k: copy-like requests land every draft, sampled ones none."""
    return RequestWindows.of(
        [RequestAcceptance(f"c{i}", (k,) * steps, (k,) * steps) for i in range(copy)]
        + [RequestAcceptance(f"s{i}", (0,) * steps, (k,) * steps) for i in range(sampled)])


def test_request_windows_hold_each_requests_outcomes_right_aligned():
    requests = [RequestAcceptance("a", accepted=(1, 0, 3), drafted=(3, 3, 3)),
                RequestAcceptance("b", accepted=(2,), drafted=(7,)),
                RequestAcceptance("c", accepted=(), drafted=())]
    windows = RequestWindows.of(requests)
    assert list(windows) == requests
    assert windows.accepted.tolist() == [[1, 0, 3], [0, 0, 2], [0, 0, 0]]
    assert windows.drafted.tolist() == [[3, 3, 3], [0, 0, 7], [0, 0, 0]]
    drafted, accepted = RequestWindows.of(
        [RequestAcceptance("merged", accepted=(5, 2), drafted=(3, 20))]).clipped(15)
    assert drafted.tolist() == [[3, 15]] and accepted.tolist() == [[3, 2]]
    with pytest.raises(ValueError, match="lengths"):
        RequestWindows(("a",), np.zeros((1, 3), np.int64), np.zeros((1, 3), np.int64),
                       np.zeros(2, np.int64))


def test_steady_lengths_weigh_each_request_by_its_share_of_the_tokens():
    requests = mixed_batch(copy=8, sampled=24)
    landing = [0.25] * 15  # a quarter of the sequence-steps land every draft
    lengths = steady_lengths(requests, landing, 4.0, CANDIDATES)
    assert lengths[3] == pytest.approx((8 * 4 + 24) / 32, rel=0.05)  # the batch as it is
    # Copy-like requests hold 4/7 of the tokens; at K=15 they would make about 14.7 a step.
    # A sampled one landed its first draft in none of 30 steps: its first position is shrunk
    # to 1 / 34 and its deeper ones, which no step reached, keep the replica's conditional
    # rates (1 here: a quarter of the steps land every draft), so about 1.44 a step. About 3
    # tokens per sequence-step, not the 4.75 that the batch's mean (1 + 15 x 0.25) promises.
    sampled = 1 + 15 * (4 * 0.25) / (30 + 4)
    assert lengths[15] == pytest.approx(1 / ((3 / 7) / sampled + (4 / 7) / 14.7), rel=0.05)
    assert steady_lengths(mixed_batch(0, 4, k=0), landing, 4.0, CANDIDATES) is None


def test_steady_lengths_count_a_step_only_at_the_positions_it_reached():
    """A step is evidence about the positions it reached. vLLM's first steps after a prefill
    draft nothing: a copy request two steps old has two outcomes of 0 of 15, which lower its
    first position and leave its class's conditional rates past it. Counted at every position,
    the same shrinkage compounded: the request was priced at 2.75 tokens a step at K=15
    against 8.4 here, and the replica left K=15 for K=3 at the start of every copy request.
    A step that landed all of its K drafts says nothing about position K either."""
    copy_class = tuple(0.96 * 0.97 ** k for k in range(15))  # conditionals 0.96, 0.97, ...

    def priced(accepted: tuple[int, ...], drafted: tuple[int, ...]) -> dict[int, float]:
        request = RequestWindows.of([RequestAcceptance("c", accepted, drafted)])
        return steady_lengths(request, [0.5] * 15, 4.0, CANDIDATES, [copy_class])

    def lengths(conditionals: list[float]) -> dict[int, float]:
        return {k: 1 + sum(np.prod(conditionals[:j + 1]) for j in range(k)) for k in CANDIDATES}

    first = 4 * 0.96 / (2 + 4)
    assert priced((0, 0), (15, 15)) == pytest.approx(lengths([first] + [0.97] * 14))
    assert priced((0, 0), (15, 15))[15] > 8
    landed_all = (4 + 4 * 0.97) / (4 + 4)  # positions 1 and 2: 4 of 4 steps, shrunk
    assert priced((3,) * 4, (3,) * 4) == pytest.approx(
        lengths([(4 + 4 * 0.96) / 8, landed_all, landed_all] + [0.97] * 12))


def test_goodput_does_not_go_deep_on_a_mixed_batch_whose_copy_requests_would_leave():
    """Half copy, half sampled requests at batch 32 (the HTTP sweep at concurrency 64): at K=3
    a quarter of the slots hold copy requests. K=15 looks 2x better on the batch as it is,
    but at K=15 the copy requests finish 4x faster and sampled ones fill their slots. With
    the requests' classes known (the app's ingress tags each one), the steady state with
    these step costs is K=3."""
    def decide(requests: RequestWindows, priors: tuple[tuple[float, ...], ...] = ()) -> int:
        policy = goodput(profile=MEASURED)
        signals = window(3, 1.0, batch=32, proposing=0.25)
        return policy.decide(Signals(**{**signals.__dict__, "requests": requests,
                                        "request_priors": priors})).k

    copy_class = tuple(0.97 ** (k + 1) for k in range(15))
    sampled_class = tuple(0.03 * 0.2 ** k for k in range(15))
    mixed = mixed_batch(copy=8, sampled=24)
    assert decide(RequestWindows()) == 15  # without per-request outcomes: the batch's mean
    # Classes unknown: the sampled requests' deeper positions, which none of their steps
    # reached, borrow the replica's conditional rates (the copy requests'), yet not K=15.
    assert decide(mixed) < 15
    assert decide(mixed, (copy_class,) * 8 + (sampled_class,) * 24) in (1, 3)
    assert decide(mixed_batch(copy=32, sampled=0)) == 15  # a uniform batch still goes deep


def test_goodput_prices_requests_without_any_outcome_by_their_class():
    """Just admitted, no step run (the replica's engine reports no windows at all): each
    request is priced by its class, so a replica holding only such requests takes the tier
    their classes want before their first step."""
    copy_class = tuple(0.97 ** (k + 1) for k in range(15))
    sampled_class = tuple(0.03 * 0.2 ** k for k in range(15))

    def decide(current: int, prior: tuple[float, ...]) -> int:
        policy = goodput(profile=MEASURED)
        signals = window(current, 0.9, batch=8)
        return policy.decide(Signals(**{
            **signals.__dict__, "requests": RequestWindows().with_new(["a", "b"]),
            "request_priors": (prior, prior)})).k

    assert decide(15, sampled_class) == 0
    assert decide(0, copy_class) == 15


def test_a_request_without_outcomes_weighs_in_a_busy_batch_as_a_request_of_its_class():
    """Four copy requests at K=15 with 30 steps of outcomes each, and a sampled request just
    taken: it weighs as a request that ran 30 steps at its class's acceptance length, so the
    batch's steady tokens a step at K=15 fall towards the sampled request's (it keeps its
    slot for many more steps than a copy request keeps one)."""
    copy_class = tuple(0.97 ** (k + 1) for k in range(15))
    sampled_class = tuple(0.03 * 0.2 ** k for k in range(15))
    copies = mixed_batch(copy=4, sampled=0, k=15)
    landing = [0.9] * 15

    def steady_at_15(requests: RequestWindows, priors: tuple[tuple[float, ...], ...]) -> float:
        batch = batch_acceptance(requests, landing, 4.0, priors, depth=15)
        return float(batch.steady((15,))[0][0])

    alone = steady_at_15(copies, (copy_class,) * 4)
    with_new = copies.with_new(["new"])
    batch = batch_acceptance(with_new, landing, 4.0, (copy_class,) * 4 + (sampled_class,), 15)
    assert batch.tokens[-1] == pytest.approx(30 * batch.lengths[15, -1])
    # It holds a fifth of the slots: about 4 x 30 copy steps and its 30 (was 0 weight, alone).
    assert steady_at_15(with_new, (copy_class,) * 4 + (sampled_class,)) < 0.85 * alone


def test_goodput_reports_what_the_window_measured_beside_its_estimates():
    """A decision's inputs carry the tokens per sequence-step and the step time the window
    just run gave, beside the estimates for the same tier, and every tier's score and
    tokens: a decision log then shows how far the estimate was off, and how near the other
    tiers came. A window at K=0 drafted nothing, so it measures no tokens."""
    policy = goodput()
    signals = window(3, 0.5, batch=4)
    step_costs = (StepCost(4, 3, 0.010), StepCost(4, 3, 0.014))
    decision = policy.decide(Signals(**{**signals.__dict__, "step_costs": step_costs}))
    expected_tokens = 1 + signals.accepted_tokens / signals.drafting_sequence_steps
    assert decision.inputs["tokens_measured"] == pytest.approx(expected_tokens)
    assert 1.5 < expected_tokens < 2.0  # 0.5 + 0.25 + 0.125 drafts land a step
    assert decision.inputs["step_ms_measured"] == pytest.approx(12.0)
    at_zero = policy.decide(window(0, 0.5, batch=4))
    assert "tokens_measured" not in at_zero.inputs and "step_ms_measured" not in at_zero.inputs
    # Every tier's score and tokens, so a log shows how near the tiers not taken came, and
    # whether by their tokens or by their price.
    tier_scores = {k: decision.inputs[f"score_k{k}"] for k in policy.candidates}
    assert max(tier_scores.values()) == pytest.approx(decision.inputs["score_best"])
    assert tier_scores[3] == pytest.approx(decision.inputs["score_current"])
    tier_tokens = {k: decision.inputs[f"tokens_k{k}"] for k in policy.candidates}
    assert tier_tokens[3] == pytest.approx(decision.inputs["tokens_current"])
    assert tier_tokens[0] == 1.0 and tier_tokens[1] < tier_tokens[3] < tier_tokens[15]


def test_goodput_caps_the_failing_requests_drafts_and_goes_deep_for_the_copies():
    """The same mixed batch on an engine that caps drafts per request: the sampled requests
    verify one draft a step (their evidence), the copy requests draft K, and K goes deep,
    where one K for all had to stay shallow. A copy-only batch is left uncapped, and an
    engine without caps gets none."""
    copy_class = tuple(0.97 ** (k + 1) for k in range(15))
    sampled_class = tuple(0.03 * 0.2 ** k for k in range(15))

    def decide(requests: RequestWindows, priors: tuple[tuple[float, ...], ...],
               caps_apply: bool = True) -> Decision:
        policy = goodput(profile=MEASURED)
        signals = window(3, 1.0, batch=32, proposing=0.25)
        return policy.decide(Signals(**{**signals.__dict__, "requests": requests,
                                        "request_priors": priors,
                                        "draft_caps_apply": caps_apply}))

    mixed = mixed_batch(copy=8, sampled=24)
    priors = (copy_class,) * 8 + (sampled_class,) * 24
    capped = decide(mixed, priors)
    assert capped.k == 15
    assert capped.draft_caps == {f"s{i}": 1 for i in range(24)}
    assert capped.inputs["capped_requests"] == 24
    uncapped = decide(mixed, priors, caps_apply=False)
    assert uncapped.k in (1, 3) and not uncapped.draft_caps
    copies = decide(mixed_batch(copy=32, sampled=0), (copy_class,) * 32)
    assert copies.k == 15 and copies.draft_caps == {}


def test_goodput_with_a_tpot_bound_counts_only_the_tokens_within_it():
    """`tpot_slo_ms`. The capped mixed batch above goes to K=15: the copy requests' tokens
    pay for steps of 27 ms, in which each sampled request gains about one token. With a 25.5 ms
    bound on time per output token those steps lose the 24 sampled requests, and K=1 (25 ms
    steps) keeps them all. At 20 ms no tier keeps a sampled request within the bound, so
    none is given up for them: K=15 again. At 1 ms no tier keeps any request within it, and
    every token counts again."""
    copy_class = tuple(0.97 ** (k + 1) for k in range(15))
    sampled_class = tuple(0.03 * 0.2 ** k for k in range(15))

    def decide(tpot_slo_ms: float | None, current: int = 3, margin: float = 0.0) -> Decision:
        policy = goodput(profile=MEASURED, tpot_slo_ms=tpot_slo_ms, switch_margin=margin)
        signals = window(current, 1.0, batch=32, proposing=0.25)
        return policy.decide(Signals(**{
            **signals.__dict__, "requests": mixed_batch(copy=8, sampled=24, k=current),
            "request_priors": (copy_class,) * 8 + (sampled_class,) * 24,
            "draft_caps_apply": True}))

    unbounded = decide(None)
    assert unbounded.k == 15 and unbounded.inputs["step_ms_best"] > 25
    within = decide(25.5)
    assert within.k == 1 and within.inputs["step_ms_best"] <= 25.5
    assert decide(20).k == 15
    tight = decide(1)
    assert (tight.k, tight.inputs["score_best"]) == (15, unbounded.inputs["score_best"])
    # With a 5% switch margin the bound is 5% looser on the tier the replica runs and 5%
    # tighter on the others: at 24 ms, K=1's 25 ms steps keep the sampled requests for a
    # replica already on K=1, not for one on K=3.
    assert decide(24, current=1, margin=0.05).k == 1
    assert decide(24, current=3, margin=0.05).k == 15


def test_a_capped_request_that_lands_every_draft_gets_twice_as_many():
    """A request capped at one draft by a stale guess shows what lies past its cap only by
    drafting past it: each step that lands all its drafts doubles its cap."""
    landing = [0.3 * 0.1 ** k for k in range(15)]  # the replica's traffic before: short runs
    copying = RequestWindows.of([RequestAcceptance("c", (1,) * 6, (1,) * 6),
                                 RequestAcceptance("s", (0,) * 6, (1,) * 6)])
    batch = batch_acceptance(copying, landing, 4.0)
    assert batch.caps(0.5, 1).tolist() == [2, 1]


def test_cap_sets_scored_together_match_each_set_scored_alone():
    """`goodput` scores its cap sets (one per threshold) in one pass: each set's tokens per
    sequence-step and drafts per sequence must be what scoring that set alone gives."""
    rng = np.random.default_rng(3)
    drafted = rng.integers(1, 8, (6, 30))
    landed = np.minimum(drafted, rng.geometric(0.35, (6, 30)) - 1)
    requests = RequestWindows(tuple(f"r{i}" for i in range(6)), landed, drafted,
                              np.full(6, 30))
    batch = batch_acceptance(requests, [0.6 * 0.8 ** k for k in range(15)], 4.0)
    fill = DraftFill(15, decay=0.7)
    fill.update([round(1000 * (1 - k / 20)) for k in range(15)], [1000] * 15)
    thresholds = (0.2, 0.4, 0.6, 0.8)
    sets = batch.caps(np.array(thresholds), 1)
    assert sets.shape == (4, 6) and len({tuple(caps) for caps in sets.tolist()}) > 1
    per_step, per_sequence = batch.steady(CANDIDATES, sets, fill.verified_each)
    for row, threshold in enumerate(thresholds):
        caps = batch.caps(threshold, 1)
        assert caps.tolist() == sets[row].tolist()
        alone_step, alone_sequence = batch.steady(CANDIDATES, caps, fill.verified_each)
        assert per_step[row].tolist() == pytest.approx(alone_step.tolist())
        assert per_sequence[row].tolist() == pytest.approx(alone_sequence.tolist())


def test_steady_lengths_price_a_request_without_outcomes_by_its_class():
    """A phase change: the replica's rates still describe copy traffic, and the requests now
    running are sampled ones that have barely drafted. Priced by the replica's rates they
    promise a deep K; priced by their class (which lands nothing) they do not."""
    just_arrived = RequestWindows.of(
        [RequestAcceptance(f"s{i}", (0,), (15,)) for i in range(8)])
    copy_like = [0.95 ** (k + 1) for k in range(15)]
    by_replica = steady_lengths(just_arrived, copy_like, 4.0, CANDIDATES)
    by_class = steady_lengths(just_arrived, copy_like, 4.0, CANDIDATES, [(0.01, 0.0)] * 8)
    assert by_replica[15] > 4
    assert by_class[15] == pytest.approx(1.0, abs=0.01)
    # A request whose class is unknown keeps the replica's guess; the known ones their own.
    mixed = steady_lengths(just_arrived, copy_like, 4.0, CANDIDATES,
                           [(0.01, 0.0)] * 7 + [()])
    assert by_class[15] < mixed[15] < by_replica[15]
    # Nothing drafted yet: the class priors alone say what each depth would give.
    waiting = RequestWindows.of([RequestAcceptance(f"g{i}", (0,), (0,)) for i in range(4)])
    assert steady_lengths(waiting, [0.0] * 15, 4.0, CANDIDATES) is None
    assert steady_lengths(waiting, [0.0] * 15, 4.0, CANDIDATES,
                          [(0.9,)] * 4)[3] == pytest.approx(1 + 0.9 + 0.81 + 0.729)


def test_goodput_leaves_a_deep_tier_at_once_when_the_new_requests_class_lands_nothing():
    """From a copy phase at K=15 into a sampled phase: one decision, straight to K=0, when
    the requests' class is known; the replica's own rates alone keep it deep meanwhile."""
    def first_k(request_priors: tuple[tuple[float, ...], ...]) -> int:
        policy = goodput()
        assert settle(policy, acceptance=0.98, batch=8) == 15
        sampled = RequestWindows.of(
            [RequestAcceptance(f"s{i}", (0,), (15,)) for i in range(8)])
        signals = window(15, 0.98, batch=8, proposing=0.05)  # few proposals: no shift seen
        return policy.decide(Signals(**{**signals.__dict__, "requests": sampled,
                                        "request_priors": request_priors})).k

    assert first_k(((0.0,),) * 8) == 0
    assert first_k(()) >= 7


def test_goodput_hint_at_zero_scores_a_mixed_batch_by_its_steady_state():
    """At K=0 with half greedy-copy and half sampled requests, the classes' mean promises a
    deep tier, but the copy requests would leave and sampled ones take their slots: the hint
    must not send the replica where its next decision would not keep it."""
    def at_zero(request_priors: tuple[tuple[float, ...], ...]) -> list[int]:
        policy = goodput(profile=MEASURED)
        settle(policy, acceptance=0.0, batch=32, rounds=8)
        requests = RequestWindows.of(
            [RequestAcceptance(f"r{i}", (0,) * 30, (0,) * 30) for i in range(32)])
        mean = tuple(sum(p[k] for p in request_priors) / len(request_priors)
                     for k in range(15))
        signals = Signals(**{**window(0, 0.0, batch=32).__dict__, "requests": requests,
                             "class_prior": mean, "request_priors": request_priors})
        return [policy.decide(signals).k for _ in range(6)]

    copy_class = tuple(0.98 ** (k + 1) for k in range(15))
    sampled_class = (0.0,) * 15
    assert at_zero((copy_class,) * 32)[0] == 15, "all copy: deep at once"
    assert max(at_zero((copy_class,) * 16 + (sampled_class,) * 16)) <= 3


def test_step_costs_scale_the_profile_to_the_measured_level():
    """In the app a step costs more than the engine alone; a tier not yet measured must not
    look cheap for that reason alone (the policy would cycle through the unmeasured ones)."""
    costs = StepCostModel(decay=0.98)
    for row in MEASURED:
        costs.seed(StepCost(*row))
    for _ in range(60):  # the app's K=1 steps at batch 32 take twice the profile's
        costs.observe(StepCost(32, 1, 2 * 0.0294))
    assert costs.level == pytest.approx(2.0, rel=0.05)
    assert costs.predict(32, 1) == pytest.approx(2 * 0.0294, rel=0.05)
    assert costs.predict(32, 0) == pytest.approx(2 * 0.0235, rel=0.05)
    assert costs.predict(8, 7) == pytest.approx(2 * 0.0209, rel=0.05)
    unprofiled = StepCostModel(decay=0.98)
    unprofiled.observe(StepCost(8, 3, 0.05))
    assert unprofiled.level == 1.0 and unprofiled.predict(8, 3) == pytest.approx(0.05)


def test_step_costs_price_every_tier_at_the_level_the_machine_runs_now():
    """The machine's speed moves within seconds and a tier is measured only while it runs:
    a tier measured in a calm spell must not look cheap beside one measured now. Every tier
    follows the level its running tier measures; the profile's shape stays between them."""
    profile = [(8, 3, 0.0071), (8, 7, 0.0097), (8, 15, 0.0150)]
    costs = StepCostModel(decay=0.98)
    for row in profile:
        costs.seed(StepCost(*row))
    for seconds in (0.0160, 0.0240):  # K=3 runs on, the machine gets busier
        for _ in range(60):
            costs.observe(StepCost(8, 3, seconds))
        assert costs.predict(8, 3) == pytest.approx(seconds, rel=0.03)
        assert costs.predict(8, 7) == pytest.approx(seconds * 97 / 71, rel=0.03)
        assert costs.predict(8, 15) == pytest.approx(seconds * 150 / 71, rel=0.03)
    for _ in range(150):  # K=7 measures 1.22x what the profile's shape says
        costs.observe(StepCost(8, 7, 0.0400))
    assert costs.predict(8, 7) == pytest.approx(0.0400, rel=0.03), "priced at what it measures"


def test_a_profiled_shape_moves_on_evidence_from_many_switches_not_on_one_spell():
    """A switch that meets a slow spell of the machine shows the new tier dearer than its
    shape until the level catches up: one such switch must not rewrite the profile's ratio
    between the tiers (a point worth a few steps kept it, and over HTTP K=1 was priced at
    1.0-4.1x K=0's step from decision to decision). A ratio the app's steps show switch
    after switch is learned."""
    profile = [(8, 3, 0.0071), (8, 7, 0.0097), (8, 15, 0.0150)]
    shaped = 97 / 71

    def ratio_after(stints: list[tuple[int, float]], steps: int) -> float:
        costs = StepCostModel(decay=0.99)
        for row in profile:
            costs.seed(StepCost(*row))
        for depth, seconds in stints:
            for _ in range(steps):
                costs.observe(StepCost(8, depth, seconds))
        return costs.predict(8, 7) / costs.predict(8, 3)

    # K=3 at 16 ms, then K=7 as the machine slows to 1.5x its speed, then K=3 again.
    spell = [(3, 0.016), (7, 0.016 * shaped * 1.5), (3, 0.016 * 1.5)]
    assert ratio_after(spell, steps=60) == pytest.approx(shaped, rel=0.05)
    # K=7 costs 1.22x the profile's ratio on every visit.
    dearer = [(3, 0.016), (7, 0.016 * shaped * 1.22)] * 40
    assert ratio_after(dearer, steps=30) > shaped * 1.11, "at least halfway there"


def test_a_deeper_depth_costs_at_least_the_profiles_ratio_more_than_a_shallower_one():
    """A deep tier that measured as cheap as a shallower one (by luck, or a fast spell) must
    not win on its tokens: at a batch size it is priced at least at the shallower one's
    price times the profile's ratio between them. The tier running is still priced at what
    it measures; without a profile the floor is the shallower price itself."""
    profile = [(8, 3, 0.0071), (8, 7, 0.0097), (8, 15, 0.0150)]
    costs, unprofiled = StepCostModel(decay=0.98), StepCostModel(decay=0.98)
    for row in profile:
        costs.seed(StepCost(*row))
    for model in (costs, unprofiled):
        for _ in range(60):
            model.observe(StepCost(8, 3, 0.0160))
        for _ in range(100):  # K=7 measured no dearer than K=3
            model.observe(StepCost(8, 7, 0.0160))
    assert costs.predict(8, 7) == pytest.approx(0.0160, rel=0.03)
    assert costs.predict(8, 7) >= costs.predict(8, 3) * 97 / 71 * 0.999
    assert costs.predict(8, 15) >= costs.predict(8, 7) * 150 / 97 * 0.999
    assert costs.predict(8, 5) == pytest.approx((costs.predict(8, 3) + costs.predict(8, 7))
                                                / 2), "between known depths: linear"
    assert unprofiled.predict(8, 7) == pytest.approx(unprofiled.predict(8, 3)), \
        "no shape to keep: only never cheaper"


def test_goodput_reports_the_step_costs_it_learned_as_a_profile_to_start_from():
    """One complete profile at the measured level: the points this replica measured from
    enough steps to hold more than their jitter, and the seeded points it did not measure
    scaled to that level; a point measured from fewer steps is left out. The rows seed a new
    policy that predicts what this one measured."""
    policy = goodput(profile=MEASURED)
    assert policy.learned_profile() == [tuple(row) for row in MEASURED], \
        "nothing measured yet: the seed as it is"
    # Each measured point starts from the profile's prediction, which fades as steps come in;
    # the app's steps cost twice the profile's.
    steps = [StepCost(8, 3, 2 * 0.0180)] * 150 + [StepCost(8, 0, 2 * 0.0124)] * 150 + \
        [StepCost(32, 1, 2 * 0.0294)] * 17  # fewer steps than a report needs
    for cost in steps:
        policy.costs.observe(cost)
    rows = {(batch, k): seconds for batch, k, seconds in policy.learned_profile()}
    assert (32, 1) not in rows
    assert set(rows) == {(batch, k) for batch, k, _ in MEASURED} - {(32, 1)}
    assert [rows[8, 0], rows[8, 3]] == pytest.approx([2 * 0.0124, 2 * 0.0180], rel=0.03)
    assert rows[32, 7] == pytest.approx(2 * 0.0604, rel=0.05), "a seeded point, scaled"
    started = goodput(profile=list(policy.learned_profile()))
    assert started.costs.predict(8, 3) == pytest.approx(2 * 0.0180, rel=0.03)
    assert started.costs.predict(32, 7) == pytest.approx(2 * 0.0604, rel=0.05)


def test_goodput_prices_a_tier_by_the_drafts_it_verifies():
    """Prompt lookup on text without repeats proposes on few sequence-steps, so a deep tier
    verifies few drafts and costs little more than K=0 (engine bench, free text at batch 1:
    K=15 7.8 ms, K=0 8.5 ms). Priced at its full depth, as the copy profile has it, such a
    tier loses to K=0 although its drafts land when proposed."""
    sparse = goodput(profile=MEASURED)
    observed = window(15, 0.9, batch=32, proposing=0.1)
    sparse.decide(observed)
    full = goodput(profile=MEASURED)  # the same outcomes, every slot filled (a draft model)
    full.decide(Signals(**{**observed.__dict__, "slots_per_pos": observed.drafted_per_pos}))
    assert sparse.fill.share == pytest.approx(0.1, abs=0.01) and full.fill.share == 1.0
    rates = sparse.acceptance.rates(())
    priced_sparse, priced_full = sparse.scores(observed, rates), full.scores(observed, rates)
    assert priced_sparse[0] == priced_full[0]
    assert priced_sparse[15] > priced_sparse[0] > priced_full[15]
    depth = sparse.fill.verified(15)
    assert depth == pytest.approx(15 * sparse.fill.share, rel=0.05)
    assert priced_sparse[15] / priced_full[15] == pytest.approx(
        sparse.costs.predict(32, 15) / sparse.costs.predict(32, depth))


def test_draft_fill_prices_each_position_by_how_full_the_drafter_kept_it():
    """Prompt lookup on a copy fills the first positions and fewer deep ones (a match runs
    out). K=7 verifies what the first 7 positions were filled with, not 7 times the share
    over all 15: that priced K=7 a quarter below its drafts, and it won by looking cheap."""
    fill = DraftFill(15, decay=0.7)
    assert fill.verified(7) == 7.0 and fill.share == 1.0, "unmeasured: every slot full"
    shares = [1 - k / 20 for k in range(15)]
    fill.update([round(1000 * share) for share in shares], [1000] * 15)
    assert fill.verified(7) == pytest.approx(sum(shares[:7]), rel=0.01)
    assert fill.verified(15) == pytest.approx(sum(shares), rel=0.01)
    assert fill.verified(7) > 1.2 * 7 * fill.share
    assert fill.verified(0.5) == pytest.approx(0.5 * shares[0], rel=0.01)
    shallow = DraftFill(15, decay=0.7)
    shallow.update([96] + [0] * 14, [100] + [0] * 14)  # K=1: only position 0 measured
    assert shallow.verified(15) == pytest.approx(15 * 0.96, rel=0.01), "deeper ones continue it"
    lone = DraftFill(15, decay=0.7)
    lone.update([1] + [0] * 14, [1, 1] + [0] * 13)  # one K=2 step that proposed one token
    assert lone.verified(15) > 0.75 * 15, "one empty slot does not empty every deeper position"


def test_draft_fill_forgets_deep_positions_the_tiers_no_longer_reach():
    """Sparse deep positions measured at K=15 on sampled text, then a copy at K=1: the deep
    positions move, window by window, to continue the fresh first position, instead of
    keeping the old traffic's emptiness until their counts run out and then jumping."""
    fill = DraftFill(15, decay=0.7)
    fill.update([7] * 15, [100] * 15)
    priced = [fill.verified(15)]
    for _ in range(30):
        fill.update([15] + [0] * 14, [16] + [0] * 14)
        priced.append(fill.verified(15))
    assert priced[-1] == pytest.approx(15 * 15 / 16, rel=0.02)
    steps = np.diff(priced)
    assert (steps >= 0).all() and steps.max() < 3, "no jump"


def test_capped_requests_are_priced_by_their_own_depths():
    """Half the batch capped at one draft, half drafting 15, on a copy whose deep positions
    prompt lookup fills less: the step verifies the mean of each request's drafts, not the
    drafts of the mean depth (8), which would overcharge the capped mix."""
    fill = DraftFill(15, decay=0.7)
    fill.update([round(1000 * (1 - k / 20)) for k in range(15)], [1000] * 15)
    nothing_lands = BatchAcceptance(reach=np.zeros((15, 2)), lengths=np.ones((16, 2)),
                                    tokens=np.ones(2), full_runs=np.zeros(2))
    _, drafts = nothing_lands.steady((15,), np.array([1, 15]), fill.verified_each)
    assert drafts[0] == pytest.approx((fill.verified(1) + fill.verified(15)) / 2)
    assert drafts[0] < 0.85 * fill.verified(8)
    _, unmapped = nothing_lands.steady((15,), np.array([1, 15]))
    assert unmapped[0] == 8.0


def test_goodput_prices_the_batch_the_engine_can_run():
    """Demand beyond the engine's max batch waits; it adds no verify work to price."""
    backlog = Signals(**{**window(3, 0.8, batch=8).__dict__, "max_batch": 8,
                         "cluster": ClusterView(in_transit=192)})
    at_limit = Signals(**{**window(3, 0.8, batch=8).__dict__,
                          "cluster": ClusterView()})
    assert backlog.verify_batch(backlog.effective_concurrency) == 8
    assert goodput().scores(backlog, [0.8] * 15) == goodput().scores(at_limit, [0.8] * 15)


def test_goodput_restarts_its_estimate_when_the_traffic_shifts():
    """A low-acceptance stretch, then high-acceptance traffic while the fleet's prior still
    describes the old one: the estimate restarts and a deep tier wins at the first decision;
    decaying towards the new traffic instead stays shallow."""
    stale = ClusterView(acceptance_prior=(0.05,) * 15)

    def first_decision_of_the_new_phase(**overrides) -> int:
        policy, k = goodput(**overrides), 1
        for _ in range(20):
            k = policy.decide(window(k, 0.1, batch=8, cluster=stale)).k
        assert k == 1
        return policy.decide(window(k, 0.95, batch=8, cluster=stale)).k

    assert first_decision_of_the_new_phase() >= 7
    assert first_decision_of_the_new_phase(shift_threshold=1.0) <= 3


def test_the_prior_set_aside_at_a_shift_comes_back_after_a_few_decisions_at_k0():
    """A shift sets the fleet's prior aside for `PRIOR_PAUSE_UPDATES` decisions (its counts
    lag the same change). A replica that goes to K=0 after the shift drafts nothing, and its
    decisions still count: it takes the prior back after as many, not never."""
    acceptance = AcceptanceWindow(15, decay=0.7, prior_strength=4.0, shift_threshold=0.3)
    prior = (0.9,) * 15
    acceptance.update((2,) + (0,) * 14, (20,) + (0,) * 14)  # 0.1 lands
    acceptance.update((19,) + (0,) * 14, (20,) + (0,) * 14)  # 0.95: a shift
    assert not acceptance.uses_prior(prior)
    nothing = (0,) * 15
    for _ in range(PRIOR_PAUSE_UPDATES - 1):
        acceptance.update(nothing, nothing)
    assert not acceptance.uses_prior(prior)
    acceptance.update(nothing, nothing)
    assert acceptance.uses_prior(prior)


def test_goodput_sets_aside_a_prior_its_own_first_position_contradicts():
    """Prompt lookup on sampled text rarely proposes, so a low phase leaves too little history
    to call a shift; the fleet prior still says deep drafts fail. Once this replica measures
    its first position landing at 0.95, the prior no longer describes its traffic."""
    stale = ClusterView(acceptance_prior=(0.05,) * 15)
    # Tiers from K=1 up (a deployment that always drafts): the low stretch keeps it at K=1.
    policy = GoodputPolicy(GoodputConfig(profile=PROFILE, min_dwell_steps=0), (1, 3, 7, 15))
    k = 1
    for _ in range(20):
        k = policy.decide(window(k, 0.1, batch=8, cluster=stale, proposing=0.05)).k
    assert k == 1 and policy.acceptance.drafted[0] < 16
    assert policy.decide(window(k, 0.95, batch=8, cluster=stale)).k >= 7


def test_goodput_leaves_a_drafting_tier_that_ties_the_floor_without_the_margin():
    """A deeper tier measured as cheap as K=0 (on a faster spell of the machine) ties it when
    nothing lands: the switch margin must not hold it there. A tier that does buy a few
    percent is kept: leaving it would need the margin too."""
    def after(k: int, acceptance: float, proposing: float, classes: tuple[float, ...] = ()
              ) -> int:
        flat = [(8, tier, 0.0124) for tier in CANDIDATES]  # every tier costs the same
        policy = goodput(switch_margin=0.05, profile=flat, prior_strength=0)
        signals = window(k, acceptance, batch=8, proposing=proposing)
        return policy.decide(Signals(**{**signals.__dict__, "class_prior": classes})).k

    assert after(3, 0.0, proposing=1.0, classes=(0.0,)) == 0, "K=3 buys nothing: leave it"
    # Without request classes nothing would tell K=0 that drafts land again: the smallest
    # drafting tier is as far as a tie goes.
    assert after(3, 0.0, proposing=1.0) == 1
    assert after(3, 0.3, proposing=0.25) == 3, "K=3 buys 3% over K=1: kept"


def test_goodput_holds_a_tier_whose_drafts_buy_tokens_at_a_tie_with_the_floor():
    """A draft model on sampled text: K=1's drafts land at 0.27 and its steps cost 1.28x
    K=0's, so K=0 scores 0.8% higher, inside the tie. Those drafts buy 27% more tokens a
    step, so the tie is one of price, which the app measures with tens of percent of
    jitter: leaving K=1 needs the margin, as any switch does. (Over HTTP the tie rule sent
    both replicas from K=1 to K=0 24 times in two rounds of the draft-model transition,
    and the price noise sent them back.) The same tie with drafts that land at 2% is left."""
    def after(acceptance: float, k1_seconds: float) -> int:
        profile = [(8, 0, 0.0100), (8, 1, k1_seconds), (8, 3, 0.030), (8, 7, 0.060),
                   (8, 15, 0.120)]
        policy = goodput(switch_margin=0.05, profile=profile, prior_strength=0)
        signals = window(1, acceptance, batch=8, steps=50)
        return policy.decide(Signals(**{**signals.__dict__,
                                        "class_prior": (acceptance,)})).k

    assert after(0.27, k1_seconds=0.0128) == 1
    assert after(0.02, k1_seconds=0.0101) == 0, "drafts that buy nothing: K=0"
    assert after(0.27, k1_seconds=0.0134) == 0, "K=0 ahead by the margin"


def test_goodput_keeps_a_tier_whose_drafter_leaves_its_slots_empty():
    """Prompt lookup on sampled text fills 2% of a deep tier's slots: K=15 then verifies a
    third of a draft per sequence, its steps cost what K=0's do, and it ties K=0. It is kept
    (a copy that starts lands at once); the same tie with its slots filled is left."""
    def after(k: int, proposing: float) -> int:
        profile = [(1, 0, 0.008), (1, 1, 0.008), (1, 15, 0.016)]
        policy = goodput(switch_margin=0.05, profile=profile, prior_strength=0)
        signals = window(k, 0.0, batch=1, steps=50, proposing=proposing)
        return policy.decide(Signals(**{**signals.__dict__, "class_prior": (0.0,)})).k

    assert after(15, proposing=0.02) == 15
    assert after(7, proposing=0.02) == 7
    assert after(15, proposing=0.5) == 0, "a tier verifying 7 drafts a step costs more"


def test_goodput_dwell_blocks_early_switches():
    policy = goodput(min_dwell_steps=100)
    assert all(policy.decide(window(3, 1.0, batch=1)).k == 3 for _ in range(20))


@settings(max_examples=40, deadline=None)
@given(acceptance=st.floats(0, 1), batch=st.integers(1, 64))
def test_goodput_always_answers_a_candidate(acceptance, batch):
    assert settle(goodput(), acceptance, batch, rounds=5) in CANDIDATES


@settings(max_examples=25, deadline=None)
@given(low=st.floats(0, 1), high=st.floats(0, 1), batch=st.integers(1, 32))
def test_goodput_is_monotone_in_acceptance(low, high, batch):
    low, high = sorted((low, high))
    assert settle(goodput(), low, batch) <= settle(goodput(), high, batch)


@settings(max_examples=25, deadline=None)
@given(small=st.integers(1, 64), large=st.integers(1, 64), acceptance=st.floats(0.3, 0.9))
def test_goodput_speculates_less_as_batch_grows_when_verify_is_compute_bound(
        small, large, acceptance):
    small, large = sorted((small, large))
    # A fixed step overhead, then verify work that grows with batch x (K + 1).
    costs = [(b, k, 0.01 + 0.0005 * b * (k + 1)) for b in (1, 64) for k in CANDIDATES]
    assert settle(goodput(profile=costs), acceptance, large) <= \
        settle(goodput(profile=costs), acceptance, small)


def test_goodput_new_replica_starts_from_the_cluster_prior():
    prior = ClusterView(acceptance_prior=(0.99,) * 15)
    pessimistic = ClusterView(acceptance_prior=(0.01,) * 15)
    fresh = window(3, 0.0, batch=1, steps=1)
    nothing_yet = {"drafts": 0, "drafting_sequence_steps": 0, "accepted_per_pos": (),
                   "drafted_per_pos": ()}
    assert goodput().decide(Signals(**{**fresh.__dict__, **nothing_yet, "cluster": prior})).k \
        == 15
    assert goodput().decide(Signals(**{**fresh.__dict__, **nothing_yet,
                                       "cluster": pessimistic})).k == 0


# ---- stability (DSDE) -------------------------------------------------------------------------

def with_requests(signals: Signals, *requests: RequestAcceptance) -> Signals:
    return Signals(**{**signals.__dict__, "requests": RequestWindows.of(requests)})


def request_length(request: RequestAcceptance, config: StabilityConfig, current: int,
                   next_tier: int) -> int:
    return int(request_lengths(RequestWindows.of([request]), config, CANDIDATES[-1], current,
                               next_tier)[0])


def test_stability_caps_long_on_steady_acceptance_and_short_on_erratic():
    config = StabilityConfig()
    steady = RequestAcceptance("a", accepted=(7,) * 30, drafted=(7,) * 30)
    erratic = RequestAcceptance("b", accepted=(7, 0) * 15, drafted=(7,) * 30)
    assert request_length(steady, config, current=7, next_tier=15) == 15
    assert request_length(erratic, config, current=7, next_tier=15) < 7
    policy = StabilityPolicy(config, CANDIDATES)
    base = window(7, 1.0, batch=1)
    assert policy.decide(with_requests(base, steady)).k == 15
    assert policy.decide(with_requests(base, erratic)).k < 7
    # Full runs from before a climb (at K=3) say nothing about K=7's depth.
    earlier = RequestAcceptance("c", accepted=(3,) * 15 + (5,) * 15, drafted=(3,) * 15 + (7,) * 15)
    assert request_length(earlier, config, current=7, next_tier=15) <= 7


def test_stability_judges_each_request_by_its_own_drafting_steps():
    """A batch of windows of different lengths, some with K=0 steps between drafting ones:
    each request gets the length it would get alone, from the steps that drafted."""
    config = StabilityConfig()
    steady = RequestAcceptance("a", accepted=(7,) * 30, drafted=(7,) * 30)
    paused = RequestAcceptance("b", accepted=(7, 0) * 15, drafted=(7, 0) * 15)
    young = RequestAcceptance("c", accepted=(7, 7), drafted=(7, 7))  # too little history
    erratic = RequestAcceptance("d", accepted=(7, 0) * 5, drafted=(7,) * 10)
    batch = [steady, paused, young, erratic]
    lengths = request_lengths(RequestWindows.of(batch), config, CANDIDATES[-1], current=7,
                              next_tier=15)
    assert lengths.tolist() == [request_length(r, config, 7, 15) for r in batch]
    assert lengths[0] == lengths[1] == 15 and lengths[2] == 0 and 0 < lengths[3] < 7


def dsde_length(request: RequestAcceptance, config: StabilityConfig, current: int,
                next_tier: int) -> int:
    """The paper's computation one request at a time, in plain Python: the reference the
    vectorised `request_lengths` must match (0: too little history)."""
    pairs = [(a, d) for a, d in zip(request.accepted, request.drafted, strict=True) if d > 0]
    pairs = pairs[-config.window:]
    if len(pairs) < 3:
        return 0

    def weighted_variance(values: list[float]) -> float:
        weights = [config.weight ** (len(values) - 1 - i) for i in range(len(values))]
        mean = sum(w * v for w, v in zip(weights, values, strict=True)) / sum(weights)
        return sum(w * (v - mean) ** 2 for w, v in zip(weights, values, strict=True)) / \
            sum(weights)

    signal = [1 - a / d for a, d in pairs]
    recent = signal[-max(1, config.window // 3):] if len(signal) >= config.window // 3 \
        else signal
    long_var = weighted_variance(signal)
    wvir = 20.0 if long_var < 1e-6 else weighted_variance(recent) / long_var
    scale = math.exp(2 * (sum(recent) / len(recent)) / config.temperature) - 1
    sl_max = max(1, max(a for a, _ in pairs))
    if any(a >= d == current for a, d in pairs):
        sl_max = max(sl_max, next_tier)
    sl_min = math.ceil(0.1 * sl_max)
    if wvir * scale <= 1:
        return math.ceil((sl_max - sl_min) * (1 - wvir * scale) + sl_min)
    return sl_min


outcome = st.sampled_from([0, 1, 3, 7, 15]).flatmap(
    lambda d: st.tuples(st.integers(0, d), st.just(d)))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(outcome, max_size=30), max_size=6),
       st.sampled_from([3, 10, 30]), st.sampled_from([0.5, 0.9]),
       st.sampled_from([(1, 3), (3, 7), (7, 15), (15, 15)]))
def test_stability_lengths_match_the_per_request_computation(windows, window, weight, tiers):
    config = StabilityConfig(window=window, weight=weight)
    requests = [RequestAcceptance(f"r{i}", tuple(a for a, _ in w), tuple(d for _, d in w))
                for i, w in enumerate(windows)]
    lengths = request_lengths(RequestWindows.of(requests), config, CANDIDATES[-1], *tiers)
    assert lengths.tolist() == [dsde_length(r, config, *tiers) for r in requests]


def test_stability_reads_steps_deeper_than_its_widest_tier_up_to_that_tier():
    """After a run-time change of candidates lowered the widest tier (15 -> 7), a request's
    window still holds its steps at K=15. One that landed 7 of 15 drafts each step landed
    every draft a tier now offers: steady at K=7, not rejecting half its drafts (K=1)."""
    tiers = (0, 1, 3, 7)
    before = RequestAcceptance("a", accepted=(7,) * 30, drafted=(15,) * 30)
    policy = StabilityPolicy(StabilityConfig(), tiers)
    assert policy.decide(with_requests(window(7, 1.0, batch=1), before)).k == 7


def test_stability_window_is_at_most_what_an_engine_keeps():
    StabilityConfig(window=REQUEST_WINDOW)
    with pytest.raises(ValidationError):
        StabilityConfig(window=REQUEST_WINDOW + 1)


def test_stability_climbs_when_runs_are_cut_off_by_the_depth():
    """A request that accepts every draft at K=3 might accept more: the policy moves up a tier
    at a time (with the longest run as the ceiling it could never leave K=3); one that stops
    at two of three stays below."""
    policy = StabilityPolicy(StabilityConfig(), CANDIDATES)
    k = 3
    for _ in range(3):
        full = RequestAcceptance("a", accepted=(k,) * 30, drafted=(k,) * 30)
        k = policy.decide(with_requests(window(k, 1.0, batch=1), full)).k
    assert k == 15
    short = RequestAcceptance("b", accepted=(2,) * 30, drafted=(3,) * 30)
    assert policy.decide(with_requests(window(3, 0.6, batch=1), short)).k == 1


def test_stability_caps_each_request_at_its_own_length_where_the_engine_can():
    """DSDE's per-sequence length: on an engine that caps drafts per request, a request whose
    drafts land erratically is capped below the batch's K and the steady ones draft K; a
    capped request that lands every draft of its cap climbs (twice its cap, a tier at most).
    An engine without per-request caps gets the batch cap alone."""
    steady = [RequestAcceptance(f"a{i}", accepted=(7,) * 30, drafted=(7,) * 30)
              for i in range(3)]
    erratic = RequestAcceptance("b", accepted=(7, 0) * 15, drafted=(7,) * 30)
    base = window(7, 1.0, batch=4)
    signals = Signals(**{**with_requests(base, *steady, erratic).__dict__,
                         "draft_caps_apply": True})
    policy = StabilityPolicy(StabilityConfig(), CANDIDATES)
    decision = policy.decide(signals)
    erratic_length = request_length(erratic, StabilityConfig(), current=7, next_tier=15)
    assert decision.k == 7 and 0 < erratic_length < 7
    assert decision.draft_caps == {"b": erratic_length}
    assert StabilityPolicy(StabilityConfig(), CANDIDATES).decide(
        with_requests(base, *steady, erratic)).draft_caps is None
    assert StabilityPolicy(StabilityConfig(draft_caps=False), CANDIDATES).decide(
        signals).draft_caps is None
    # The capped request now lands every draft at its cap: it is cut off by the cap.
    cap = erratic_length
    landing = RequestAcceptance("b", accepted=(cap,) * 30, drafted=(cap,) * 30)
    climbed = policy.decide(Signals(**{**with_requests(base, *steady, landing).__dict__,
                                       "draft_caps_apply": True}))
    assert 2 * cap < climbed.k and climbed.draft_caps == {"b": 2 * cap}


def test_stability_turns_speculation_off_when_nothing_lands_and_looks_again_later():
    config = StabilityConfig(probe_interval_steps=64)
    policy = StabilityPolicy(config, CANDIDATES)
    dead = RequestAcceptance("a", accepted=(0,) * 30, drafted=(7,) * 30)
    base = window(7, 0.0, batch=1)
    assert policy.decide(with_requests(base, dead)).k == 0
    idle = RequestAcceptance("a", accepted=(0,) * 30, drafted=(0,) * 30)
    off = with_requests(window(0, 0.0, batch=1, steps=16), idle)
    decisions = [policy.decide(off).k for _ in range(4)]
    assert decisions == [0, 0, 0, 1], "after 64 steps at K=0 it measures the smallest tier"


def stability_window(k: int, acceptance: float) -> Signals:
    """One request whose last four steps drafted k tokens each (none at K=0), landing all of
    them if `acceptance` is 1 and none if it is 0."""
    drafted = (0,) * 26 + (k,) * 4
    accepted = tuple(round(d * acceptance) for d in drafted)
    return with_requests(window(k, acceptance, batch=1),
                         RequestAcceptance("a", accepted=accepted, drafted=drafted))


def test_stability_keeps_probing_at_its_interval_while_probes_find_nothing():
    """Unlike `goodput`'s, its probe is the only way it learns that drafts land again (it has
    no class hint): a backoff like `goodput`'s, tried, held it at K=0 through the high phases
    of the cpu-demo transition replay with its stop-40 preset (867.7 -> 645.8 tok/s)."""
    policy = StabilityPolicy(StabilityConfig(probe_interval_steps=40), CANDIDATES)
    gaps = np.diff(probe_steps(policy, 0.0, 200, stability_window))
    assert len(gaps) >= 10 and gaps.max() < 2 * 40


# ---- every policy -------------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(POLICY_NAMES), k=st.sampled_from(CANDIDATES),
       acceptance=st.floats(0, 1), batch=st.integers(0, 128))
def test_every_policy_answers_a_candidate(name, k, acceptance, batch):
    policy = build_policy({"name": name}, CANDIDATES)
    for _ in range(3):
        k = policy.decide(window(k, acceptance, batch=batch)).k
        assert k in CANDIDATES


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown policy"):
        build_policy({"name": "magic"}, CANDIDATES)


def test_goodput_anchors_the_prior_on_the_positions_this_replica_measured():
    """The fleet measured deep positions where drafts landed best: its absolute rates there
    overstate a replica whose first position lands less. The prior's conditional rates
    carry this replica's own rate on instead (a K=1 replica priced K=3 at the fleet's rates,
    switched, measured less, and switched back)."""
    window_ = AcceptanceWindow(kmax=3, decay=1.0, prior_strength=4.0)
    window_.update(accepted=(450,), drafted=(1000,))  # K=1: only the first position
    prior = (0.9, 0.72, 0.36)  # conditional 0.8, then 0.5
    rates = window_.rates(prior)
    assert rates[0] == pytest.approx((450 + 4 * 0.9) / 1004)
    assert rates[1] == pytest.approx(rates[0] * 0.8) and rates[2] == pytest.approx(
        rates[0] * 0.4)
    fresh = AcceptanceWindow(kmax=3, decay=1.0, prior_strength=4.0)
    assert fresh.rates(prior) == pytest.approx(list(prior)), "nothing measured: the prior"
