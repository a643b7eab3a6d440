"""Per-position acceptance estimates for `goodput`: the replica's decayed windows
(`AcceptanceWindow`) and each running request's own (`batch_acceptance`), with what fills the
positions nobody measured (a class or fleet prior, else a geometric continuation).

p[k] is the share of draft steps with more than k drafts accepted; a request's conditional rate
at k is the chance position k lands given the positions before it landed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from policies.outcomes import survival_counts
from policies.signals import RequestWindows

# Acceptance assumed at the first position before any measurement or prior.
DEFAULT_PRIOR_FIRST = 0.5
# A shift in first-position acceptance counts only with this many drafts on both sides.
SHIFT_MIN_DRAFTS = 16
# After a shift, the prior is left out for this many updates (decisions, drafting or not):
# the fleet's decayed counts lag the same change.
PRIOR_PAUSE_UPDATES = 8


class AcceptanceWindow:
    """Decayed per-position counts: p[k] = accepted[k] / drafted[k], blended with a prior."""

    def __init__(self, kmax: int, decay: float, prior_strength: float,
                 shift_threshold: float = 1.0):
        self.decay = decay
        self.prior_strength = prior_strength
        self.shift_threshold = shift_threshold
        self.accepted = [0.0] * kmax
        self.drafted = [0.0] * kmax
        self._prior_paused = 0

    def update(self, accepted: tuple[int, ...], drafted: tuple[int, ...]) -> None:
        """Slide the windows when drafts arrived; at K=0 (no evidence at all) keep them.

        Positions deeper than the current K fade too, so their estimate moves to the
        extrapolation from the fresh, shallower positions rather than staying stale. A shift
        (see `GoodputConfig.shift_threshold`) restarts every position: a decay would take
        several decisions to forget the old traffic, and a high phase lasts tens of steps.
        """
        # The pause runs out with decisions, drafting or not: counted only on drafting ones,
        # a replica that went to K=0 after a shift kept the prior aside for good.
        if self._prior_paused:
            self._prior_paused -= 1
        if not any(drafted):
            return
        if self._shifted(accepted, drafted):
            self.accepted = [0.0] * len(self.accepted)
            self.drafted = [0.0] * len(self.drafted)
            self._prior_paused = PRIOR_PAUSE_UPDATES
        for k in range(len(self.accepted)):
            self.accepted[k] = self.accepted[k] * self.decay + (
                accepted[k] if k < len(accepted) else 0)
            self.drafted[k] = self.drafted[k] * self.decay + (drafted[k] if k < len(drafted) else 0)

    def _contradicts(self, prior: tuple[float, ...]) -> bool:
        """This replica's own first-position acceptance is far from the prior's: the prior
        describes other traffic (another phase, or other classes under acceptance-aware
        routing), so it says nothing about this replica's deeper positions either."""
        if not prior or self.drafted[0] < SHIFT_MIN_DRAFTS:
            return False
        return abs(self.accepted[0] / self.drafted[0] - prior[0]) > self.shift_threshold

    def _shifted(self, accepted: tuple[int, ...], drafted: tuple[int, ...]) -> bool:
        fresh, past = drafted[0] if drafted else 0, self.drafted[0]
        if fresh < SHIFT_MIN_DRAFTS or past < SHIFT_MIN_DRAFTS:
            return False
        return abs(accepted[0] / fresh - self.accepted[0] / past) > self.shift_threshold

    def uses_prior(self, prior: tuple[float, ...]) -> bool:
        """False while the prior is set aside: just after a shift, or when this replica's
        own first position contradicts it."""
        return bool(prior) and not self._prior_paused and not self._contradicts(prior)

    def rates(self, prior: tuple[float, ...]) -> list[float]:
        if not self.uses_prior(prior):
            prior = ()
        rates: list[float] = []
        for k in range(len(self.accepted)):
            guess = _continue(rates, prior, k)
            weight = self.drafted[k] + self.prior_strength
            rate = (self.accepted[k] + self.prior_strength * guess) / weight if weight else guess
            # Acceptance is a prefix: more than k accepted implies more than k-1 accepted.
            rates.append(min(rate, rates[-1]) if rates else rate)
        return rates


@dataclass(frozen=True)
class BatchAcceptance:
    """Per running request (columns): the chance that each draft position lands, its
    acceptance length at each depth, and its share of the tokens (see `batch_acceptance`)."""

    reach: np.ndarray
    """[kmax, rows]: r_k, the share of the request's steps that land draft position k."""
    lengths: np.ndarray
    """[kmax + 1, rows]: L_r(d) = 1 + sum_{k<d} r_k, tokens per step at depth d."""
    tokens: np.ndarray
    """[rows]: tokens the request generated in its window (all ones when none has outcomes)."""
    full_runs: np.ndarray
    """[rows]: drafts the request landed in its last step when it landed all of them (0
    when it missed one, or had none)."""

    def steady(self, ks: tuple[int, ...], caps: np.ndarray | None = None,
               verified: Callable[[np.ndarray], np.ndarray] | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
        """Per K in `ks`, once the batch's mix has settled there: (tokens per sequence-step,
        drafts verified per sequence). Speculation changes a batch's mix: requests whose
        drafts land finish in fewer steps at a deeper K, and their slots go to requests
        whose drafts fail, so the mean over the batch as it is now would overstate a deeper
        K for a mixed batch (and once there, still prefer it at that K's thinner mix). Each
        request drafts min(K, its cap) (`caps`, one per row; None: K for all; or several
        sets of caps, [sets, rows], for results per set, [sets, len(ks)]) positions, of
        which the drafter fills `verified(depth)` (all without it), and keeps its share w_r
        of the tokens, so the batch makes 1 / sum_r (w_r / L_r) tokens per sequence-step and
        holds each request in a share of its slots proportional to w_r / L_r. Drafts are
        mapped per request, then averaged: the drafter fills fewer deep positions, so the
        mean depth's drafts would overcharge a batch that caps some requests shallow and
        lets others draft deep."""
        depths = self._depths(np.array(ks)[:, None],  # [(sets,) ks, rows]
                              None if caps is None else caps[..., None, :])
        slots = self.tokens / self.lengths[depths, np.arange(self.tokens.shape[0])]
        per_slot = slots.sum(axis=-1)
        drafts = depths if verified is None else verified(depths)
        return self.tokens.sum() / per_slot, (slots * drafts).sum(axis=-1) / per_slot

    def share_within(self, k: int, caps: np.ndarray | None, step_s: float,
                     bound_s: float) -> float:
        """The share of the batch's tokens (at K, in its steady state) made by requests
        whose seconds per token, `step_s` over the tokens they gain a step drafting
        min(K, cap), are within `bound_s`."""
        depths = self._depths(np.array(k), caps)
        within = step_s <= bound_s * self.lengths[depths, np.arange(self.tokens.shape[0])]
        return float(self.tokens[within].sum() / self.tokens.sum())

    def _depths(self, ks: np.ndarray, caps: np.ndarray | None) -> np.ndarray:
        """Drafts each request verifies a step at K: min(K, its cap), K for all without
        caps (`ks` broadcast against the rows)."""
        return np.minimum(ks, self.reach.shape[0] if caps is None else caps)

    def caps(self, threshold: float | np.ndarray, least: int) -> np.ndarray:
        """Per request, the draft positions that land with at least `threshold`, never fewer
        than `least`, and twice the drafts it landed whole in its last step (for an array
        of thresholds, [thresholds, rows]: a set of caps per threshold). r_k falls with
        k, so they are a prefix. The doubling is how a capped request shows what lies past
        its cap: a step that lands all of its drafts says nothing about the next position,
        so a request capped by a stale guess (the previous phase's traffic) would otherwise
        stay capped while it copies."""
        landing = (self.reach >= np.asarray(threshold)[..., None, None]).sum(axis=-2)
        return np.maximum(np.maximum(least, landing), 2 * self.full_runs)


def batch_acceptance(requests: RequestWindows, landing: list[float], prior_strength: float,
                     request_priors: Sequence[tuple[float, ...]] = (), depth: int = 0
                     ) -> BatchAcceptance | None:
    """Each running request's acceptance from its own verify outcomes; None when no request
    drafted in its window and none has a class prior.

    r_k, the request's share of steps with more than k drafts accepted, is the product of its
    conditional rates c_j = P(position j lands | positions before it landed) for j <= k. Each
    c_j is counted over the request's steps that drafted position j having landed the ones
    before it (`survival_counts`), shrunk with `prior_strength` steps towards a guess: what
    the request's class showed before (`request_priors`, one per row; () where unknown), else
    the replica's (`landing[0]`, its per-sequence-step rate, at the first position; its
    conditional rates past it). A step is evidence only about the positions it reached: one
    that landed nothing lowers c_0 alone. That includes a step at K > 0 whose drafter proposed
    nothing (vLLM's first after a prefill): the engines record it as K drafts of which none
    landed (`vllm_hooks`), so c_0, like `landing[0]`, is per sequence-step run at K > 0. A
    step that offered no draft at all (run at K=0) counts at no position. Counted per position
    instead, a step that landed nothing lowered every position by the same shrinkage,
    compounded: a copy request two steps old was priced at 2.75 tokens a step at K=15 against
    its class's 12, and the replica left K=15 for K=3 at the start of every copy request.
    The class comes first: a
    request that just arrived has no outcomes yet, and the replica's rates describe the
    traffic before it, which at a change of phase is another class's (a replica fresh from
    copy traffic priced new sampled requests as copy and kept a deep K into the sampled
    phase).

    A request's share of the tokens is what it made in its window; one without outcomes
    yet (just taken, or waiting) weighs as a request that ran the others' mean steps at its
    class's acceptance length at `depth` (the tier running now): it takes a slot as they do.
    Weighed 0, a new request of another class would count for nothing in a busy batch.

    Vectorised over requests (see `policies.outcomes`).
    """
    kmax, rows = len(landing), len(requests)
    if not rows or not kmax:
        return None
    drafted, landed = requests.clipped(kmax)
    first, conditional = _guesses(landing, request_priors, rows)
    if not drafted.any() and first is None:
        return None
    guess = np.array(conditional, dtype=float)  # [kmax, rows]; row 0 set here
    guess[0] = landing[0] if first is None else first
    at_risk, beyond = (counts.T for counts in survival_counts(drafted, landed, kmax))
    if prior_strength:
        reach = (beyond + prior_strength * guess) / (at_risk + prior_strength)
    else:  # without a prior, a position no step reached has no evidence: the guess stands
        reach = np.where(at_risk > 0, beyond / np.maximum(at_risk, 1), guess)
    reach.cumprod(axis=0, out=reach)  # r_k per position (rows) and request (columns)
    lengths = np.ones((kmax + 1, rows))  # L_r(d) for d = 0..kmax
    reach.cumsum(axis=0, out=lengths[1:])
    lengths[1:] += 1
    tokens = landed.sum(axis=1) + requests.lengths  # a step: its landed drafts and one more
    if drafted.shape[1]:
        last_drafted, last_landed = drafted[:, -1], landed[:, -1]
        full_runs = np.where(last_landed == last_drafted, last_drafted, 0)
    else:  # no request has outcomes yet (just admitted)
        full_runs = np.zeros(rows, np.int64)
    new = requests.lengths == 0
    if new.all():  # only requests without outcomes yet (priced by class): alike
        tokens = np.ones(rows)
    elif new.any():
        tokens = tokens.astype(float)
        tokens[new] = requests.lengths[~new].mean() * lengths[min(depth, kmax), new]
    return BatchAcceptance(reach, lengths, tokens, full_runs)


def most_tokens_without_landings(guesses: Iterable[Sequence[float]], width: int) -> float:
    """The most tokens a sequence-step `batch_acceptance` can give a batch at any depth up to
    `width` when no request in it landed a draft in its window, `guesses` being every guess
    it may price a request by (the replica's rates, each class prior). A request's rate at a
    position is its own count shrunk towards the guess's conditional rate, and a count with
    nothing landed only lowers it, so no request makes more than its guess's
    `1 + sum_k r_k`, nor does the batch's steady state, a mean of its requests'. Each
    distinct guess once: a batch's requests share a few classes."""
    most = 1.0
    for guess in {tuple(guess) for guess in guesses if guess}:
        # r_k: the first position's rate carried on by the conditional rates, as
        # `batch_acceptance` builds a guess (`_guesses`).
        conditional = _conditionals(extended_rates(guess[:width], width))
        reach = guess[0] * np.cumprod(conditional[1:])
        most = max(most, 1.0 + guess[0] + float(reach.sum()))
    return most


def _guesses(landing: list[float], request_priors: Sequence[tuple[float, ...]], rows: int
             ) -> tuple[np.ndarray | None, np.ndarray]:
    """Per request, the guess at the first position (None when no request has a class
    prior: `landing[0]` for all) and the conditional rate at each position past it
    ([kmax, rows]; row 0 unused): its class's (see `_class_conditionals`), else the
    replica's."""
    kmax = len(landing)
    replica = _conditionals(landing)
    if not any(request_priors):
        return None, np.broadcast_to(replica[:, None], (kmax, rows))
    # A few classes, many requests: one column per distinct prior, the replica's last.
    distinct: dict[tuple[float, ...], int] = {}
    column = np.fromiter((distinct.setdefault(prior, len(distinct)) if prior else -1
                          for prior in request_priors), np.int64, rows)
    firsts = np.array([prior[0] for prior in distinct] + [landing[0]])
    table = np.column_stack([_class_conditionals(prior, kmax) for prior in distinct]
                            + [replica])
    return firsts[column], table[:, column]


@lru_cache(maxsize=256)
def _class_conditionals(prior: tuple[float, ...], kmax: int) -> np.ndarray:
    """A class's conditional rates p[k] / p[k-1] at positions 1..kmax-1 (position 0 unused),
    extended geometrically past the positions the class measured. Memoised: a class's rates
    change once a telemetry period, and every decision of every replica holding it asks."""
    return _conditionals(extended_rates(prior[:kmax], kmax))


def _conditionals(rates: Sequence[float]) -> np.ndarray:
    """p[k] / p[k-1] at each position past the first (position 0 unused)."""
    return np.array([0.0] + [_ratio(rates[k], rates[k - 1]) for k in range(1, len(rates))])


def _ratio(rate: float, previous: float) -> float:
    """The conditional rate p[k] / p[k-1], at most 1 (0 once nothing lands)."""
    return min(1.0, rate / previous) if previous > 0 else 0.0


def _continue(rates: list[float], prior: tuple[float, ...], k: int) -> float:
    """The guess for p[k] given this replica's rates before it: the prior's conditional
    rate p[k] / p[k-1] applied to this replica's own p[k-1] (equal to prior[k] while the
    replica has measured nothing), else the geometric extrapolation.

    Anchored, not the prior's p[k] itself: the fleet's deep positions are measured by the
    replicas that chose to draft deep, where drafts landed best, so its absolute rates there
    run above what a replica that measured less at the first positions will see (a K=1
    replica priced K=3 at the fleet's rates, switched, measured less and switched back)."""
    if k >= len(prior):
        return _extrapolate(rates)
    if not rates:
        return prior[0]
    return rates[-1] * _ratio(prior[k], prior[k - 1])


def extended_rates(rates: Sequence[float], width: int) -> list[float]:
    """`rates` continued to `width` positions by `_extrapolate`, one position at a time."""
    full = list(rates)
    while len(full) < width:
        full.append(_extrapolate(full))
    return full


def _extrapolate(rates: list[float]) -> float:
    """The next position's p[k], continuing the last conditional acceptance rate.

    With one known position the conditional rate is p[0] itself: the usual i.i.d. model
    p[k] = a^(k+1) (SmartSpec, the DSDE paper's baselines).
    """
    if not rates:
        return DEFAULT_PRIOR_FIRST
    conditional = rates[0] if len(rates) == 1 else (
        rates[-1] / rates[-2] if rates[-2] > 0 else 0.0)
    return rates[-1] * min(1.0, conditional)
