"""Tests for the scattering features of experiments/lib/scatternet.py (numpy only, fast)."""

import numpy as np
import pytest
from dpcore_experiments.lib import scatternet


def test_shapes_and_channel_count():
    assert scatternet.num_channels(2, 8) == 81 and scatternet.num_channels(1, 4) == 5
    rng = np.random.default_rng(0)
    assert scatternet.scattering(rng.random((3, 28, 28)), J=2, L=8).shape == (3, 81, 7, 7)
    assert scatternet.scattering(rng.random((2, 8, 8)), J=2, L=8).shape == (2, 81, 2, 2)
    assert scatternet.scattering(rng.random((2, 8, 8)), J=1, L=4).shape == (2, 5, 4, 4)
    with pytest.raises(ValueError, match="divisible"):
        scatternet.scattering(rng.random((1, 10, 10)), J=2)
    with pytest.raises(ValueError, match=r"\[n, H, W\]"):
        scatternet.scattering(rng.random((1, 8, 8, 1)))


def test_filters_wavelets_have_zero_mean_and_the_low_pass_unit_mass():
    psi, phi = scatternet.filter_bank(36, 2, 8)
    assert len(psi) == 16
    for spectrum in psi.values():  # the DC coefficient of a Morlet wavelet is zero
        assert abs(spectrum[0, 0]) < 1e-5 * np.abs(spectrum).max()
    assert phi[0, 0] == pytest.approx(1.0, abs=1e-5)


def test_constant_images_have_only_a_low_pass_coefficient():
    s = scatternet.scattering(np.full((1, 16, 16), 0.7), J=2, L=8)
    np.testing.assert_allclose(s[0, 0], 0.7, rtol=1e-5)
    assert np.abs(s[0, 1:]).max() < 1e-5


def test_chunks_do_not_change_the_result_and_the_map_is_positively_homogeneous():
    x = np.random.default_rng(1).random((5, 16, 16)).astype(np.float32)
    calls = []
    whole = scatternet.scattering(x, chunk_size=5)
    parts = scatternet.scattering(x, chunk_size=2, progress=lambda d, n: calls.append((d, n)))
    np.testing.assert_allclose(parts, whole, rtol=1e-5, atol=1e-6)
    assert calls == [(2, 5), (4, 5), (5, 5)]
    # Moduli make every coefficient except the low-passed image homogeneous in |a|.
    scaled = scatternet.scattering(-3.0 * x, chunk_size=5)
    np.testing.assert_allclose(scaled[:, 1:], 3.0 * whole[:, 1:], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(scaled[:, 0], -3.0 * whole[:, 0], rtol=1e-4, atol=1e-5)


def test_group_normalize_standardizes_each_example_group():
    f = np.random.default_rng(2).normal(3.0, 5.0, (4, 6, 3, 3)).astype(np.float32)
    g = scatternet.group_normalize(f, groups=2)
    groups = g.reshape(4, 2, -1)
    np.testing.assert_allclose(groups.mean(-1), 0.0, atol=1e-5)
    np.testing.assert_allclose(groups.std(-1), 1.0, rtol=1e-3)
    with pytest.raises(ValueError, match="divide"):
        scatternet.group_normalize(f, groups=4)
