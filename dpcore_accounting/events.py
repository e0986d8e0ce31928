"""DpEvents of DP-SGD runs and their (ε, δ), computed with dp-accounting.

Contract:
  * Every privacy figure dpcore reports comes from a `dp_accounting` accountant applied to a
    `DpEvent` built here; no privacy math is written by hand.
  * Poisson sampling (each example joins each logical step independently with probability q):
    `poisson_event` = `SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(σ)), steps)`.
  * Shuffled fixed-size batches are not Poisson sampling. `shuffle_event` is the sound bound
    that uses no amplification: each example is in exactly one batch per epoch, so an epoch
    is one Gaussian mechanism of noise multiplier σ for that example, and E epochs (a partial
    epoch counts as a whole one) compose as `SelfComposedDpEvent(GaussianDpEvent(σ), E)`.
    A Poisson figure for shuffled batches is only ever an explicitly labelled assumption.
  * The clipped sum has sensitivity C under add/remove-one adjacency (`"add_remove"`, the
    default). Under `"replace_one"` the PLD accountant accounts for the doubled sensitivity.
    dp-accounting's RDP accountant does not support replace-one for these events (it rejects
    it for Poisson sampling and would silently ignore it for a plain Gaussian), so RDP with
    `"replace_one"` is refused here rather than reported wrongly.
  * Invalid inputs raise `ValueError` naming the argument and the value received.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Iterable
from typing import Any, TypeGuard

import dp_accounting
from dp_accounting import dp_event, pld
from dp_accounting.pld import privacy_loss_distribution

from dpcore_accounting._rdp import QuietRdpAccountant

__all__ = [
    "ACCOUNTANTS",
    "NEIGHBORING_RELATIONS",
    "SAMPLING_MODES",
    "compute_delta",
    "compute_epsilon",
    "compute_group_epsilon",
    "make_accountant",
    "neighboring_relation",
    "poisson_event",
    "shuffle_epochs",
    "shuffle_event",
    "shuffle_steps_per_epoch",
    "steps_for_epochs",
    "user_event",
]

SAMPLING_MODES = ("poisson", "shuffle")
ACCOUNTANTS = ("pld", "rdp")
NEIGHBORING_RELATIONS = {
    "add_remove": dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
    "replace_one": dp_accounting.NeighboringRelation.REPLACE_ONE,
}


# ------------------------------------------------------------------------------- validation
def _as_real(value: object) -> float | None:
    """`value` as a float when it is one real number, else None.

    Python and numpy numbers and 0-d arrays (or eager tensors) count; bools, strings, None and
    sequences do not, so `True` is never taken for 1.
    """
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(type(value), "__float__") and getattr(value, "ndim", None) == 0:
        try:
            return float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return None
    return None


def _is_number(value: object) -> TypeGuard[int | float]:
    return _as_real(value) is not None


def _bounds(low: float, high: float, low_open: bool, high_open: bool, integer: bool) -> str:
    kind = "an integer" if integer else "a number"
    if math.isfinite(low) and math.isfinite(high):
        return f"{kind} in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if math.isfinite(low):
        kind = kind if integer else "a finite number"
        return f"{kind} {'>' if low_open else '>='} {low:g}"
    return f"a finite {kind[2:]}"


def check_number(
    value: object,
    name: str,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    integer: bool = False,
    allow_inf: bool = False,
    expected: str | None = None,
) -> float:
    """The one check of every numeric privacy argument: `value` as a float, else ValueError.

    `value` must be a real number (not a bool, a string or None) within `[low, high]` (an end
    excluded with `low_open` / `high_open`), finite unless `allow_inf` (NaN never passes), and
    whole with `integer`. The error names the argument, says what it must be (`expected`, or
    the bounds in words) and shows the value received.
    """
    number = _as_real(value)
    ok = number is not None and not math.isnan(number)
    if ok and number is not None:
        ok = (
            (allow_inf or math.isfinite(number))
            and (low < number if low_open else low <= number)
            and (number < high if high_open else number <= high)
            and (not integer or (math.isfinite(number) and number == int(number)))
        )
    if not ok or number is None:
        what = expected or _bounds(low, high, low_open, high_open, integer)
        raise ValueError(f"{name} must be {what}, got {value!r}.")
    return number


def check_sampling_prob(sampling_prob: object, name: str = "sampling_prob") -> float:
    """Returns `sampling_prob` as a float in (0, 1], else raises ValueError."""
    return check_number(sampling_prob, name, low=0.0, high=1.0, low_open=True, expected="in (0, 1]")


def check_delta(target_delta: object, name: str = "target_delta") -> float:
    """Returns `target_delta` as a float in (0, 1), else raises ValueError."""
    return check_number(
        target_delta, name, low=0.0, high=1.0, low_open=True, high_open=True, expected="in (0, 1)"
    )


def check_epsilon(target_epsilon: object, name: str = "target_epsilon") -> float:
    """Returns `target_epsilon` as a finite float > 0, else raises ValueError."""
    return check_number(target_epsilon, name, low=0.0, low_open=True)


def check_noise_multiplier(noise_multiplier: object, name: str = "noise_multiplier") -> float:
    """Returns `noise_multiplier` as a finite float >= 0, else raises ValueError."""
    return check_number(noise_multiplier, name, low=0.0)


def check_positive_int(value: object, name: str) -> int:
    """Returns `value` as an int >= 1 (integral floats accepted), else raises ValueError."""
    return int(check_number(value, name, low=1, integer=True))


def check_batch_size(expected_batch_size: object, *, num_examples: int) -> float:
    """Returns `expected_batch_size` as a float in (0, num_examples], else raises ValueError."""
    return check_number(
        expected_batch_size,
        "expected_batch_size",
        low=0.0,
        high=num_examples,
        low_open=True,
        expected=f"in (0, num_examples={num_examples}]",
    )


def check_choice(value: object, choices: Iterable[str], name: str) -> str:
    """Returns `value` if it is one of `choices`, else raises ValueError."""
    if value not in tuple(choices):
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}.")
    return str(value)


def neighboring_relation(neighboring: str) -> dp_accounting.NeighboringRelation:
    """Maps `"add_remove"` / `"replace_one"` to `dp_accounting.NeighboringRelation`."""
    check_choice(neighboring, NEIGHBORING_RELATIONS, "neighboring")
    return NEIGHBORING_RELATIONS[neighboring]


# ----------------------------------------------------------------------------------- events
def poisson_event(
    *, noise_multiplier: float, sampling_prob: float, steps: int
) -> dp_accounting.DpEvent:
    """The DpEvent of `steps` Poisson-sampled Gaussian steps.

    Args:
      noise_multiplier: σ; the noise std on the clipped sum is σ · C.
      sampling_prob: q, the probability that an example joins a logical step, in (0, 1].
      steps: number of logical steps (noise added once each), >= 1.

    Returns:
      `SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(σ)), steps)`.

    Privacy:
      Valid only if batches really are Poisson samples with fresh randomness per step.
    """
    sigma = check_noise_multiplier(noise_multiplier)
    q = check_sampling_prob(sampling_prob)
    n = check_positive_int(steps, "steps")
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), n
    )


def shuffle_steps_per_epoch(*, num_examples: int, batch_size: int) -> int:
    """Logical steps in one pass of shuffled fixed-size batches: ceil(N / B).

    The last, partial batch is padded and masked (see `dpcore.sampling.shuffled_batches`).
    """
    n = check_positive_int(num_examples, "num_examples")
    b = check_positive_int(batch_size, "batch_size")
    if b > n:
        raise ValueError(f"batch_size must be <= num_examples={n}, got {batch_size!r}.")
    return -(-n // b)


def steps_for_epochs(
    epochs: float,
    *,
    num_examples: int,
    expected_batch_size: float,
    sampling: str = "poisson",
) -> int:
    """Logical steps after `epochs` passes over the data: the one definition dpcore uses.

    One epoch is S = ceil(N / B) logical steps, for both sampling modes: the batches that cover
    the data once (Keras's `fit(batch_size=B)` count, a shuffled pass with its last batch
    padded, Opacus's Poisson loader length); a Poisson epoch's expected examples S · B are at
    least N. E epochs are ceil(E · S) steps, so whole epochs are whole multiples of S:
    `steps_for_epochs(E) == E * steps_for_epochs(1)` for every integer E, and
    `DPConfig.from_epochs`, `DPModel.fit(x, y, epochs=E)` (S steps per Keras epoch), the CLI
    and the training scripts count the same steps. TF Privacy's statement counts
    ceil(E · N / B) instead (fewer steps than its own Keras training runs when B does not
    divide N); give `steps=` for its figure.

    Args:
      epochs: E > 0 (may be fractional); 0 gives 0 steps.
      num_examples: N >= 1.
      expected_batch_size: B in (0, N] (a whole number for shuffle).
      sampling: `"poisson"` or `"shuffle"`.

    Returns:
      The step count, >= 1 for E > 0.
    """
    check_choice(sampling, SAMPLING_MODES, "sampling")
    passes = check_number(epochs, "epochs", low=0.0)
    n = check_positive_int(num_examples, "num_examples")
    batch = check_batch_size(expected_batch_size, num_examples=n)
    if passes == 0:
        return 0
    if sampling == "shuffle":
        spe = shuffle_steps_per_epoch(num_examples=n, batch_size=int(batch))
    else:
        spe = max(1, math.ceil(n / batch - 1e-9))
    return max(1, math.ceil(passes * spe - 1e-9))


def shuffle_epochs(*, steps: int, steps_per_epoch: int) -> int:
    """Number of (possibly partial) epochs that `steps` steps touch: ceil(steps / spe)."""
    n = check_positive_int(steps, "steps")
    spe = check_positive_int(steps_per_epoch, "steps_per_epoch")
    return -(-n // spe)


def shuffle_event(
    *,
    noise_multiplier: float,
    steps_per_epoch: int,
    epochs: float | None = None,
    steps: int | None = None,
) -> dp_accounting.DpEvent:
    """The sound, no-amplification DpEvent of shuffled fixed-size batches.

    Give exactly one of `epochs` (may be fractional) or `steps`. Each example is used in one
    step per epoch, so each (possibly partial) epoch is one Gaussian mechanism of noise
    multiplier σ for it, and the epochs compose.

    Args:
      noise_multiplier: σ.
      steps_per_epoch: logical steps in one pass over the data (ceil(N / B)), >= 1.
      epochs: passes over the data, > 0; rounded up.
      steps: logical steps run, >= 1; epochs = ceil(steps / steps_per_epoch).

    Returns:
      `SelfComposedDpEvent(GaussianDpEvent(σ), ceil(epochs))`.

    Privacy:
      Assumes nothing about the order of batches (no amplification by shuffling). The bound is
      for neighbouring datasets that keep every batch position: one example replaced by a null
      one that contributes nothing (zero-out; what ``"add_remove"`` means for this event) or by
      another example (``"replace_one"``, sensitivity 2C). Truly adding or removing an example
      shifts the later examples of a fixed-size batching into other batches, which this
      per-epoch argument does not cover.
    """
    sigma = check_noise_multiplier(noise_multiplier)
    spe = check_positive_int(steps_per_epoch, "steps_per_epoch")
    if (epochs is None) == (steps is None):
        raise ValueError(
            f"give exactly one of epochs or steps, got epochs={epochs!r}, steps={steps!r}."
        )
    if steps is not None:
        count = shuffle_epochs(steps=steps, steps_per_epoch=spe)
    else:
        count = math.ceil(check_number(epochs, "epochs", low=0, low_open=True) - 1e-12)
    return dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(sigma), count)


# ------------------------------------------------------------------------------ accountants
DEFAULT_PLD_DISCRETIZATION = 1e-4


@functools.lru_cache(maxsize=8)
def _subsampled_gaussian_pld(
    noise_multiplier: float,
    sampling_prob: float,
    value_discretization_interval: float,
    relation: dp_accounting.NeighboringRelation,
) -> Any:
    """dp-accounting's PLD of one Poisson-subsampled Gaussian step, built once per setting.

    Building it is most of the cost of a PLD figure; a run's ε is asked again after every epoch
    with the same (σ, q), and only the number of steps changes.
    """
    return privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=noise_multiplier,
        value_discretization_interval=value_discretization_interval,
        sampling_prob=sampling_prob,
        neighboring_relation=relation,
    )


class _CachedPldAccountant(pld.PLDAccountant):
    """dp-accounting's `PLDAccountant`, reusing the PLD of one Poisson-subsampled Gaussian step.

    It composes exactly what `PLDAccountant` composes (the same dp-accounting PLD,
    `self_compose(count)`, then `compose`), so every figure is the same number; only the one-step
    PLD of a (σ, q) already seen in this process is not built again. Every other event goes to
    `PLDAccountant` itself.
    """

    def _maybe_compose(self, event: dp_accounting.DpEvent, count: int, do_compose: bool) -> Any:
        if (
            do_compose
            and isinstance(event, dp_accounting.PoissonSampledDpEvent)
            and isinstance(event.event, dp_accounting.GaussianDpEvent)
            and event.sampling_probability != 0
            and event.event.noise_multiplier != 0
        ):
            one_step = _subsampled_gaussian_pld(
                float(event.event.noise_multiplier),
                float(event.sampling_probability),
                float(self._value_discretization_interval),
                self.neighboring_relation,
            )
            composed = self._pld.compose(one_step.self_compose(count))  # type: ignore[has-type]
            self._pld = composed
            return None
        return super()._maybe_compose(event, count, do_compose)


def make_accountant(
    accountant: str = "pld",
    *,
    neighboring: str = "add_remove",
    pld_discretization: float = DEFAULT_PLD_DISCRETIZATION,
) -> dp_accounting.PrivacyAccountant:
    """A fresh dp-accounting accountant: `"pld"` (default) or `"rdp"`.

    `pld_discretization` is the PLD accountant's `value_discretization_interval`. PLD
    discretization is pessimistic, so a coarser interval (e.g. 1e-3, faster) still gives an
    upper bound on ε, just a slightly larger one.

    The RDP accountant is dp-accounting's `RdpAccountant` that drops its "failed to converge"
    warnings (one per fractional order it excludes) while composing; see
    `dpcore_accounting._rdp`.

    Raises:
      ValueError: unknown accountant or neighboring relation, or RDP with `"replace_one"`
        (unsupported by dp-accounting's RDP accountant for DP-SGD events).
    """
    check_choice(accountant, ACCOUNTANTS, "accountant")
    relation = neighboring_relation(neighboring)
    if accountant == "pld":
        if not _is_number(pld_discretization) or not 0 < float(pld_discretization) <= 0.1:
            raise ValueError(f"pld_discretization must be in (0, 0.1], got {pld_discretization!r}.")
        return _CachedPldAccountant(
            neighboring_relation=relation, value_discretization_interval=float(pld_discretization)
        )
    if neighboring != "add_remove":
        raise ValueError(
            f"accountant='rdp' supports only neighboring='add_remove' for DP-SGD events, got "
            f"neighboring={neighboring!r}; use accountant='pld' for replace-one adjacency."
        )
    return QuietRdpAccountant(neighboring_relation=relation)


def _composed(
    event: dp_accounting.DpEvent, accountant: str, neighboring: str, pld_discretization: float
) -> dp_accounting.PrivacyAccountant:
    if not isinstance(event, dp_accounting.DpEvent):
        raise ValueError(f"event must be a dp_accounting.DpEvent, got {event!r}.")
    acc = make_accountant(
        accountant, neighboring=neighboring, pld_discretization=pld_discretization
    )
    if not acc.supports(event):
        raise ValueError(
            f"accountant={accountant!r} with neighboring={neighboring!r} does not support "
            f"event={event!r}."
        )
    acc.compose(event)
    return acc


def compute_epsilon(
    event: dp_accounting.DpEvent,
    *,
    target_delta: float,
    accountant: str = "pld",
    neighboring: str = "add_remove",
    pld_discretization: float = DEFAULT_PLD_DISCRETIZATION,
) -> float:
    """ε of `event` at δ = `target_delta`, from a dp-accounting accountant.

    Args:
      event: the DpEvent of the whole run (e.g. `poisson_event(...)`, a ledger's event).
      target_delta: δ in (0, 1).
      accountant: `"pld"` (default, tighter) or `"rdp"`.
      neighboring: `"add_remove"` (default) or `"replace_one"`.
      pld_discretization: PLD value discretization interval (coarser: faster, still an
        upper bound).

    Returns:
      ε (`math.inf` when the event contains a non-private step, e.g. σ = 0).

    Privacy:
      The figure is only as true as the event: build it from what actually ran.
    """
    delta = check_delta(target_delta)
    return float(_composed(event, accountant, neighboring, pld_discretization).get_epsilon(delta))


def compute_delta(
    event: dp_accounting.DpEvent,
    *,
    target_epsilon: float,
    accountant: str = "pld",
    neighboring: str = "add_remove",
    pld_discretization: float = DEFAULT_PLD_DISCRETIZATION,
) -> float:
    """δ of `event` at ε = `target_epsilon`, from a dp-accounting accountant.

    Args:
      event: the DpEvent of the whole run.
      target_epsilon: ε > 0.
      accountant: `"pld"` (default) or `"rdp"`.
      neighboring: `"add_remove"` (default) or `"replace_one"`.
      pld_discretization: PLD value discretization interval.

    Returns:
      δ in [0, 1].

    Privacy:
      The figure is only as true as the event: build it from what actually ran.
    """
    eps = check_epsilon(target_epsilon)
    return float(_composed(event, accountant, neighboring, pld_discretization).get_delta(eps))


def _log_expm1(x: float) -> float:
    """log(e^x - 1) for x > 0, without overflow for large x."""
    return x + math.log(-math.expm1(-x))


_LOG_TEN = math.log(10.0)
_SMALLEST_LOG_DELTA = math.log(1e-300)


def user_event(
    event: dp_accounting.DpEvent, *, max_examples_per_user: int
) -> dp_accounting.DpEvent | None:
    """The DpEvent of `event` for one user's at most k examples, where it is a DpEvent.

    A Gaussian mechanism of noise multiplier σ on a clipped sum (sensitivity C per example) has
    sensitivity k C for k examples: `GaussianDpEvent(σ / k)`, wherever the k examples fall in
    the steps of the mechanism (their shifts add to at most k C in L2). A Poisson-sampled
    Gaussian step takes each of the user's k examples independently with probability q: the
    sum moves by j C with the binomial probability of j, a `MixtureOfGaussiansDpEvent` (PLD,
    add/remove only). Compositions map part by part.

    Returns:
      The user-level event, or None when some part has no such form (then only group privacy
      on (ε, δ) applies, see `compute_group_epsilon`).
    """
    k = check_positive_int(max_examples_per_user, "max_examples_per_user")
    if isinstance(event, dp_accounting.NoOpDpEvent):
        return event
    if isinstance(event, dp_accounting.GaussianDpEvent):
        return dp_accounting.GaussianDpEvent(event.noise_multiplier / k)
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        inner = user_event(event.event, max_examples_per_user=k)
        return None if inner is None else dp_accounting.SelfComposedDpEvent(inner, event.count)
    if isinstance(event, dp_accounting.ComposedDpEvent):
        parts = [user_event(e, max_examples_per_user=k) for e in event.events]
        if any(p is None for p in parts):
            return None
        return dp_accounting.ComposedDpEvent(parts)
    if isinstance(event, dp_accounting.PoissonSampledDpEvent) and isinstance(
        event.event, dp_accounting.GaussianDpEvent
    ):
        q = float(event.sampling_probability)
        probs = [math.comb(k, j) * q**j * (1.0 - q) ** (k - j) for j in range(k + 1)]
        return dp_event.MixtureOfGaussiansDpEvent(
            event.event.noise_multiplier, [float(j) for j in range(k + 1)], probs
        )
    return None


def compute_group_epsilon(
    event: dp_accounting.DpEvent,
    *,
    max_examples_per_user: int,
    target_delta: float,
    accountant: str = "pld",
    neighboring: str = "add_remove",
    pld_discretization: float = DEFAULT_PLD_DISCRETIZATION,
) -> float:
    """User-level ε of an example-level `event`, for users with at most k examples each.

    The user-level ε at δ = `target_delta` of adding or removing (or, under `"replace_one"`,
    replacing) all of one user's examples, as TF Privacy's privacy statement reports it for
    `max_examples_per_user`:

    * where the accountant supports `user_event(event)` (Gaussian epochs with any accountant;
      Poisson steps with PLD and add/remove adjacency), that event's ε;
    * otherwise group privacy: an (ε₁, δ₁)-DP mechanism for one example is, for k examples,
      (k ε₁, δ₁ (e^(k ε₁) - 1) / (e^ε₁ - 1))-DP (Vadhan 2017, "The complexity of differential
      privacy", Lemma 2.2, with the sum its proof bounds). ε₁(δ₁) comes from the accountant
      composed once with `event`; the largest δ₁ (in decades, then bisection in log δ₁) whose
      group δ is at most `target_delta` gives k ε₁(δ₁).

    Args:
      event: the DpEvent of the example-level run.
      max_examples_per_user: k >= 1; k = 1 gives the example-level ε.
      target_delta: the user-level δ in (0, 1).
      accountant: `"pld"` (default) or `"rdp"`.
      neighboring: `"add_remove"` (default) or `"replace_one"`.
      pld_discretization: PLD value discretization interval.

    Returns:
      The user-level ε; `math.inf` when group privacy reaches no δ₁ whose group δ is as small as
      `target_delta` (a loose conversion: a finite example-level ε can give an infinite bound).

    Privacy:
      Covers every user with at most k examples; a user with more is not covered.
    """
    k = check_positive_int(max_examples_per_user, "max_examples_per_user")
    delta = check_delta(target_delta)
    if k == 1:
        return compute_epsilon(
            event,
            target_delta=delta,
            accountant=accountant,
            neighboring=neighboring,
            pld_discretization=pld_discretization,
        )
    grouped = user_event(event, max_examples_per_user=k)
    if grouped is not None:
        acc = make_accountant(
            accountant, neighboring=neighboring, pld_discretization=pld_discretization
        )
        if acc.supports(grouped):
            return compute_epsilon(
                grouped,
                target_delta=delta,
                accountant=accountant,
                neighboring=neighboring,
                pld_discretization=pld_discretization,
            )
    composed = _composed(event, accountant, neighboring, pld_discretization)
    log_target = math.log(delta)
    example_epsilons: dict[float, float] = {}

    def example_epsilon(log_delta: float) -> float:
        if log_delta not in example_epsilons:
            example_epsilons[log_delta] = float(composed.get_epsilon(math.exp(log_delta)))
        return example_epsilons[log_delta]

    def excess(log_delta: float) -> float:
        """log(group δ) - log(target δ) at the example-level δ₁ = exp(log_delta)."""
        eps = example_epsilon(log_delta)
        if not math.isfinite(eps):
            return math.inf
        # (e^(k ε) - 1) / (e^ε - 1) tends to k as ε -> 0.
        growth = math.log(k) if eps <= 0 else _log_expm1(k * eps) - _log_expm1(eps)
        return log_delta + growth - log_target

    # The group δ is at least δ₁, so δ₁ < δ: step down a decade at a time to a δ₁ whose group δ
    # is small enough (lo), keeping the last one whose group δ was not (hi).
    hi = log_target
    lo = hi - _LOG_TEN
    while excess(lo) > 0:
        if not math.isfinite(excess(lo)) or lo < _SMALLEST_LOG_DELTA:
            return math.inf
        hi, lo = lo, lo - _LOG_TEN
    while hi - lo > 1e-12 * max(1.0, abs(lo)):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if excess(mid) > 0:
            hi = mid
        else:
            lo = mid
    return k * example_epsilon(lo)  # the group δ at lo is <= target_delta
