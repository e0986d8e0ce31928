"""Empirical privacy auditing in one training run (Steinke, Nasr & Jagielski, NeurIPS 2023).

An audit inserts m canaries into the training data, each independently with probability 1/2
(the secret coins S_i in {-1, +1}), trains once, scores every canary, and guesses "in" for the
highest scores and "out" for the lowest, abstaining on the rest. If training is (ε, δ)-DP
(add/remove-one adjacency, which is what including or leaving out a canary is), the number of
correct guesses cannot be much larger than that of randomized response with accuracy
e^ε / (1 + e^ε); observing more correct guesses than that rejects ε. The largest ε rejected at
confidence 1 - β is an empirical **lower bound** on the run's ε. It is a check, not a
guarantee: a lower bound far below the claimed ε says little (auditing is weak for
black-box attacks on real models), a lower bound above it proves the claim wrong.

Contract:
  * Canaries (`random_label_canaries`): m inputs drawn without replacement from a pool of real
    examples, each relabelled with a label drawn uniformly from the OTHER classes; the coins
    come from `draw_inclusion(m, seed=...)`, a numpy stream of its own, so the same seed always
    gives the same coins (whatever else the seed is used for). `CanarySet.insert` appends the
    included canaries to the non-canary training data; nothing else about the data changes.
  * Scores: one float per canary, higher = more likely included (`loss_scores`: minus the
    canary's loss under its canary label, or its decrease from before training).
  * Guesses (`guesses_from_scores`): +1 for the `num_in` highest scores, -1 for the `num_out`
    lowest, 0 (abstain) otherwise; ties are broken by canary index, never by the coins.
  * The bound (`p_value`, `epsilon_lower_bound`): for an (ε, δ)-DP mechanism, m canaries and r
    guesses, P[correct >= v] <= P[Bin(r, q) >= v] + 2 m δ max_{1<=i<=v} P[v-i <= Bin(r, q) < v]
    / i with q = e^ε / (1 + e^ε) (the paper's theorem for approximate DP; for δ = 0 the first
    term alone, its pure-DP theorem). `epsilon_lower_bound` returns the largest ε whose tail
    bound is still below β: with probability >= 1 - β over the coins, the true ε is at least
    this value. Computed in float64 from log-factorials; no scipy.
  * `audit_scores` tries several numbers of guesses and reports the best bound; each is tested
    at β / (number of tries) (Bonferroni), so the best one is still a valid 1 - β bound.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "AuditResult",
    "CanarySet",
    "audit_scores",
    "count_correct",
    "default_guess_counts",
    "draw_inclusion",
    "epsilon_lower_bound",
    "guesses_from_scores",
    "loss_scores",
    "p_value",
    "random_label_canaries",
    "softmax_cross_entropy",
]

# Numpy streams derived from the audit seed: one for choosing canaries, one for the coins.
_CANARY_STREAM = 0
_COIN_STREAM = 1


# ------------------------------------------------------------------------------- canaries
def _rng(seed: int, stream: int) -> np.random.Generator:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}.")
    return np.random.default_rng([int(seed), stream])


def draw_inclusion(num_canaries: int, *, seed: int) -> np.ndarray:
    """The secret coins: which of `num_canaries` canaries are included (each with prob. 1/2).

    Args:
      num_canaries: m >= 1.
      seed: non-negative integer; the same seed always gives the same coins.

    Returns:
      bool array `[m]`, True = the canary is in the training set.

    Privacy:
      The coins are the audit's secret. Whoever scores the canaries must not see them before
      guessing; the bound assumes each is a fair coin independent of everything else.
    """
    if int(num_canaries) < 1:
        raise ValueError(f"num_canaries must be >= 1, got {num_canaries}.")
    return _rng(seed, _COIN_STREAM).random(int(num_canaries)) < 0.5


@dataclasses.dataclass(frozen=True, eq=False)
class CanarySet:
    """m canary examples and their inclusion coins.

    Attributes:
      inputs: canary inputs `[m, ...]` (copies of pool examples).
      labels: canary labels `[m]` (int32), each different from `original_labels`.
      original_labels: the pool's labels of those inputs `[m]`.
      source_indices: where in the pool each canary input came from `[m]`.
      included: the coins, bool `[m]` (True = in the training set).
      seed: the seed that chose the canaries and the coins.
    """

    inputs: np.ndarray
    labels: np.ndarray
    original_labels: np.ndarray
    source_indices: np.ndarray
    included: np.ndarray
    seed: int

    @property
    def num_canaries(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_included(self) -> int:
        return int(np.count_nonzero(self.included))

    def non_canary(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The pool `(x, y)` without the examples used as canary inputs (the base training set).

        Privacy:
          Returns private training data unchanged (a subset); nothing is released.
        """
        keep = np.ones(len(y), dtype=bool)
        keep[self.source_indices] = False
        return x[keep], y[keep]

    def insert(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`(x, y)` with the included canaries appended (inputs and canary labels).

        Privacy:
          The result is the private training set of the audited run; the excluded canaries
          never enter it.
        """
        if tuple(x.shape[1:]) != tuple(self.inputs.shape[1:]):
            raise ValueError(
                f"x rows have shape {x.shape[1:]} but canary inputs {self.inputs.shape[1:]}."
            )
        x_in = self.inputs[self.included].astype(x.dtype, copy=False)
        y_in = self.labels[self.included].astype(y.dtype, copy=False)
        return np.concatenate([x, x_in]), np.concatenate([y, y_in])


def random_label_canaries(
    x: np.ndarray, y: np.ndarray, *, num_canaries: int, num_classes: int, seed: int
) -> CanarySet:
    """Random-label canaries: m pool inputs, each relabelled with a wrong, uniform label.

    Args:
      x: pool inputs `[n, ...]` (e.g. the training split before the audit removes canaries).
      y: pool labels `[n]`, integers in `[0, num_classes)`.
      num_canaries: m, 1 <= m <= n.
      num_classes: number of classes (>= 2).
      seed: non-negative integer; chooses the inputs and labels, and the coins
        (`draw_inclusion(m, seed=seed)`).

    Returns:
      A `CanarySet`; use `non_canary(x, y)` for the base training data and `insert(...)` to
      add the included canaries.

    Privacy:
      Canary inputs are copies of pool examples: keep them out of the non-canary data (use
      `non_canary`) so each canary's presence is decided by its coin alone.
    """
    y = np.asarray(y)
    n = int(y.shape[0])
    m = int(num_canaries)
    if not 1 <= m <= n:
        raise ValueError(f"num_canaries must be in [1, {n}] (the pool size), got {num_canaries}.")
    if int(num_classes) < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}.")
    if y.ndim != 1 or len(x) != n:
        raise ValueError(f"y must be [n] and x [n, ...]; got {np.shape(x)} and {y.shape}.")
    if n and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"labels must be in [0, {num_classes}), got [{y.min()}, {y.max()}].")
    rng = _rng(seed, _CANARY_STREAM)
    source = np.sort(rng.choice(n, size=m, replace=False))
    original = y[source].astype(np.int32)
    # A uniform label among the other num_classes - 1 classes.
    shift = rng.integers(1, int(num_classes), size=m)
    labels = ((original + shift) % int(num_classes)).astype(np.int32)
    return CanarySet(
        inputs=np.array(x[source]),
        labels=labels,
        original_labels=original,
        source_indices=source,
        included=draw_inclusion(m, seed=seed),
        seed=int(seed),
    )


# ------------------------------------------------------------------------------- scores
def softmax_cross_entropy(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per-example cross-entropy `[m]` of `logits` `[m, classes]` at integer `labels` `[m]`.

    Privacy:
      Entry ``i`` depends on row ``i`` of `logits` and `labels` only; no coins are read, so it can
      score canaries before the guesses are made.
    """
    logits = np.asarray(logits, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.int64)
    top = logits.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
    return log_norm - logits[np.arange(len(labels)), labels]


def loss_scores(losses_after: np.ndarray, losses_before: np.ndarray | None = None) -> np.ndarray:
    """Membership scores from canary losses: higher = guess "included".

    Args:
      losses_after: each canary's loss (under its canary label) on the trained model `[m]`.
      losses_before: the same on the model before training (data-independent); when given the
        score is the loss decrease, which removes the initialisation's per-canary variation.

    Returns:
      float64 `[m]`: `-losses_after`, or `losses_before - losses_after`.

    Privacy:
      Never reads the coins: score ``i`` depends on canary ``i``'s losses only. The losses must
      come from the audited model (and ``losses_before`` from one that saw no data), or the
      bound no longer tests that training run.
    """
    after = np.asarray(losses_after, dtype=np.float64)
    if losses_before is None:
        return -after
    before = np.asarray(losses_before, dtype=np.float64)
    if before.shape != after.shape:
        raise ValueError(f"losses have shapes {before.shape} and {after.shape}.")
    return before - after


# ------------------------------------------------------------------------------ guesses
def guesses_from_scores(
    scores: np.ndarray, *, num_in: int, num_out: int | None = None
) -> np.ndarray:
    """Guesses in {-1, 0, +1}: +1 for the `num_in` highest scores, -1 for the `num_out` lowest.

    Args:
      scores: `[m]` finite scores, higher = more likely included.
      num_in: guesses "included" (k+).
      num_out: guesses "excluded" (k-); default `num_in`. `num_in + num_out <= m`.

    Returns:
      int8 `[m]`; ties are broken by canary index (a stable sort), never by the coins.

    Privacy:
      The guesses depend on the scores (and canary order) alone, as the bound requires: the
      coins must reach them only through the trained model the scores come from.
    """
    s = np.asarray(scores, dtype=np.float64)
    m = int(s.shape[0])
    k_in = int(num_in)
    k_out = k_in if num_out is None else int(num_out)
    if s.ndim != 1 or not np.all(np.isfinite(s)):
        raise ValueError("scores must be a finite 1-D array.")
    if k_in < 0 or k_out < 0 or k_in + k_out > m:
        raise ValueError(f"need 0 <= num_in, num_out and num_in + num_out <= {m}.")
    order = np.argsort(-s, kind="stable")  # highest first
    guesses = np.zeros(m, dtype=np.int8)
    guesses[order[:k_in]] = 1
    if k_out:
        guesses[order[m - k_out :]] = -1
    return guesses


def count_correct(guesses: np.ndarray, included: np.ndarray) -> tuple[int, int]:
    """(r, v): the number of non-abstaining guesses and how many of them match the coins.

    Privacy:
      This reads the secret coins (``included``): call it only once the guesses are final, since
      a guess made or changed after seeing the coins voids the bound of :func:`p_value`.
    """
    g = np.asarray(guesses)
    truth = np.where(np.asarray(included, dtype=bool), 1, -1)
    if g.shape != truth.shape:
        raise ValueError(f"guesses {g.shape} and coins {truth.shape} differ in shape.")
    made = g != 0
    return int(np.count_nonzero(made)), int(np.count_nonzero(made & (g == truth)))


# -------------------------------------------------------------------------------- bound
def _check_counts(num_canaries: int, num_guesses: int, num_correct: int) -> tuple[int, int, int]:
    m, r, v = int(num_canaries), int(num_guesses), int(num_correct)
    if not 0 <= v <= r <= m or m < 1:
        raise ValueError(
            f"need 0 <= num_correct <= num_guesses <= num_canaries and num_canaries >= 1; got "
            f"num_canaries={num_canaries}, num_guesses={num_guesses}, num_correct={num_correct}."
        )
    return m, r, v


def _log_binomial_coefficients(r: int) -> np.ndarray:
    """log C(r, j) for j = 0..r (log-factorials as cumulative sums of logs, float64)."""
    log_fact = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, r + 1, dtype=np.float64)))])
    return log_fact[r] - log_fact - log_fact[::-1]


def _p_value(epsilon: float, delta: float, m: int, r: int, v: int, log_coef: np.ndarray) -> float:
    if v == 0:
        return 1.0
    # q = e^ε / (1 + e^ε), in logs without overflow.
    log_q = -math.log1p(math.exp(-epsilon))
    log_not_q = -epsilon + log_q
    j = np.arange(r + 1, dtype=np.float64)
    pmf = np.exp(log_coef + j * log_q + (r - j) * log_not_q)
    tail = float(pmf[v:].sum())  # P[Bin(r, q) >= v], summed directly (no 1 - cdf).
    if delta > 0:
        # max over i = 1..v of P[v - i <= Bin < v] / i (larger i only divide the same mass more).
        below = np.cumsum(pmf[:v][::-1])
        alpha = float(np.max(below / np.arange(1, v + 1)))
        tail += 2.0 * m * delta * alpha
    return min(1.0, tail)


def p_value(
    *, epsilon: float, delta: float, num_canaries: int, num_guesses: int, num_correct: int
) -> float:
    """Upper bound on P[correct guesses >= v] for any (ε, δ)-DP training run.

    The paper's bound for m canaries and r guesses: P[Bin(r, q) >= v] plus, for δ > 0,
    2 m δ max_{1<=i<=v} P[v-i <= Bin(r, q) < v] / i, with q = e^ε / (1 + e^ε), capped at 1.

    Args:
      epsilon: ε >= 0 of the hypothesis being tested.
      delta: δ in [0, 1].
      num_canaries: m.
      num_guesses: r <= m.
      num_correct: v <= r.

    Returns:
      The bound, in [0, 1]; a value below β rejects "(ε, δ)-DP" at confidence 1 - β.
    """
    m, r, v = _check_counts(num_canaries, num_guesses, num_correct)
    if not math.isfinite(float(epsilon)) or epsilon < 0:
        raise ValueError(f"epsilon must be finite and >= 0, got {epsilon}.")
    if not 0.0 <= float(delta) <= 1.0:
        raise ValueError(f"delta must be in [0, 1], got {delta}.")
    return _p_value(float(epsilon), float(delta), m, r, v, _log_binomial_coefficients(r))


def epsilon_lower_bound(
    *,
    num_canaries: int,
    num_guesses: int,
    num_correct: int,
    delta: float,
    beta: float = 0.05,
    tolerance: float = 1e-6,
) -> float:
    """The empirical ε lower bound: the largest ε whose `p_value` is still below β.

    Scans ε upward in steps of 0.25 to the first ε not rejected, then bisects between that and
    the last rejected one; returns the rejected end, so rounding errs low. 0 when even ε = 0
    is not rejected (e.g. v <= r/2).

    Args:
      num_canaries: m.
      num_guesses: r (non-abstaining guesses).
      num_correct: v (correct guesses among them).
      delta: δ of the audited run.
      beta: 1 - confidence, in (0, 1).
      tolerance: bisection width.

    Returns:
      ε_lb >= 0 such that, if the run is (ε, δ)-DP, P[ε_lb > ε] <= β over the coins.
    """
    m, r, v = _check_counts(num_canaries, num_guesses, num_correct)
    if not 0.0 < float(beta) < 1.0:
        raise ValueError(f"beta must be in (0, 1), got {beta}.")
    if not 0.0 <= float(delta) <= 1.0:
        raise ValueError(f"delta must be in [0, 1], got {delta}.")
    log_coef = _log_binomial_coefficients(r)

    def rejected(eps: float) -> bool:
        return _p_value(eps, float(delta), m, r, v, log_coef) < beta

    if not rejected(0.0):
        return 0.0
    low, step = 0.0, 0.25
    high = step
    while rejected(high):  # terminates: as ε grows, P[Bin(r, q) >= v] -> 1 for v <= r.
        low, high = high, high + step
    while high - low > tolerance:
        mid = 0.5 * (low + high)
        if rejected(mid):
            low = mid
        else:
            high = mid
    return low


# -------------------------------------------------------------------------------- audit
def default_guess_counts(num_canaries: int) -> list[int]:
    """Numbers of guesses per side k to try: 1, 2, 5, 10, 20, 50, ... up to m // 2, and m // 2."""
    half = int(num_canaries) // 2
    counts = {half} if half else set()
    scale = 1
    while scale <= half:
        counts.update(c for c in (scale, 2 * scale, 5 * scale) if c <= half)
        scale *= 10
    return sorted(counts)


@dataclasses.dataclass(frozen=True)
class AuditResult:
    """The outcome of `audit_scores`.

    Attributes:
      epsilon_lower_bound: the best bound over `per_guess_count` (valid at confidence 1 - β).
      beta: 1 - confidence of the reported bound.
      delta: δ used.
      num_canaries: m.
      num_included: canaries whose coin said "in".
      best: the entry of `per_guess_count` giving the bound.
      per_guess_count: one dict per k: `k` (guesses per side), `num_guesses` (r = 2k),
        `num_correct` (v), `epsilon_lower_bound` (at β / len(per_guess_count)).
    """

    epsilon_lower_bound: float
    beta: float
    delta: float
    num_canaries: int
    num_included: int
    best: dict[str, Any]
    per_guess_count: list[dict[str, Any]]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def audit_scores(
    scores: np.ndarray,
    included: np.ndarray,
    *,
    delta: float,
    beta: float = 0.05,
    guess_counts: Sequence[int] | None = None,
) -> AuditResult:
    """The one-run audit from canary scores and coins.

    For each k in `guess_counts`, guesses "in" for the k highest scores and "out" for the k
    lowest, counts correct guesses, and computes the ε lower bound at β / len(guess_counts);
    the reported bound is the largest of them (Bonferroni: valid at 1 - β overall).

    Args:
      scores: `[m]` membership scores (higher = included), computed without the coins.
      included: `[m]` bool coins.
      delta: δ of the audited run.
      beta: 1 - confidence of the reported bound.
      guess_counts: guesses per side to try (each 1 <= k <= m // 2); default
        `default_guess_counts(m)`.

    Returns:
      An `AuditResult`.

    Privacy:
      Reads the coins, so it must run after the scores are fixed. The result (counts and
      bounds) says how much the trained model reveals about canary membership; it reveals
      nothing about non-canary training data beyond what the model already does.
    """
    s = np.asarray(scores, dtype=np.float64)
    coins = np.asarray(included, dtype=bool)
    m = int(s.shape[0])
    if coins.shape != s.shape:
        raise ValueError(f"scores {s.shape} and coins {coins.shape} differ in shape.")
    counts = default_guess_counts(m) if guess_counts is None else [int(k) for k in guess_counts]
    if not counts or any(not 1 <= k <= m // 2 for k in counts):
        raise ValueError(f"guess_counts must be non-empty, each in [1, {m // 2}]; got {counts}.")
    per_k_beta = float(beta) / len(counts)
    rows = []
    for k in counts:
        r, v = count_correct(guesses_from_scores(s, num_in=k), coins)
        bound = epsilon_lower_bound(
            num_canaries=m, num_guesses=r, num_correct=v, delta=delta, beta=per_k_beta
        )
        rows.append({"k": k, "num_guesses": r, "num_correct": v, "epsilon_lower_bound": bound})
    # The largest bound; among equal bounds (e.g. all 0) the one with the most guesses.
    best = max(rows, key=lambda row: (row["epsilon_lower_bound"], row["num_guesses"]))
    return AuditResult(
        epsilon_lower_bound=best["epsilon_lower_bound"],
        beta=float(beta),
        delta=float(delta),
        num_canaries=m,
        num_included=int(np.count_nonzero(coins)),
        best=best,
        per_guess_count=rows,
    )
