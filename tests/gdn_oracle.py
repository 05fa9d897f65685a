"""The gated delta rule as a float64 numpy loop over tokens: the oracle of the GDN kernels.

Written from the recurrence in DESIGN.md §11 (and HF `torch_recurrent_gated_delta_rule`), one
token at a time, independent of the chunked form the kernels and the reference use.
"""

from __future__ import annotations

import numpy as np


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def gating(a, b, A_log, dt_bias):
    """(g, beta) from the raw projections, float64: g = -exp(A_log)·softplus(a + dt_bias)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    x = a + np.asarray(dt_bias, np.float64)
    softplus = np.log1p(np.exp(-np.abs(x))) + np.maximum(x, 0.0)
    return -np.exp(np.asarray(A_log, np.float64)) * softplus, 1.0 / (1.0 + np.exp(-b))


def gdn_sequence(q, k, v, g, beta, state, scale, use_qk_l2norm=True, keep_at=()):
    """One sequence: q, k [L, Hk, Dk], v [L, HV, Dv], g, beta [L, HV], state [HV, Dk, Dv].

    Returns (o [L, HV, Dv], final state, {n: state after the first n tokens for n in keep_at}).
    """
    q, k, v, g, beta, s = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, state))
    s = s.copy()
    hk, hv = q.shape[1], v.shape[1]
    r = hv // hk
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    out = np.zeros(v.shape, np.float64)
    kept = {0: s.copy()} if 0 in keep_at else {}
    for t in range(q.shape[0]):
        for h in range(hv):
            kh, qh = k[t, h // r], q[t, h // r]
            decayed = np.exp(g[t, h]) * s[h]
            delta = beta[t, h] * (v[t, h] - decayed.T @ kh)
            s[h] = decayed + np.outer(kh, delta)
            out[t, h] = s[h].T @ qh
        if t + 1 in keep_at:
            kept[t + 1] = s.copy()
    return out, s, kept


def gdn_varlen(q, k, v, g, beta, cu_seqlens, initial_states, scale, use_qk_l2norm=True,
               keep_at=None):  # fmt: skip
    """Packed sequences (cu_seqlens [S+1]); keep_at: per sequence, relative lengths whose
    states to return. Returns (o [T, HV, Dv] (padding rows zero), finals [S, ...], kept)."""
    cu = [int(c) for c in cu_seqlens]
    out = np.zeros((q.shape[0], v.shape[1], v.shape[2]), np.float64)
    finals, kept = [], []
    for s in range(len(cu) - 1):
        lo, hi = cu[s], cu[s + 1]
        o, fin, kp = gdn_sequence(
            q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], initial_states[s], scale,
            use_qk_l2norm, () if keep_at is None else keep_at[s],
        )  # fmt: skip
        out[lo:hi] = o
        finals.append(fin)
        kept.append(kp)
    return out, np.stack(finals), kept
