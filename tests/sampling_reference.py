"""The sampling oracle: llama.cpp's filter chain written out in float64 numpy, and a binned
chi-square check of draws against it."""
import numpy as np


def reference_distribution(logits, temperature, top_k, top_p, min_p):
    """float64: llama.cpp's order — top-k, top-p and min-p on the temperature-1 softmax, then the
    temperature on what is left."""
    x = np.asarray(logits, np.float64)
    order = np.argsort(-x, kind="stable")
    keep = order[:top_k] if top_k > 0 else order
    p = np.exp(x[keep] - x[keep[0]])
    if top_p < 1:
        c = np.cumsum(p / p.sum())
        keep = keep[: int(np.searchsorted(c, top_p) + 1)]
        p = p[: len(keep)]
    if min_p > 0:
        n = 1
        while n < len(keep) and p[n] >= min_p:
            n += 1
        keep = keep[:n]
    w = np.exp((x[keep] - x[keep[0]]) / temperature)
    out = np.zeros(len(x))
    out[keep] = w / w.sum()
    return out


def chi2_critical(dof: int) -> float:
    """Chi-square critical value at p = 0.001 (Wilson-Hilferty approximation)."""
    return dof * (1 - 2 / (9 * dof) + 3.09 * np.sqrt(2 / (9 * dof))) ** 3 if dof > 0 else 0.0


def binned_chi2(counts, p, min_expected: float = 40.0):
    """Chi-square of token counts against probabilities p over bins of tokens adjacent in p's
    order, each expected >= min_expected draws (a large vocabulary has too few draws per token).
    Returns (chi2, critical value at p = 0.001)."""
    n = counts.sum()
    live = np.flatnonzero(p > 0)
    live = live[np.argsort(-p[live], kind="stable")]
    obs, exp = [], []
    o = e = 0.0
    for t in live:
        o += counts[t]
        e += p[t] * n
        if e >= min_expected:
            obs.append(o)
            exp.append(e)
            o = e = 0.0
    if e > 0:
        if exp:
            obs[-1] += o
            exp[-1] += e
        else:
            obs.append(o)
            exp.append(e)
    obs, exp = np.array(obs), np.array(exp)
    return float(((obs - exp) ** 2 / exp).sum()), chi2_critical(len(exp) - 1)
