"""Goodness-of-fit tests for the statistical checks, without scipy.

`chi2_sf` is the exact chi-square survival function (closed forms for integer degrees of freedom), so a test run
at level `alpha` fails with probability `alpha` when the sampler is right. The seeds are fixed, so each test is
deterministic: `alpha` is the chance that a correct implementation would have drawn a failing seed set.
"""

from __future__ import annotations

import math

import numpy as np


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df), df a positive integer."""
    if x <= 0:
        return 1.0
    h = x / 2
    if df % 2 == 0:  # e^{-h} * sum_{i < df/2} h^i / i!
        terms = [i * math.log(h) - math.lgamma(i + 1) - h for i in range(df // 2)]
        return min(1.0, sum(math.exp(t) for t in terms))
    # erfc(sqrt(h)) + e^{-h} * sum_{i=1..(df-1)/2} h^{i-1/2} / Gamma(i + 1/2)
    terms = [(i - 0.5) * math.log(h) - math.lgamma(i + 0.5) - h for i in range(1, (df - 1) // 2 + 1)]
    return min(1.0, math.erfc(math.sqrt(h)) + sum(math.exp(t) for t in terms))


def chi2_gof(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson's chi-square of observed `counts` against exact `probs` (same shape, any dims).

    Cells with zero probability must be empty (checked exactly, not statistically). Cells whose expected count is
    below `min_expected` are pooled into one bin so the chi-square approximation holds. Returns (stat, df, p).
    """
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    probs = probs / probs.sum()
    impossible = probs <= 0
    if counts[impossible].any():
        cells = np.flatnonzero(impossible & (counts > 0))[:10].tolist()
        raise AssertionError(f"samples landed in zero-probability cells {cells}")
    n = counts.sum()
    expected = probs * n
    big = expected >= min_expected
    small = ~big & ~impossible
    obs, exp = list(counts[big]), list(expected[big])
    if small.any():
        obs.append(counts[small].sum())
        exp.append(expected[small].sum())
    obs_a, exp_a = np.array(obs), np.array(exp)
    if len(obs_a) < 2:
        return 0.0, 0, 1.0
    stat = float(((obs_a - exp_a) ** 2 / exp_a).sum())
    df = len(obs_a) - 1
    return stat, df, chi2_sf(stat, df)


def assert_distribution(counts: np.ndarray, probs: np.ndarray, alpha: float, what: str = "") -> float:
    stat, df, p = chi2_gof(counts, probs)
    assert p >= alpha, (f"{what}: empirical distribution differs from the expected one "
                        f"(chi2 = {stat:.1f}, df = {df}, p = {p:.2e} < alpha = {alpha:g})")
    return p


def reference_probs(logits: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """Independent float64 reference of the processing rule: softmax(logits / T), keep the top k, renormalise,
    keep the smallest prefix (by descending probability) whose mass reaches top_p, renormalise. [..., V]."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    order = np.argsort(-p, axis=-1, kind="stable")
    sp = np.take_along_axis(p, order, axis=-1)
    v = p.shape[-1]
    if 0 < top_k < v:
        sp[..., top_k:] = 0.0
        sp /= sp.sum(axis=-1, keepdims=True)
    if top_p < 1.0:
        before = np.cumsum(sp, axis=-1) - sp
        sp = np.where(before < top_p, sp, 0.0)
        sp /= sp.sum(axis=-1, keepdims=True)
    out = np.zeros_like(p)
    np.put_along_axis(out, order, sp, axis=-1)
    return out
