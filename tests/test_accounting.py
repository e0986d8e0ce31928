"""dpcore.accounting: events, ε/δ, calibration and the ledger against dp-accounting itself."""

import math
import subprocess
import sys
import textwrap
import warnings

import dp_accounting
import pytest
from dp_accounting import pld, rdp

from dpcore import accounting as acc
from dpcore.accounting import calibration
from dpcore.config import DPConfig

CLASSIC = dict(noise_multiplier=1.1, sampling_prob=256 / 60000, steps=math.ceil(60 * 60000 / 256))


FAST = 1e-3  # PLD discretization for tests (pessimistic: still an upper bound, ~10x faster)


def _direct(event, accountant, delta, interval=FAST):
    """The slow exact reference: a fresh dp-accounting accountant, composed by hand."""
    relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    a = (
        pld.PLDAccountant(neighboring_relation=relation, value_discretization_interval=interval)
        if accountant == "pld"
        else rdp.RdpAccountant(neighboring_relation=relation)
    )
    return a.compose(event).get_epsilon(delta)


# ------------------------------------------------------------------------------------ events
def test_poisson_event_is_the_self_composed_poisson_gaussian():
    event = acc.poisson_event(noise_multiplier=1.3, sampling_prob=0.01, steps=7)
    assert event == dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.3)), 7
    )


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_epsilon_equals_direct_dp_accounting_call(accountant):
    event = acc.poisson_event(noise_multiplier=0.9, sampling_prob=0.02, steps=300)
    expected = _direct(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(0.9)), 300
        ),
        accountant,
        1e-6,
    )
    got = acc.compute_epsilon(
        event, target_delta=1e-6, accountant=accountant, pld_discretization=FAST
    )
    assert got == expected
    assert 0 < got < math.inf


def test_classic_check_rdp_and_pld():
    """N=60000, batch 256, 60 epochs, σ 1.1, Poisson, δ=1e-5 (dp-accounting 0.6.0)."""
    event = acc.poisson_event(**CLASSIC)
    assert acc.compute_epsilon(event, target_delta=1e-5, accountant="rdp") == pytest.approx(
        2.597, abs=1e-3
    )
    assert acc.compute_epsilon(event, target_delta=1e-5, accountant="pld") == pytest.approx(
        2.382, abs=1e-3
    )


def test_delta_for_epsilon_inverts_epsilon_for_delta():
    event = acc.poisson_event(noise_multiplier=1.0, sampling_prob=0.05, steps=100)
    kw = dict(pld_discretization=FAST)
    eps = acc.compute_epsilon(event, target_delta=1e-5, **kw)
    delta = acc.compute_delta(event, target_epsilon=eps, **kw)
    assert delta <= 1e-5 * (1 + 1e-6)
    assert delta > 0.5e-5
    # and a larger ε always buys a smaller δ
    assert acc.compute_delta(event, target_epsilon=eps * 1.5, **kw) < delta


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_epsilon_is_monotone_in_sigma_q_and_steps(accountant):
    def eps(sigma=1.0, q=0.02, steps=200):
        event = acc.poisson_event(noise_multiplier=sigma, sampling_prob=q, steps=steps)
        return acc.compute_epsilon(
            event, target_delta=1e-5, accountant=accountant, pld_discretization=FAST
        )

    by_sigma = [eps(sigma=s) for s in (0.8, 1.0, 1.5, 3.0)]
    by_q = [eps(q=q) for q in (0.005, 0.01, 0.02, 0.05)]
    by_steps = [eps(steps=n) for n in (10, 50, 200, 800)]
    assert by_sigma == sorted(by_sigma, reverse=True) and len(set(by_sigma)) == 4
    assert by_q == sorted(by_q) and len(set(by_q)) == 4
    assert by_steps == sorted(by_steps) and len(set(by_steps)) == 4


def test_shuffle_event_composes_one_gaussian_per_started_epoch():
    event = acc.shuffle_event(noise_multiplier=5.0, steps_per_epoch=10, steps=31)
    assert event == dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(5.0), 4)
    assert acc.shuffle_event(noise_multiplier=5.0, steps_per_epoch=10, epochs=3.2) == event
    # Exact reference: 4 composed Gaussians of σ are one Gaussian of σ / 2.
    exact = dp_accounting.get_epsilon_gaussian(5.0 / 2.0, 1e-5)
    got = acc.compute_epsilon(event, target_delta=1e-5)
    assert got == pytest.approx(exact, abs=2e-3)
    assert got >= exact - 1e-9  # PLD is pessimistic


def test_shuffle_bound_is_larger_than_the_poisson_assumption():
    cfg = DPConfig.from_epochs(
        epochs=5,
        l2_norm_clip=1.0,
        noise_multiplier=3.0,
        expected_batch_size=100,
        num_examples=10000,
        sampling="shuffle",
    )
    assert cfg.steps == 500
    sound = cfg.epsilon()
    assumed = cfg.epsilon(assume_poisson=True)
    assert sound > 2 * assumed


def test_replace_one_gaussian_doubles_sensitivity_and_rdp_refuses_it():
    event = acc.shuffle_event(noise_multiplier=6.0, steps_per_epoch=10, epochs=2)
    replace = acc.compute_epsilon(event, target_delta=1e-5, neighboring="replace_one")
    halved = acc.shuffle_event(noise_multiplier=3.0, steps_per_epoch=10, epochs=2)
    assert replace == pytest.approx(acc.compute_epsilon(halved, target_delta=1e-5), rel=1e-3)
    assert replace > acc.compute_epsilon(event, target_delta=1e-5)
    with pytest.raises(ValueError, match=r"neighboring='replace_one'"):
        acc.compute_epsilon(event, target_delta=1e-5, accountant="rdp", neighboring="replace_one")


def test_zero_noise_is_infinitely_private_loss():
    event = acc.poisson_event(noise_multiplier=0.0, sampling_prob=0.1, steps=3)
    assert acc.compute_epsilon(event, target_delta=1e-5) == math.inf


@pytest.mark.parametrize(
    "call, pattern",
    [
        (
            lambda: acc.poisson_event(noise_multiplier=1.0, sampling_prob=0.0, steps=1),
            r"sampling_prob.*0\.0",
        ),
        (
            lambda: acc.poisson_event(noise_multiplier=1.0, sampling_prob=1.5, steps=1),
            r"sampling_prob.*1\.5",
        ),
        (
            lambda: acc.poisson_event(noise_multiplier=1.0, sampling_prob=0.1, steps=0),
            r"steps.*\b0\b",
        ),
        (
            lambda: acc.poisson_event(noise_multiplier=1.0, sampling_prob=0.1, steps=-3),
            r"steps.*-3",
        ),
        (
            lambda: acc.poisson_event(noise_multiplier=-1.0, sampling_prob=0.1, steps=1),
            r"noise_multiplier.*-1\.0",
        ),
        (
            lambda: acc.compute_epsilon(
                acc.poisson_event(noise_multiplier=1.0, sampling_prob=0.1, steps=1),
                target_delta=0.0,
            ),
            r"target_delta.*0\.0",
        ),
        (
            lambda: acc.compute_epsilon(
                acc.poisson_event(noise_multiplier=1.0, sampling_prob=0.1, steps=1),
                target_delta=1.0,
            ),
            r"target_delta.*1\.0",
        ),
        (
            lambda: acc.compute_delta(
                acc.poisson_event(noise_multiplier=1.0, sampling_prob=0.1, steps=1),
                target_epsilon=0.0,
            ),
            r"target_epsilon.*0\.0",
        ),
        (
            lambda: acc.compute_delta(
                acc.poisson_event(noise_multiplier=1.0, sampling_prob=0.1, steps=1),
                target_epsilon=-2.0,
            ),
            r"target_epsilon.*-2\.0",
        ),
        (
            lambda: acc.compute_epsilon(
                acc.poisson_event(noise_multiplier=1.0, sampling_prob=0.1, steps=1),
                target_delta=1e-5,
                accountant="gdp",
            ),
            r"accountant.*gdp",
        ),
        (
            lambda: calibration.calibrate_noise_multiplier(
                target_epsilon=0.0, target_delta=1e-5, sampling_prob=0.1, steps=10
            ),
            r"target_epsilon.*0\.0",
        ),
        (
            lambda: calibration.calibrate_noise_multiplier(
                target_epsilon=1.0, target_delta=1e-5, sampling_prob=2.0, steps=10
            ),
            r"sampling_prob.*2\.0",
        ),
        (
            lambda: calibration.calibrate_noise_multiplier(
                target_epsilon=1.0, target_delta=1e-5, sampling_prob=0.1, steps=0
            ),
            r"steps.*\b0\b",
        ),
        (
            lambda: calibration.calibrate_steps(
                target_epsilon=-1.0, target_delta=1e-5, noise_multiplier=1.0, sampling_prob=0.1
            ),
            r"target_epsilon.*-1\.0",
        ),
    ],
)
def test_bad_inputs_raise_errors_naming_argument_and_value(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


def test_unreachable_target_epsilon_is_a_clear_error():
    with pytest.raises(ValueError, match=r"target_epsilon=0\.001.*max_noise_multiplier=50"):
        calibration.calibrate_noise_multiplier(
            target_epsilon=0.001,
            target_delta=1e-5,
            sampling_prob=0.5,
            steps=1000,
            accountant="rdp",
            max_noise_multiplier=50.0,
        )


# ------------------------------------------------------------------------------- calibration
@pytest.mark.parametrize("accountant", ["pld", "rdp"])
@pytest.mark.parametrize("sampling", ["poisson", "shuffle"])
def test_noise_calibration_round_trip(accountant, sampling):
    target, delta, q, steps = 2.0, 1e-5, 0.01, 400
    sigma = calibration.calibrate_noise_multiplier(
        target_epsilon=target,
        target_delta=delta,
        sampling_prob=q,
        steps=steps,
        sampling=sampling,
        accountant=accountant,
        pld_discretization=FAST,
    )

    def eps(s):
        event = calibration.run_event(
            noise_multiplier=s, sampling_prob=q, steps=steps, sampling=sampling
        )
        return acc.compute_epsilon(
            event, target_delta=delta, accountant=accountant, pld_discretization=FAST
        )

    assert eps(sigma) <= target < eps(0.99 * sigma)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_steps_calibration_round_trip(accountant):
    kw = dict(noise_multiplier=1.2, sampling_prob=0.02)
    n = calibration.calibrate_steps(
        target_epsilon=1.5, target_delta=1e-5, accountant=accountant, pld_discretization=FAST, **kw
    )

    def eps(steps):
        return acc.compute_epsilon(
            acc.poisson_event(steps=steps, **kw),
            target_delta=1e-5,
            accountant=accountant,
            pld_discretization=FAST,
        )

    assert n > 1
    assert eps(n) <= 1.5 < eps(n + 1)


def test_steps_calibration_shuffle_stops_at_an_epoch_boundary():
    n = calibration.calibrate_steps(
        target_epsilon=4.0,
        target_delta=1e-5,
        noise_multiplier=4.0,
        sampling_prob=0.1,
        sampling="shuffle",
        num_examples=100,
        accountant="rdp",
    )
    assert n % 10 == 0 and n > 0
    cfg = dict(
        l2_norm_clip=1.0,
        noise_multiplier=4.0,
        expected_batch_size=10,
        num_examples=100,
        sampling="shuffle",
        target_delta=1e-5,
    )

    def eps(steps):
        return DPConfig(steps=steps, **cfg).epsilon("rdp")

    assert eps(n) <= 4.0 < eps(n + 1)


def test_steps_calibration_counts_what_a_ledger_already_spent():
    ledger = acc.PrivacyLedger(num_examples=1000)
    ledger.record_steps(steps=100, noise_multiplier=1.2, sampling_prob=0.02)
    kw = dict(
        target_epsilon=1.5,
        target_delta=1e-5,
        noise_multiplier=1.2,
        sampling_prob=0.02,
        accountant="rdp",
    )
    fresh = calibration.calibrate_steps(**kw)
    more = calibration.calibrate_steps(ledger=ledger, **kw)
    assert more == fresh - 100
    assert calibration.calibrate_steps(**{**kw, "target_epsilon": 1e-3}) == 0


# ------------------------------------------------------------------------------------ ledger
def test_single_segment_ledger_is_the_config_event():
    cfg = DPConfig(
        l2_norm_clip=1.0, noise_multiplier=1.1, expected_batch_size=20, num_examples=1000, steps=150
    )
    ledger = cfg.new_ledger()
    ledger.record_steps(steps=100, noise_multiplier=1.1, sampling_prob=cfg.sampling_prob)
    ledger.record_steps(steps=50, noise_multiplier=1.1, sampling_prob=cfg.sampling_prob)
    assert ledger.steps == 150 and len(ledger.segments) == 1
    assert ledger.dp_event() == cfg.dp_event()
    assert ledger.epsilon(target_delta=1e-5, accountant="rdp") == cfg.epsilon("rdp")


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_ledger_with_sigma_and_batch_changes_equals_the_composed_event(accountant):
    ledger = acc.PrivacyLedger(num_examples=1000)
    ledger.record_steps(steps=40, noise_multiplier=1.0, sampling_prob=0.02)
    ledger.record_steps(steps=30, noise_multiplier=2.0, sampling_prob=0.02)
    ledger.record_steps(steps=20, noise_multiplier=2.0, sampling_prob=0.05)
    expected = dp_accounting.ComposedDpEvent(
        [
            acc.poisson_event(noise_multiplier=1.0, sampling_prob=0.02, steps=40),
            acc.poisson_event(noise_multiplier=2.0, sampling_prob=0.02, steps=30),
            acc.poisson_event(noise_multiplier=2.0, sampling_prob=0.05, steps=20),
        ]
    )
    assert ledger.dp_event() == expected
    got = ledger.epsilon(target_delta=1e-5, accountant=accountant, pld_discretization=FAST)
    assert got == _direct(expected, accountant, 1e-5)


def test_ledger_json_round_trip_and_resume_give_the_same_epsilon():
    full = acc.PrivacyLedger(num_examples=1000)
    full.record_steps(steps=60, noise_multiplier=1.0, sampling_prob=0.02)
    full.record_steps(steps=40, noise_multiplier=1.5, sampling_prob=0.02)

    first = acc.PrivacyLedger(num_examples=1000)
    first.record_steps(steps=60, noise_multiplier=1.0, sampling_prob=0.02)
    restored = acc.PrivacyLedger.from_json(first.to_json())
    assert restored == first
    assert restored.epsilon(target_delta=1e-5, accountant="rdp") == first.epsilon(
        target_delta=1e-5, accountant="rdp"
    )
    restored.record_steps(steps=40, noise_multiplier=1.5, sampling_prob=0.02)
    assert restored.dp_event() == full.dp_event()
    assert restored.epsilon(target_delta=1e-5, pld_discretization=FAST) == full.epsilon(
        target_delta=1e-5, pld_discretization=FAST
    )


def test_shuffle_ledger_groups_steps_into_epochs_conservatively():
    ledger = acc.PrivacyLedger(num_examples=40, sampling="shuffle")
    ledger.record_steps(steps=10, noise_multiplier=3.0, sampling_prob=0.25)  # B=10, 4 steps/epoch
    assert ledger.epochs == 3  # 4 + 4 + 2
    ledger.end_epoch()  # the pipeline reshuffles: the partial epoch is closed
    ledger.record_steps(steps=1, noise_multiplier=3.0, sampling_prob=0.25)
    assert ledger.epochs == 4
    ledger.record_steps(steps=1, noise_multiplier=2.0, sampling_prob=0.25)  # lower σ in epoch 4
    assert ledger.dp_event() == dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(3.0), 3),
            dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(2.0), 1),
        ]
    )
    ledger.record_steps(steps=1, noise_multiplier=2.0, sampling_prob=0.5)  # B=20: new epoch
    assert ledger.epochs == 5
    restored = acc.PrivacyLedger.from_json(ledger.to_json())
    assert restored.dp_event() == ledger.dp_event()
    assert (
        restored.steps_left_in_epoch(sampling_prob=0.5)
        == ledger.steps_left_in_epoch(sampling_prob=0.5)
        == 1
    )
    # the Poisson figure is available only on request, from the same steps
    assert ledger.dp_event(assume_poisson=True) == dp_accounting.ComposedDpEvent(
        [
            acc.poisson_event(noise_multiplier=3.0, sampling_prob=0.25, steps=11),
            acc.poisson_event(noise_multiplier=2.0, sampling_prob=0.25, steps=1),
            acc.poisson_event(noise_multiplier=2.0, sampling_prob=0.5, steps=1),
        ]
    )


def test_ledger_rejects_bad_records_and_warns_on_large_delta():
    ledger = acc.PrivacyLedger(num_examples=100)
    with pytest.raises(ValueError, match=r"steps.*-1"):
        ledger.record_steps(steps=-1, noise_multiplier=1.0, sampling_prob=0.1)
    with pytest.raises(ValueError, match=r"sampling_prob.*1\.2"):
        ledger.record_steps(steps=1, noise_multiplier=1.0, sampling_prob=1.2)
    shuffle = acc.PrivacyLedger(num_examples=100, sampling="shuffle")
    with pytest.raises(ValueError, match=r"whole batch size"):
        shuffle.record_steps(steps=1, noise_multiplier=1.0, sampling_prob=0.123)
    assert ledger.epsilon(target_delta=1e-5) == 0.0
    ledger.record_steps(steps=5, noise_multiplier=1.0, sampling_prob=0.1)
    with pytest.warns(UserWarning, match=r"1/num_examples"):
        ledger.epsilon(target_delta=0.02, accountant="rdp")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ledger.epsilon(target_delta=1e-5, accountant="rdp")
    with pytest.raises(ValueError, match="ledger"):
        acc.PrivacyLedger.from_json('{"format": "other"}')


def test_rdp_convergence_warnings_of_dp_accounting_are_dropped_only_inside_dpcore():
    """The digits main job's q ≈ 0.089, σ = 1 makes dp-accounting warn per fractional order.

    In a fresh process: dpcore's RDP ε prints nothing to stderr and equals dp-accounting's own
    figure; a plain dp-accounting call afterwards still warns (the filter was scoped).
    """
    code = textwrap.dedent(
        """
        import sys
        from dp_accounting import rdp
        import dpcore_accounting as acc

        event = acc.poisson_event(noise_multiplier=1.0, sampling_prob=128 / 1438, steps=113)
        ours = acc.compute_epsilon(event, target_delta=1e-5, accountant="rdp")
        config = acc.DPConfig(l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=128,
                              num_examples=1438, steps=113)
        sigma = acc.calibrate_noise_multiplier(target_epsilon=8.0, target_delta=1e-5,
                                               sampling_prob=128 / 1438, steps=113,
                                               accountant="rdp")
        print(config.planned_epsilon("rdp") == ours, sigma > 0)
        print("--- direct dp-accounting call ---", file=sys.stderr, flush=True)
        direct = rdp.RdpAccountant().compose(event).get_epsilon(1e-5)
        print(repr(ours), repr(float(direct)))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    ours_err, _, direct_err = done.stderr.partition("--- direct dp-accounting call ---")
    assert ours_err.strip() == "", ours_err
    assert "failed to converge" in direct_err  # the case really warns without the filter
    checks, values = done.stdout.strip().splitlines()
    assert checks == "True True"
    ours, direct = (float(v) for v in values.split())
    assert ours == direct and 7.0 < ours < 8.0  # value unchanged (7.4415 for this event)


def test_pld_accountant_reusing_one_step_plds_gives_dp_accountings_numbers():
    """make_accountant("pld") keeps the one-step PLD of each (σ, q): every figure must stay the
    number dp-accounting's own PLDAccountant gives, on first use and when reused."""
    ledger = acc.PrivacyLedger(num_examples=1000)
    ledger.record_steps(steps=7, noise_multiplier=1.3, sampling_prob=0.05)
    ledger.record_steps(steps=5, noise_multiplier=0.9, sampling_prob=0.05)
    ledger.record_steps(steps=3, noise_multiplier=1.3, sampling_prob=0.05)
    shuffle = acc.shuffle_event(noise_multiplier=1.2, steps_per_epoch=10, steps=25)
    for event in (ledger.dp_event(), shuffle, ledger.dp_event()):
        for neighboring, relation in acc.NEIGHBORING_RELATIONS.items():
            want = pld.PLDAccountant(relation, value_discretization_interval=FAST)
            want.compose(event)
            got = acc.compute_epsilon(
                event, target_delta=1e-5, neighboring=neighboring, pld_discretization=FAST
            )
            assert got == want.get_epsilon(1e-5)
            delta = acc.compute_delta(
                event, target_epsilon=2.0, neighboring=neighboring, pld_discretization=FAST
            )
            assert delta == want.get_delta(2.0)
