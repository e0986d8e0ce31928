"""Tests for the one-run privacy audit: dpcore.audit (the bound, canaries) and experiments/audit.py."""

import json
import math
import os

import numpy as np
import pytest

from dpcore import audit


def _bound(m, r, v, delta=0.0, beta=0.05):
    return audit.epsilon_lower_bound(
        num_canaries=m, num_guesses=r, num_correct=v, delta=delta, beta=beta
    )


# ----------------------------------------------------------------------------------- bound
def test_all_correct_guesses_give_a_large_bound():
    # Pure DP: all r correct is rejected while q^r < beta, i.e. ε ≈ log(r / log(1/β)).
    assert _bound(1000, 1000, 1000) > 5.5
    q = 0.05 ** (1 / 100)  # P[Bin(100, q) = 100] = beta
    assert _bound(1000, 100, 100) == pytest.approx(math.log(q / (1 - q)), abs=1e-4)
    assert _bound(1000, 1000, 1000) > _bound(1000, 100, 100) > _bound(1000, 10, 10) > 0


def test_chance_level_guesses_give_zero():
    assert _bound(1000, 1000, 500) == 0.0
    assert _bound(1000, 1000, 520, delta=1e-5) == 0.0  # within noise of r/2
    assert _bound(1000, 200, 100) == 0.0
    assert _bound(1000, 0, 0) == 0.0


def test_bound_is_monotone_in_correct_guesses():
    for delta in (0.0, 1e-5, 1e-3):
        bounds = [_bound(500, 200, v, delta=delta) for v in range(90, 201)]
        assert all(b2 >= b1 for b1, b2 in zip(bounds, bounds[1:]))
        assert bounds[0] == 0.0 and bounds[-1] > (3.0 if delta <= 1e-5 else 2.0)


def test_delta_never_increases_the_bound():
    for r, v in [(1000, 1000), (1000, 700), (400, 380), (100, 90), (20, 20)]:
        b0 = _bound(1000, r, v)
        b5 = _bound(1000, r, v, delta=1e-5)
        b2 = _bound(1000, r, v, delta=1e-2)
        assert b2 <= b5 <= b0
    assert _bound(1000, 1000, 1000, delta=1e-2) < _bound(1000, 1000, 1000) - 0.5


def test_p_value_matches_the_binomial_tail_and_delta_term():
    # δ = 0: exactly P[Bin(r, q) >= v]; check against a direct sum with math.comb.
    eps, r, v = 1.3, 40, 31
    q = math.exp(eps) / (1 + math.exp(eps))
    pmf = [math.comb(r, j) * q**j * (1 - q) ** (r - j) for j in range(r + 1)]
    tail = sum(pmf[v:])
    got = audit.p_value(epsilon=eps, delta=0.0, num_canaries=100, num_guesses=r, num_correct=v)
    assert got == pytest.approx(tail, rel=1e-10)
    alpha = max(sum(pmf[v - i : v]) / i for i in range(1, v + 1))
    got_delta = audit.p_value(
        epsilon=eps, delta=1e-4, num_canaries=100, num_guesses=r, num_correct=v
    )
    assert got_delta == pytest.approx(tail + 2 * 100 * 1e-4 * alpha, rel=1e-10)
    # The reported bound is where the p-value crosses beta.
    b = _bound(100, r, v, delta=1e-4)
    kw = dict(delta=1e-4, num_canaries=100, num_guesses=r, num_correct=v)
    assert audit.p_value(epsilon=b, **kw) < 0.05 <= audit.p_value(epsilon=b + 1e-4, **kw)


def test_bound_rejects_bad_counts():
    with pytest.raises(ValueError, match="num_correct <= num_guesses"):
        _bound(10, 5, 6)
    with pytest.raises(ValueError, match="num_canaries"):
        _bound(10, 11, 3)
    with pytest.raises(ValueError, match="beta"):
        _bound(10, 10, 10, beta=1.0)


@pytest.mark.parametrize("delta", [0.0, 1e-5])
def test_randomized_response_bound_stays_below_its_true_epsilon(delta):
    """A mechanism that is exactly ε-DP per canary (randomized response on the coins)."""
    rng = np.random.default_rng(7)
    true_eps, m, runs = 1.0, 1000, 200
    keep = math.exp(true_eps) / (1 + math.exp(true_eps))
    bounds = []
    for _ in range(runs):
        coins = rng.random(m) < 0.5
        truthful = rng.random(m) < keep
        answer = np.where(truthful, coins, ~coins)
        scores = answer + 1e-3 * rng.random(m)  # the output only; ties broken at random
        result = audit.audit_scores(scores, coins, delta=delta, guess_counts=[m // 2])
        bounds.append(result.epsilon_lower_bound)
    bounds = np.array(bounds)
    assert np.mean(bounds > true_eps) <= 0.05
    assert np.median(bounds) > 0.6  # and the audit is not vacuous: it gets close to ε = 1


# -------------------------------------------------------------------------------- guesses
def test_guesses_and_counts():
    scores = np.array([0.9, -1.0, 0.5, 0.1, 2.0, -3.0])
    g = audit.guesses_from_scores(scores, num_in=2)
    np.testing.assert_array_equal(g, [1, -1, 0, 0, 1, -1])
    g = audit.guesses_from_scores(scores, num_in=1, num_out=3)
    np.testing.assert_array_equal(g, [0, -1, 0, -1, 1, -1])
    coins = np.array([True, False, True, True, False, False])
    assert audit.count_correct(audit.guesses_from_scores(scores, num_in=2), coins) == (4, 3)
    with pytest.raises(ValueError, match="num_in"):
        audit.guesses_from_scores(scores, num_in=4)


def test_audit_scores_uses_bonferroni_over_guess_counts():
    rng = np.random.default_rng(0)
    coins = rng.random(400) < 0.5
    scores = np.where(coins, 1.0, -1.0) + 0.1 * rng.standard_normal(400)  # perfect separation
    one = audit.audit_scores(scores, coins, delta=1e-5, guess_counts=[100])
    many = audit.audit_scores(scores, coins, delta=1e-5, guess_counts=[1, 10, 100])
    assert one.best["num_correct"] == 200 and one.num_included == int(coins.sum())
    assert one.epsilon_lower_bound == pytest.approx(
        _bound(400, 200, 200, delta=1e-5, beta=0.05), abs=1e-5
    )
    assert many.best["k"] == 100
    assert many.epsilon_lower_bound == pytest.approx(
        _bound(400, 200, 200, delta=1e-5, beta=0.05 / 3), abs=1e-5
    )
    assert many.epsilon_lower_bound < one.epsilon_lower_bound
    assert audit.default_guess_counts(1000) == [1, 2, 5, 10, 20, 50, 100, 200, 500]
    assert audit.default_guess_counts(7) == [1, 2, 3]


def test_loss_scores():
    np.testing.assert_allclose(audit.loss_scores([0.5, 2.0]), [-0.5, -2.0])
    np.testing.assert_allclose(audit.loss_scores([0.5, 2.0], [3.0, 2.5]), [2.5, 0.5])
    logits = np.array([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
    expected = [np.log(np.exp(logits[0]).sum()) - 0.0, np.log(3.0)]
    np.testing.assert_allclose(audit.softmax_cross_entropy(logits, [1, 2]), expected)


# ------------------------------------------------------------------------------- canaries
def _pool(n=300, classes=10, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.random((n, 4, 4)).astype(np.float32)
    y = rng.integers(0, classes, n).astype(np.int32)
    return x, y


def test_random_label_canaries_insertion():
    x, y = _pool()
    canaries = audit.random_label_canaries(x, y, num_canaries=120, num_classes=10, seed=5)
    assert canaries.num_canaries == 120
    assert len(np.unique(canaries.source_indices)) == 120
    np.testing.assert_array_equal(canaries.inputs, x[canaries.source_indices])
    np.testing.assert_array_equal(canaries.original_labels, y[canaries.source_indices])
    assert np.all(canaries.labels != canaries.original_labels)  # random labels are wrong labels
    assert set(np.unique(canaries.labels)) <= set(range(10))
    assert len(np.unique(canaries.labels)) > 5  # spread over classes, not one fixed shift
    x_base, y_base = canaries.non_canary(x, y)
    assert len(y_base) == 300 - 120
    x_train, y_train = canaries.insert(x_base, y_base)
    k = canaries.num_included
    assert 0 < k < 120 and len(y_train) == 180 + k
    np.testing.assert_array_equal(x_train[180:], canaries.inputs[canaries.included])
    np.testing.assert_array_equal(y_train[180:], canaries.labels[canaries.included])
    # No canary input is also left among the non-canary examples (each is in by its coin only).
    rows = {row.tobytes() for row in x_base}
    assert not any(row.tobytes() in rows for row in canaries.inputs)


def test_coins_are_reproducible_from_the_seed_and_fair():
    a = audit.draw_inclusion(5000, seed=11)
    np.testing.assert_array_equal(a, audit.draw_inclusion(5000, seed=11))
    assert not np.array_equal(a, audit.draw_inclusion(5000, seed=12))
    assert abs(a.mean() - 0.5) < 0.03
    x, y = _pool()
    c1 = audit.random_label_canaries(x, y, num_canaries=50, num_classes=10, seed=4)
    c2 = audit.random_label_canaries(x, y, num_canaries=50, num_classes=10, seed=4)
    np.testing.assert_array_equal(c1.included, c2.included)
    np.testing.assert_array_equal(c1.labels, c2.labels)
    np.testing.assert_array_equal(c1.source_indices, c2.source_indices)
    np.testing.assert_array_equal(c1.included, audit.draw_inclusion(50, seed=4))
    with pytest.raises(ValueError, match="seed"):
        audit.draw_inclusion(5, seed=-1)
    with pytest.raises(ValueError, match="num_canaries"):
        audit.random_label_canaries(x, y, num_canaries=301, num_classes=10, seed=0)


# -------------------------------------------------------------------------- experiment
def _settings(tmp_path, **overrides):
    from dpcore_experiments import audit as audit_exp

    base = dict(
        dataset="digits",
        num_canaries=400,
        epochs=3,
        batch_size=128,
        target_epsilon=None,
        noise_multiplier=None,
        dp=False,
        seed=0,
        verbose=0,
        output_dir=str(tmp_path),
    )
    base.update(overrides)
    return audit_exp.AuditSettings(**base)


@pytest.mark.slow
def test_nonprivate_audit_run_finds_a_positive_bound(tmp_path):
    from dpcore_experiments import audit as audit_exp

    settings = _settings(tmp_path, epochs=80, log_every=80)
    results = audit_exp.run_audit(settings)
    with open(os.path.join(tmp_path, audit_exp.RESULTS_FILE)) as f:
        saved = json.load(f)
    for key in ("settings", "privacy", "audit", "epsilon_lower_bound", "claimed_epsilon"):
        assert key in saved
    assert saved["claimed_epsilon"] == math.inf
    assert saved["audit"]["num_canaries"] == 400
    assert {"k", "num_guesses", "num_correct", "epsilon_lower_bound"} <= set(
        saved["audit"]["per_guess_count"][0]
    )
    assert os.path.getsize(os.path.join(tmp_path, audit_exp.PLOT_FILE)) > 1000
    assert results["epsilon_lower_bound"] > 1.0  # σ = 0, C = inf: canaries are memorized
    assert saved["canaries"]["mean_loss_included"] < saved["canaries"]["mean_loss_excluded"]


def test_dp_audit_run_stays_below_claimed_epsilon(tmp_path):
    from dpcore_experiments import audit as audit_exp

    settings = _settings(tmp_path, dp=True, target_epsilon=2.0, epochs=3)
    results = audit_exp.run_audit(settings)
    privacy = results["privacy"]
    assert privacy["dp"] and privacy["epsilon"] <= 2.0 + 1e-6
    pool = results["dataset"]["pool_size"]
    # q and the steps come from the pool, not from the coins: the claimed ε is coin-independent.
    assert privacy["sampling_prob"] == pytest.approx(128 / pool)
    assert privacy["steps"] == 3 * math.ceil(pool / 128)  # steps_for_epochs(3)
    assert results["dataset"]["num_train"] == (
        results["dataset"]["pool_size"] - 400 + results["audit"]["num_included"]
    )
    assert 0.0 <= results["epsilon_lower_bound"] <= privacy["epsilon"]
    assert os.path.exists(os.path.join(tmp_path, audit_exp.PLOT_FILE))


def test_audit_settings_validation(tmp_path):
    with pytest.raises(ValueError, match="exactly one"):
        _settings(tmp_path, dp=True)
    with pytest.raises(ValueError, match="l2_norm_clip"):
        _settings(tmp_path, dp=True, target_epsilon=2.0, l2_norm_clip=math.inf)
    with pytest.raises(ValueError, match="score"):
        _settings(tmp_path, score="margin")
