"""Scattering-network features (Mallat's scattering transform) for DP linear models, in numpy.

Tramèr & Boneh ("Differentially Private Learning Needs Better Features (or Much More Data)",
ICLR 2021) train a linear model with DP-SGD on the 2-layer scattering transform of the images
(J = 2 scales, L = 8 orientations), normalized per example by a parameter-free group
normalization. On Fashion-MNIST at ε = 3 that beats end-to-end CNNs.

Contract:
  * `scattering(images, J, L)` maps `[n, H, W]` images to `[n, K, H / 2^J, W / 2^J]` features
    with K = 1 + J·L + L²·J·(J − 1)/2 channels (81 for J = 2, L = 8): the low-passed image, the
    low-passed moduli of its wavelet transforms, and of their wavelet transforms at coarser
    scales. The filters are Morlet wavelets and a Gaussian low-pass as in Kymatio's
    `Scattering2D` (σ = 0.8·2^j, ξ = 3π/4 / 2^j, slant 4/L; low-pass σ = 0.8·2^(J−1)); the input
    is reflect-padded by 2^J, every convolution is a full-resolution circular FFT convolution,
    and only the output is subsampled by 2^J and unpadded (Kymatio subsamples intermediate
    maps instead, so values differ slightly; the representation is the same).
  * `group_normalize(features, groups)` standardizes each example's channel groups (zero mean,
    unit variance over the group's channels and positions), with no learned parameters.
  * Both are fixed functions of one example at a time, chosen without looking at the data:
    applying them before DP-SGD costs no privacy, and the guarantee of the linear model
    trained on them holds for the raw images.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

__all__ = ["filter_bank", "group_normalize", "num_channels", "scattering"]


def num_channels(J: int, L: int) -> int:
    """Output channels of the 2-layer scattering transform: 1 + J·L + L²·J·(J − 1)/2."""
    return 1 + J * L + L * L * J * (J - 1) // 2


def _gabor(size: int, sigma: float, theta: float, xi: float, slant: float) -> np.ndarray:
    """A Gabor filter on a size × size periodic grid (spatial domain, complex128)."""
    rot = np.array([[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]])
    curv = rot @ np.diag([1.0, slant * slant]) @ rot.T / (2 * sigma * sigma)
    out = np.zeros((size, size), np.complex128)
    for ex in range(-2, 3):  # periodize: sum the filter's shifted copies
        for ey in range(-2, 3):
            xx, yy = np.mgrid[ex * size : (ex + 1) * size, ey * size : (ey + 1) * size]
            quad = curv[0, 0] * xx * xx + (curv[0, 1] + curv[1, 0]) * xx * yy
            quad = quad + curv[1, 1] * yy * yy
            phase = xx * xi * math.cos(theta) + yy * xi * math.sin(theta)
            out += np.exp(-quad + 1j * phase)
    return out / (2 * math.pi * sigma * sigma / slant)


def _morlet(size: int, sigma: float, theta: float, xi: float, slant: float) -> np.ndarray:
    """A Morlet wavelet: the Gabor filter minus its envelope's multiple, so it has zero mean."""
    wave = _gabor(size, sigma, theta, xi, slant)
    envelope = _gabor(size, sigma, theta, 0.0, slant)
    return wave - (wave.sum() / envelope.sum()) * envelope


def filter_bank(size: int, J: int, L: int) -> tuple[dict[tuple[int, int], np.ndarray], np.ndarray]:
    """Fourier transforms of the wavelets `psi[(j, l)]` and of the low-pass `phi` (float32).

    The filters are real and symmetric in space up to their modulation, so their transforms
    are taken real, as Kymatio does.
    """
    psi = {}
    for j in range(J):
        for ell in range(L):
            theta = (int(L - L / 2 - 1) - ell) * math.pi / L
            wavelet = _morlet(size, 0.8 * 2**j, theta, 3.0 / 4.0 * math.pi / 2**j, 4.0 / L)
            psi[(j, ell)] = np.real(np.fft.fft2(wavelet)).astype(np.float32)
    phi = np.real(np.fft.fft2(_gabor(size, 0.8 * 2 ** (J - 1), 0.0, 0.0, 1.0)))
    return psi, phi.astype(np.float32)


def scattering(
    images: np.ndarray,
    *,
    J: int = 2,
    L: int = 8,
    chunk_size: int = 2048,
    progress: Callable[[int, int], None] | None = None,
) -> np.ndarray:
    """The 2-layer scattering transform of `[n, H, W]` images (H, W divisible by 2^J).

    Args:
      images: `[n, H, W]` real images.
      J: number of scales (the output is subsampled by 2^J).
      L: number of orientations.
      chunk_size: images transformed at once (bounds memory: about 40 · chunk · (H + 2^(J+1))²
        bytes).
      progress: optional `progress(done, total)` called after each chunk.

    Returns:
      `[n, num_channels(J, L), H / 2^J, W / 2^J]` float32 features, channel 0 the low-passed
      image, then per first-order wavelet (j1, l1) its low-passed modulus followed by its
      second-order coefficients (j2 > j1, l2).

    Privacy:
      A fixed per-example map: DP guarantees of models trained on its output hold for the
      images (post-processing applied before training costs nothing).
    """
    x = np.asarray(images)
    if x.ndim != 3:
        raise ValueError(f"images must be [n, H, W], got shape {x.shape}.")
    n, height, width = x.shape
    step = 2**J
    if height != width or height % step:
        raise ValueError(
            f"images must be square with a side divisible by 2^J={step}, got {x.shape}."
        )
    size = height + 2 * step
    psi, phi = filter_bank(size, J, L)

    def low(spectrum: np.ndarray) -> np.ndarray:  # low-pass, subsample by 2^J, unpad
        out = np.real(np.fft.ifft2(spectrum * phi))[:, ::step, ::step]
        return out[:, 1:-1, 1:-1]

    chunks = []
    for start in range(0, n, chunk_size):
        block = np.pad(
            x[start : start + chunk_size], ((0, 0), (step, step), (step, step)), "reflect"
        )
        spectrum = np.fft.fft2(block.astype(np.float32)).astype(np.complex64)
        features = [low(spectrum)]
        for j1 in range(J):
            for l1 in range(L):
                first = np.fft.fft2(np.abs(np.fft.ifft2(spectrum * psi[(j1, l1)])))
                first = first.astype(np.complex64)
                features.append(low(first))
                for j2 in range(j1 + 1, J):
                    for l2 in range(L):
                        second = np.abs(np.fft.ifft2(first * psi[(j2, l2)]))
                        features.append(low(np.fft.fft2(second)))
        chunks.append(np.stack(features, axis=1).astype(np.float32))
        if progress is not None:
            progress(min(start + chunk_size, n), n)
    return np.concatenate(chunks, axis=0)


def group_normalize(features: np.ndarray, *, groups: int, eps: float = 1e-5) -> np.ndarray:
    """Per-example group normalization of `[n, C, ...]` features (no learned parameters).

    Channels are split into `groups` consecutive groups; each example's group is standardized
    over its channels and positions. Returns `[n, C, ...]` float32.
    """
    f = np.asarray(features, np.float32)
    n, channels = f.shape[:2]
    if channels % groups:
        raise ValueError(f"groups={groups} must divide the {channels} channels.")
    g = f.reshape(n, groups, -1)
    mean = g.mean(axis=-1, keepdims=True)
    var = g.var(axis=-1, keepdims=True)
    return ((g - mean) / np.sqrt(var + eps)).reshape(f.shape).astype(np.float32)
