"""Calibration: the noise multiplier for a privacy target, the steps a budget allows.

Contract:
  * Both searches run `dp_accounting.calibrate_dp_mechanism` on events built by
    `dpcore.accounting.events` (no privacy math here) over an explicit bracket.
  * The result never exceeds the target: the returned σ (or step count) is checked with the
    same accountant and moved to the safe side if the root finder landed just past it.
  * A target that no σ in [min_noise_multiplier, max_noise_multiplier] reaches raises a
    `ValueError` naming the target and the range.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import dp_accounting

from dpcore_accounting import events as ev
from dpcore_accounting.ledger import PrivacyLedger

__all__ = ["calibrate_noise_multiplier", "calibrate_steps", "run_event"]

DEFAULT_MIN_NOISE = 0.1
DEFAULT_MAX_NOISE = 1000.0
DEFAULT_MAX_STEPS = 10**8


def _shuffle_spe(sampling_prob: float, steps_per_epoch: int | None) -> int:
    if steps_per_epoch is not None:
        return ev.check_positive_int(steps_per_epoch, "steps_per_epoch")
    # ceil(1 / q) = ceil(N / B) when q = B / N; the guard absorbs float rounding of N / B.
    return max(1, math.ceil(1.0 / sampling_prob - 1e-9))


def run_event(
    *,
    noise_multiplier: float,
    sampling_prob: float,
    steps: int,
    sampling: str = "poisson",
    steps_per_epoch: int | None = None,
) -> dp_accounting.DpEvent:
    """The DpEvent of a constant-σ run of `steps` logical steps.

    Args:
      noise_multiplier: σ.
      sampling_prob: q (Poisson rate; for shuffle, batch size / N).
      steps: logical steps, >= 1.
      sampling: `"poisson"` or `"shuffle"` (the sound no-amplification bound).
      steps_per_epoch: shuffle only; default ceil(1 / q).

    Privacy:
      For `"shuffle"` this is the bound without amplification, never a Poisson figure.
    """
    ev.check_choice(sampling, ev.SAMPLING_MODES, "sampling")
    q = ev.check_sampling_prob(sampling_prob)
    if sampling == "poisson":
        return ev.poisson_event(noise_multiplier=noise_multiplier, sampling_prob=q, steps=steps)
    return ev.shuffle_event(
        noise_multiplier=noise_multiplier,
        steps_per_epoch=_shuffle_spe(q, steps_per_epoch),
        steps=steps,
    )


def calibrate_noise_multiplier(
    *,
    target_epsilon: float,
    target_delta: float,
    sampling_prob: float,
    steps: int,
    sampling: str = "poisson",
    accountant: str = "pld",
    neighboring: str = "add_remove",
    steps_per_epoch: int | None = None,
    min_noise_multiplier: float = DEFAULT_MIN_NOISE,
    max_noise_multiplier: float = DEFAULT_MAX_NOISE,
    tol: float = 1e-5,
    pld_discretization: float = ev.DEFAULT_PLD_DISCRETIZATION,
) -> float:
    """The smallest σ (within `tol`) whose run satisfies (target_epsilon, target_delta)-DP.

    Args:
      target_epsilon: ε > 0.
      target_delta: δ in (0, 1).
      sampling_prob: q in (0, 1].
      steps: logical steps, >= 1.
      sampling: `"poisson"` or `"shuffle"`.
      accountant: `"pld"` (default) or `"rdp"`.
      neighboring: `"add_remove"` (default) or `"replace_one"`.
      steps_per_epoch: shuffle only; default ceil(1 / q).
      min_noise_multiplier: lower end of the search range (> 0).
      max_noise_multiplier: upper end of the search range.
      tol: tolerance on σ.
      pld_discretization: PLD value discretization interval (coarser: faster).

    Returns:
      σ with ε(σ) <= target_epsilon (never above it) and ε(σ - tol) > target_epsilon, or
      `min_noise_multiplier` if that already satisfies the target.

    Raises:
      ValueError: invalid input, or a target that no σ <= max_noise_multiplier reaches.

    Privacy:
      The returned σ is checked against the target with the same accountant.
    """
    eps = ev.check_epsilon(target_epsilon)
    delta = ev.check_delta(target_delta)
    q = ev.check_sampling_prob(sampling_prob)
    n = ev.check_positive_int(steps, "steps")
    ev.check_choice(sampling, ev.SAMPLING_MODES, "sampling")
    lo = ev.check_noise_multiplier(min_noise_multiplier, "min_noise_multiplier")
    hi = ev.check_noise_multiplier(max_noise_multiplier, "max_noise_multiplier")
    if not 0 < lo < hi:
        raise ValueError(
            f"need 0 < min_noise_multiplier < max_noise_multiplier, got {lo!r} and {hi!r}."
        )

    def fresh() -> dp_accounting.PrivacyAccountant:
        return ev.make_accountant(
            accountant, neighboring=neighboring, pld_discretization=pld_discretization
        )

    fresh()  # validates the accountant settings early

    def make_event(sigma: float) -> dp_accounting.DpEvent:
        return run_event(
            noise_multiplier=sigma,
            sampling_prob=q,
            steps=n,
            sampling=sampling,
            steps_per_epoch=steps_per_epoch,
        )

    def epsilon_at(sigma: float) -> float:
        return float(fresh().compose(make_event(sigma)).get_epsilon(delta))

    if epsilon_at(hi) > eps:
        raise ValueError(
            f"target_epsilon={target_epsilon!r} (target_delta={target_delta!r}) is not reached "
            f"by any noise_multiplier <= max_noise_multiplier={hi!r} with "
            f"sampling_prob={q!r}, steps={n}, sampling={sampling!r}."
        )
    # Bracket outwards from a starting point: ε is cheap at large σ and costly at very small
    # σ, so only go down as far as the target needs. With PLD, the (fast, looser) RDP answer
    # is a good upper end.
    start, factor = min(max(1.0, lo), hi), 2.0
    if accountant == "pld" and neighboring == "add_remove":
        try:
            start = calibrate_noise_multiplier(
                target_epsilon=eps,
                target_delta=delta,
                sampling_prob=q,
                steps=n,
                sampling=sampling,
                accountant="rdp",
                steps_per_epoch=steps_per_epoch,
                min_noise_multiplier=lo,
                max_noise_multiplier=hi,
                tol=1e-3,
            )
        except ValueError:  # RDP is looser: PLD may still reach the target below hi
            start = hi
        factor = 1.1
    upper = start
    while upper < hi and epsilon_at(upper) > eps:
        upper = min(upper * factor, hi)
    lower = upper
    while True:
        lower = max(lower / factor, lo)
        if epsilon_at(lower) > eps:
            break
        if lower <= lo:
            return lo
        upper = lower
    sigma = float(
        dp_accounting.calibrate_dp_mechanism(
            fresh,
            make_event,
            eps,
            delta,
            dp_accounting.ExplicitBracketInterval(lower, upper),
            tol=tol,
        )
    )
    while epsilon_at(sigma) > eps:  # root finder landed on the unsafe side
        sigma += tol
    return sigma


def _largest_count(
    make_event: Callable[[int], dp_accounting.DpEvent],
    make_accountant: Callable[[], dp_accounting.PrivacyAccountant],
    target_epsilon: float,
    target_delta: float,
    cap: int,
    hint: int | None = None,
) -> int:
    """Largest n in [0, cap] whose event has ε <= target (ε non-decreasing in n).

    `hint`, if given, is a count believed to be a little below the answer (e.g. the RDP
    answer when searching with PLD); it only narrows the bracket, the result is checked.
    """
    cache: dict[str, float] = {}

    def epsilon_of(k: int) -> float:
        event = make_event(k)
        key = repr(event)  # many counts map to the same event (shuffle: epochs)
        if key not in cache:
            cache[key] = float(make_accountant().compose(event).get_epsilon(target_delta))
        return cache[key]

    if epsilon_of(1) > target_epsilon:
        return 0
    lower, upper, factor = 1, min(2, cap), 2.0
    if hint is not None and 1 < hint <= cap and epsilon_of(hint) <= target_epsilon:
        lower, upper, factor = hint, min(cap, math.ceil(hint * 1.25) + 1), 1.25
    while epsilon_of(upper) <= target_epsilon:
        if upper >= cap:
            return cap
        lower, upper = upper, min(math.ceil(upper * factor) + 1, cap)
    n = int(
        dp_accounting.calibrate_dp_mechanism(
            make_accountant,
            make_event,
            target_epsilon,
            target_delta,
            dp_accounting.ExplicitBracketInterval(lower, upper),
            discrete=True,
        )
    )
    n = min(max(n, 0), cap)
    while n > 0 and epsilon_of(n) > target_epsilon:  # make sure we are on the safe side
        n -= 1
    while n < cap and epsilon_of(n + 1) <= target_epsilon:
        n += 1
    return n


def calibrate_steps(
    *,
    target_epsilon: float,
    target_delta: float,
    noise_multiplier: float,
    sampling_prob: float,
    sampling: str = "poisson",
    accountant: str = "pld",
    neighboring: str = "add_remove",
    num_examples: int | None = None,
    ledger: PrivacyLedger | None = None,
    max_steps: int = DEFAULT_MAX_STEPS,
    pld_discretization: float = ev.DEFAULT_PLD_DISCRETIZATION,
) -> int:
    """The largest number of further logical steps that keeps the run within budget.

    Args:
      target_epsilon: ε > 0.
      target_delta: δ in (0, 1).
      noise_multiplier: σ of the further steps.
      sampling_prob: q of the further steps.
      sampling: `"poisson"` or `"shuffle"` (ignored when `ledger` is given).
      accountant: `"pld"` (default) or `"rdp"`.
      neighboring: `"add_remove"` (default) or `"replace_one"` (ignored with `ledger`).
      num_examples: N; needed for shuffle (epoch length) unless `ledger` is given.
      ledger: steps already spent (resumed run); the answer counts only further steps.
      max_steps: search cap; returned when even that many steps fit.
      pld_discretization: PLD value discretization interval (coarser: faster).

    Returns:
      n >= 0 such that the run with n further steps has ε <= target_epsilon and with n + 1
      would exceed it (or n = max_steps). 0 when even one step would exceed it.

    Privacy:
      Evaluates the same ledger events that the run will report.
    """
    eps = ev.check_epsilon(target_epsilon)
    delta = ev.check_delta(target_delta)
    sigma = ev.check_noise_multiplier(noise_multiplier)
    q = ev.check_sampling_prob(sampling_prob)
    cap = ev.check_positive_int(max_steps, "max_steps")
    if ledger is None:
        if num_examples is None:
            if sampling == "shuffle":
                raise ValueError("sampling='shuffle' needs num_examples (or a ledger).")
            num_examples = max(1, round(1.0 / q))
        base = PrivacyLedger(num_examples=num_examples, sampling=sampling, neighboring=neighboring)
    else:
        base = ledger
    neighboring = base.neighboring

    def fresh() -> dp_accounting.PrivacyAccountant:
        return ev.make_accountant(
            accountant, neighboring=neighboring, pld_discretization=pld_discretization
        )

    fresh()  # validates the accountant settings early

    def make_event(k: int) -> dp_accounting.DpEvent:
        trial = base.copy()
        trial.record_steps(steps=int(k), noise_multiplier=sigma, sampling_prob=q)
        return trial.dp_event()

    hint = None
    if accountant == "pld" and neighboring == "add_remove":
        hint = calibrate_steps(
            target_epsilon=eps,
            target_delta=delta,
            noise_multiplier=sigma,
            sampling_prob=q,
            accountant="rdp",
            ledger=base,
            max_steps=cap,
        )

    if base.sampling != "shuffle":
        return _largest_count(make_event, fresh, eps, delta, cap, hint=hint)
    # Shuffle: ε only changes when a step opens a new epoch, so search over whole epochs:
    # k further steps = `fill` (the rest of the open epoch) + m whole epochs.
    if _epsilon(make_event(1), fresh, delta) > eps:
        return 0
    fill = base.steps_left_in_epoch(sampling_prob=q)
    spe = base.steps_per_epoch(sampling_prob=q)
    if fill >= cap:
        return cap
    m = _largest_count(
        lambda m: make_event(fill + m * spe),
        fresh,
        eps,
        delta,
        max(1, (cap - fill) // spe),
        hint=None if not hint else max(1, (hint - fill) // spe),
    )
    return min(cap, fill + m * spe)


def _epsilon(
    event: dp_accounting.DpEvent,
    make_accountant: Callable[[], dp_accounting.PrivacyAccountant],
    target_delta: float,
) -> float:
    return float(make_accountant().compose(event).get_epsilon(target_delta))
