"""Speculative decoding on device: draft, verify, accept, and roll the recurrent state to the
accepted prefix, all inside one step (docs/speculative.md).

A *verify step* is a pure decode step whose rows carry ``J = 1 + k`` tokens: the row's last
sampled token and ``k`` draft tokens. Everything the host would otherwise read back stays
here:

* **Drafts** (`propose_ngram`): prompt lookup over the row's own token history, which the
  device keeps per slot (`SpecState.history`, a ring of the last `NgramSpec.window` tokens the
  slot's steps fed), or a draft model's greedy continuation (`jaxmamba.model.draft`, its
  state in `SpecState.draft`). The host cannot draft: when it builds step n+1 it has not read
  step n, so it knows neither the row's last token nor how many drafts step n accepted.
* **Lengths** (`SpecState.seq_lens`): a row's length advances by its accepted count, which
  only the device knows; decode rows of a speculating engine read it from here
  (`lens_from_device`).
* **The recurrent state after each scored position** is kept in a low-rank form: a verify
  step's Mamba2 and Gated DeltaNet layers read the row's state once and leave it untouched
  (`mamba2_verify`, `gdn_verify`), and return the per-position terms from which the state
  after any prefix ``a`` of the ``J`` positions is ``exp(cum[a-1])·h0 + Σ_{j<a}
  exp(cum[a-1] - cum[j])·left_j ⊗ right_j`` (`RecurrentPending`). After acceptance, the step
  writes that state for each row's accepted prefix into its working slot (`commit_state`, one
  read and one write of the state, masked by the accepted count) and the conv window ending
  there (`commit_conv`). Keeping J full states instead would cost J state writes a layer and
  J times the state's memory; this costs one more read of it.
* **Acceptance** (`verify_sample`): greedy rows accept a draft that equals the argmax of the
  target's processed logits at its position, so the output is the non-speculative one token
  for token; sampled rows accept a draft ``d`` with probability ``p(d)`` (the n-gram draft is
  a point mass) and on rejection draw from ``p`` with ``d`` removed (``normalize(max(p -
  onehot(d), 0))``), which leaves every emitted token distributed as ``p`` (Leviathan et al.
  2023). The token after the accepted drafts (the bonus) is drawn from the target at that
  position.
* **Penalties** (`position_penalties`, `record_kept`): position j of a row is scored as the
  plain decode would score it once the drafts before it were output, so its presence,
  frequency and repetition penalties see the row's output counts plus ``d_0..d_{j-1}``; the
  step then counts only the tokens it kept.

Attention needs nothing: the KV written for rejected positions lies past the row's length and
is overwritten by the next step's tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxmamba.kernels.common import process_dt
from jaxmamba.kernels.gdn import gdn_gating
from jaxmamba.kernels.gdn.ref import _value_heads_qk
from jaxmamba.model.sampling import (
    Penalties,
    PenaltyState,
    SampleOutput,
    apply_penalties,
    filter_cutoff,
    process_logits,
    sample_output,
)

if TYPE_CHECKING:
    from jaxmamba.model.cache import StateCache

_HIGHEST = lax.Precision.HIGHEST

# The tokens of a slot's history that prompt lookup searches (the most recent ones).
HISTORY_WINDOW = 2048

# The key of a verify position's acceptance draw: its token's key (the one the
# non-speculative sampler draws that token with) folded with this.
_ACCEPT_STREAM = 0x5EC0DE


class NgramSpec(NamedTuple):
    """The static part of an n-gram speculating step (a jit static argument)."""

    num_tokens: int  # k: drafts per row
    lookup_min: int
    lookup_max: int
    window: int = HISTORY_WINDOW


class SpecState(NamedTuple):
    """Per state slot, what speculation keeps on device between steps."""

    seq_lens: jax.Array  # i32[S+1] tokens in the slot's cache (the next input's position)
    history: jax.Array  # i32[S+1, W] the token at position p at column p % W (-1: none yet)
    # The draft model's states and KV pages on the target's slots and pages (method
    # "draft_model", `jaxmamba.model.draft`), or the MTP head's KV pages (method "mtp",
    # `jaxmamba.model.mtp`); None for n-gram drafting.
    draft: StateCache | None = None
    # [S+1, E] method "mtp": the head's output at each slot's last position (its next draft)
    mtp_hidden: jax.Array | None = None


def init_spec_state(num_slots: int, ngram: NgramSpec) -> SpecState:
    return SpecState(
        jnp.zeros(num_slots + 1, jnp.int32), jnp.full((num_slots + 1, ngram.window), -1, jnp.int32)
    )


# -- drafting --------------------------------------------------------------------------------


def propose_ngram(
    history: jax.Array,  # i32[S+1, W]
    seq_lens: jax.Array,  # i32[B] tokens in each row's history
    last_tokens: jax.Array,  # i32[B] each row's last sampled token (position seq_lens)
    slots: jax.Array,  # i32[B]
    ngram: NgramSpec,
) -> tuple[jax.Array, jax.Array]:
    """Prompt lookup (vLLM's "ngram"), per row: the longest n in [lookup_min, lookup_max] for
    which the row's last n tokens (ending with its last sampled token) occurred before within
    the window, and at the latest such occurrence, the k tokens that followed it; past the
    end of what is known, the continuation repeats with the match's period (the distance to
    the row's end), so a repeating pattern drafts its own continuation. Returns the drafts
    ``i32[B, k]`` and ``bool[B]``: whether the row found a match (rows without one propose
    nothing: every draft is rejected unseen)."""
    w, k, n_max = ngram.window, ngram.num_tokens, ngram.lookup_max
    # The context, oldest first: positions L - W .. L - 1 from the ring, then the last token.
    offsets = jnp.arange(w, dtype=jnp.int32)
    pos = seq_lens[:, None] - w + offsets[None, :]  # [B, W]
    ring = jnp.take_along_axis(history[slots], pos % w, axis=1)
    known = (pos >= 0) & (ring >= 0)
    ctx = jnp.concatenate([jnp.where(known, ring, -1), last_tokens[:, None]], axis=1)  # [B, W+1]
    ctx_known = jnp.concatenate([known, jnp.ones_like(known[:, :1])], axis=1)
    # run[e]: how many tokens ending at e (e < W: not the suffix itself) match the suffix.
    run = jnp.zeros(pos.shape, jnp.int32)
    still = jnp.ones(pos.shape, bool)
    for m in range(n_max):
        e_m = offsets - m  # the context index m tokens before e
        index = jnp.maximum(e_m, 0)
        same = (ctx[:, index] == ctx[:, w - m][:, None]) & ctx_known[:, index]
        still = still & same & (e_m >= 0)[None, :]
        run = run + still.astype(jnp.int32)
    score = jnp.where(run >= ngram.lookup_min, run * (w + 1) + offsets[None, :], -1)
    best = jnp.argmax(score, axis=1).astype(jnp.int32)  # [B] longest match, then latest
    found = jnp.max(score, axis=1) >= 0
    period = w - best  # tokens from just after the match to the row's last token
    follow = best[:, None] + 1 + jnp.arange(k, dtype=jnp.int32)[None, :] % period[:, None]
    drafts = jnp.take_along_axis(ctx, jnp.minimum(follow, w), axis=1)
    return jnp.maximum(drafts, 0), found


# -- the recurrent layers: verify, then commit -------------------------------------------------


class RecurrentPending(NamedTuple):
    """What a verify step's recurrent layer leaves for `commit_conv` and `commit_state`: the
    row's conv inputs (its window, then the J new ones) and the low-rank terms of the state
    after each position (module docstring). G groups share `right` among ``H / G`` heads."""

    conv_inputs: jax.Array  # [B, K-1+J, C] activation dtype
    cum: jax.Array  # f32[B, J, H] cumulative log decay through each position
    left: jax.Array  # f32[B, J, H, X]
    right: jax.Array  # f32[B, J, G, Y]


def conv_verify(
    conv_pool: jax.Array,  # [S+1, K-1, C]
    xbc: jax.Array,  # [B, J, C] the conv inputs of each row's positions
    weight: jax.Array,  # [K, C]
    bias: jax.Array | None,  # [C]
    slots: jax.Array,  # i32[B]
) -> tuple[jax.Array, jax.Array]:
    """The causal conv + SiLU at each position from the row's window, as the decode update
    computes it one token at a time; returns ``(y [B, J, C] xbc.dtype, inputs [B, K-1+J, C])``
    (the window and the new inputs: `commit_conv` takes the accepted window from them)."""
    width = weight.shape[0]
    inputs = jnp.concatenate([conv_pool[slots].astype(xbc.dtype), xbc], axis=1)
    f32 = inputs.astype(jnp.float32)
    num = xbc.shape[1]
    y = sum(f32[:, i : i + num] * weight[i].astype(jnp.float32) for i in range(width))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return jax.nn.silu(y).astype(xbc.dtype), inputs


def _causal_decay(cum: jax.Array) -> jax.Array:
    """f32[B, J(t), J(j), H]: exp(cum_t - cum_j) for j <= t, else 0."""
    num = cum.shape[1]
    causal = jnp.tril(jnp.ones((num, num), bool))[None, :, :, None]
    return jnp.exp(jnp.where(causal, cum[:, :, None, :] - cum[:, None, :, :], -jnp.inf))


def mamba2_verify(
    ssm_pool: jax.Array,  # [S+1, H, P, N]
    x: jax.Array,  # [B, J, H, P]
    dt: jax.Array,  # [B, J, H] raw (before dt_bias and softplus)
    A: jax.Array,  # f32[H]
    B: jax.Array,  # [B, J, G, N]
    C: jax.Array,  # [B, J, G, N]
    slots: jax.Array,  # i32[B]
    *,
    D: jax.Array,  # [H]
    dt_bias: jax.Array,  # [H]
) -> tuple[jax.Array, RecurrentPending]:
    """The selective state update at each of a row's J positions from its slot's state, read
    once and not written: ``y_t = exp(cum_t)·C_t·h0 + Σ_{j≤t} exp(cum_t - cum_j)·dt_j·(C_t·B_j)
    x_j + D·x_t`` (the decode path's dt: softplus, no clamp). Returns ``y [B, J, H, P]`` and
    the pending terms (without the conv inputs)."""
    heads, groups = x.shape[2], B.shape[2]
    r = heads // groups
    dt = process_dt(dt, dt_bias, True, (0.0, float("inf")))  # f32[B, J, H]
    cum = jnp.cumsum(dt * A.astype(jnp.float32), axis=1)
    h0 = ssm_pool[slots].astype(jnp.float32)
    xf = x.astype(jnp.float32)
    bh = jnp.repeat(B.astype(jnp.float32), r, axis=2)  # [B, J, H, N]
    ch = jnp.repeat(C.astype(jnp.float32), r, axis=2)
    y = jnp.einsum("bhpn,bthn->bthp", h0, ch, precision=_HIGHEST) * jnp.exp(cum)[..., None]
    cb = jnp.einsum("bthn,bjhn->btjh", ch, bh, precision=_HIGHEST) * _causal_decay(cum)
    y = y + jnp.einsum("btjh,bjhp->bthp", cb, xf * dt[..., None], precision=_HIGHEST)
    y = y + D.astype(jnp.float32)[:, None] * xf
    return y.astype(x.dtype), RecurrentPending(None, cum, xf * dt[..., None],
                                               B.astype(jnp.float32))  # fmt: skip


def gdn_verify(
    state_pool: jax.Array,  # [S+1, HV, Dk, Dv]
    q: jax.Array,  # [B, J, Hk, Dk]
    k: jax.Array,  # [B, J, Hk, Dk]
    v: jax.Array,  # [B, J, HV, Dv]
    a: jax.Array,  # [B, J, HV] raw decay input
    b: jax.Array,  # [B, J, HV] raw beta input
    A_log: jax.Array,  # f32[HV]
    dt_bias: jax.Array,  # f32[HV]
    slots: jax.Array,  # i32[B]
    *,
    scale: float,
) -> tuple[jax.Array, RecurrentPending]:
    """The gated delta rule at each of a row's J positions from its slot's state S0, read once
    and not written. With ``u_t = β_t (v_t - e^{g_t} S_{t-1}ᵀ k_t)`` the state after t is
    ``e^{γ_t} S0 + Σ_{j≤t} e^{γ_t - γ_j} k_j u_jᵀ`` (γ the cumulative g), so each u_t needs only
    ``S0ᵀk_t`` and the earlier u's, and ``o_t = S_tᵀ q_t`` only ``S0ᵀq_t`` and the u's.
    Returns ``o [B, J, HV, Dv]`` and the pending terms (left k, right u)."""
    hv, num = v.shape[2], v.shape[1]
    g, beta = gdn_gating(a, b, A_log, dt_bias)  # f32[B, J, HV]
    q, k = _value_heads_qk(q, k, hv, scale, True)  # f32[B, J, HV, Dk]
    cum = jnp.cumsum(g, axis=1)
    s0 = state_pool[slots].astype(jnp.float32)
    s0k = jnp.einsum("bhde,bjhd->bjhe", s0, k, precision=_HIGHEST)
    s0q = jnp.einsum("bhde,bjhd->bjhe", s0, q, precision=_HIGHEST)
    decay = _causal_decay(cum)  # [B, t, j, HV]
    kk = jnp.einsum("bthd,bjhd->btjh", k, k, precision=_HIGHEST) * decay
    qk = jnp.einsum("bthd,bjhd->btjh", q, k, precision=_HIGHEST) * decay
    vf = v.astype(jnp.float32)
    us = []
    for t in range(num):  # J <= 1 + MAX_SPECULATIVE_TOKENS small steps
        pred = jnp.exp(cum[:, t])[..., None] * s0k[:, t]
        for j in range(t):
            pred = pred + kk[:, t, j][..., None] * us[j]
        us.append(beta[:, t][..., None] * (vf[:, t] - pred))
    u = jnp.stack(us, axis=1)  # [B, J, HV, Dv]
    o = jnp.exp(cum)[..., None] * s0q + jnp.einsum("btjh,bjhe->bthe", qk, u, precision=_HIGHEST)
    return o.astype(v.dtype), RecurrentPending(None, cum, k, u)


def commit_state(
    pool: jax.Array,  # [S+1, H, X, Y]
    pending: RecurrentPending,
    slots: jax.Array,  # i32[B]
    accepted: jax.Array,  # i32[B] positions kept, 1..J
) -> jax.Array:
    """Write each row's state after its first `accepted` positions into its slot."""
    rows, num, heads = pending.cum.shape
    groups, x_dim = pending.right.shape[2], pending.left.shape[-1]
    last = jnp.take_along_axis(pending.cum, (accepted - 1)[:, None, None], axis=1)[:, 0]  # [B, H]
    kept = (jnp.arange(num)[None, :] < accepted[:, None])[..., None]
    weight = jnp.exp(jnp.where(kept, last[:, None, :] - pending.cum, -jnp.inf))  # [B, J, H]
    left = (pending.left * weight[..., None]).reshape(rows, num, groups, heads // groups, x_dim)
    update = jnp.einsum("bjgrx,bjgy->bgrxy", left, pending.right, precision=_HIGHEST)
    h = jnp.exp(last)[..., None, None] * pool[slots].astype(jnp.float32)
    h = h + update.reshape(rows, heads, x_dim, -1)
    return pool.at[slots].set(h.astype(pool.dtype))


def commit_conv(
    conv_pool: jax.Array,  # [S+1, K-1, C]
    pending: RecurrentPending,
    slots: jax.Array,  # i32[B]
    accepted: jax.Array,  # i32[B] positions kept, 1..J
) -> jax.Array:
    """Write each row's conv window ending at its last accepted position into its slot."""
    width = conv_pool.shape[1]
    index = accepted[:, None] + jnp.arange(width)[None, :]  # [B, K-1]
    window = jnp.take_along_axis(pending.conv_inputs, index[..., None], axis=1)
    return conv_pool.at[slots].set(window.astype(conv_pool.dtype))


def commit_pending(
    cache: StateCache,
    pending: tuple[RecurrentPending | None, ...],  # per recurrent layer (a verify forward's)
    slots: jax.Array,  # i32[B]
    accepted: jax.Array,  # i32[B] positions kept, 1..J
) -> StateCache:
    """Every recurrent layer's conv window and state after each row's kept positions."""
    conv, ssm = list(cache.conv), list(cache.ssm)
    for m, p in enumerate(pending):
        conv[m] = commit_conv(conv[m], p, slots, accepted)
        ssm[m] = commit_state(ssm[m], p, slots, accepted)
    return cache._replace(conv=tuple(conv), ssm=tuple(ssm))


# -- acceptance --------------------------------------------------------------------------------


def verify_sample(
    logits: jax.Array,  # f32[B*J, V] at each row's positions, row-major
    drafts: jax.Array,  # i32[B, k]
    proposed: jax.Array,  # bool[B] the row has drafts (else every draft is rejected unseen)
    temperature: jax.Array,  # f32[B] 0 → greedy
    top_p: jax.Array,  # f32[B]
    top_k: jax.Array,  # i32[B]
    seeds: jax.Array,  # u32[B]
    counters: jax.Array,  # i32[B] tokens the row's request has sampled before
    min_p: jax.Array,  # f32[B]
    min_tokens: jax.Array,  # i32[B]
    stop_ids: jax.Array,  # i32[B, SI]
    bias_ids: jax.Array,  # i32[B, LB]
    bias_values: jax.Array,  # f32[B, LB]
    penalties: Penalties | None = None,  # per row; its counts include the row's last token
    *,
    cutoff: bool = True,
    top_logprobs: bool = True,
    draw: bool = True,
    ranks: bool = True,
) -> tuple[SampleOutput, jax.Array]:
    """Accept each row's drafts against the target and pick its token at every position.

    Position j of a row samples the row's output number ``counters + j`` from the target's
    processed logits there (logit bias, min_tokens, then the penalties with the drafts before
    j counted as outputs: `position_penalties`), with that token's own random key. Returns
    the tokens, their raw logprobs and ranks and the top logprobs, ``[B*J]`` rows, and
    ``accepted [B]``: how many leading drafts were accepted (the row emits positions
    ``0..accepted``, the last a target sample). `penalties` (None: no row has any) holds
    each row's prompt mask and output counts as its plain decode step would see them, its
    last sampled token counted. The static switches are `sampling.sample`'s."""
    rows, k = drafts.shape
    num = k + 1
    vocab = logits.shape[-1]
    rep = lambda a: jnp.repeat(a, num, axis=0)  # noqa: E731 - per row -> per position
    counter = rep(counters) + jnp.tile(jnp.arange(num, dtype=jnp.int32), rows)
    raw = logits.astype(jnp.float32)
    log_norm = jax.nn.logsumexp(raw, axis=-1)
    processed = process_logits(raw, counter, rep(min_tokens), rep(stop_ids), rep(bias_ids),
                               rep(bias_values))  # fmt: skip
    if penalties is not None:
        processed = apply_penalties(processed, position_penalties(penalties, drafts))
    draft = jnp.concatenate([drafts, jnp.zeros((rows, 1), jnp.int32)], axis=1).reshape(-1)
    valid = jnp.concatenate(
        [jnp.repeat(proposed[:, None], k, axis=1), jnp.zeros((rows, 1), bool)], axis=1
    ).reshape(-1)
    tokens = jnp.argmax(processed, axis=-1).astype(jnp.int32)
    accept = valid & (draft == tokens)
    if draw:
        temp = rep(temperature)
        scaled = processed / jnp.maximum(temp, 1e-6)[:, None]
        masked = scaled
        if cutoff:
            lowest_kept = filter_cutoff(-jnp.sort(-scaled, axis=-1), rep(top_k), rep(top_p),
                                        rep(min_p))  # fmt: skip
            masked = jnp.where(scaled >= lowest_kept[:, None], scaled, -jnp.inf)
        logp_draft = (jnp.take_along_axis(masked, draft[:, None], axis=-1)[:, 0]
                      - jax.nn.logsumexp(masked, axis=-1))  # fmt: skip
        keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(
            rep(seeds), counter
        )
        uniform = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, _ACCEPT_STREAM)))(
            keys
        )
        accept_drawn = valid & (jnp.log(uniform) < logp_draft)
        # On rejection: p with the draft removed, renormalised (the Gumbel-max draw does that).
        residual = jnp.where(valid[:, None] & (jnp.arange(vocab)[None, :] == draft[:, None]),
                             -jnp.inf, masked)  # fmt: skip
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), jnp.float32))(keys)
        drawn = jnp.argmax(residual + gumbel, axis=-1).astype(jnp.int32)
        sampled = temp > 0
        accept = jnp.where(sampled, accept_drawn, accept)
        tokens = jnp.where(sampled, jnp.where(accept_drawn, draft, drawn), tokens)
    leading = jnp.cumprod(accept.reshape(rows, num)[:, :k].astype(jnp.int32), axis=1)
    accepted = jnp.sum(leading, axis=1).astype(jnp.int32)

    out = sample_output(raw, log_norm, tokens, ranks=ranks, top_logprobs=top_logprobs)
    return out, accepted


def position_penalties(
    penalties: Penalties,  # per row [B, V]: its counts include the row's last sampled token
    drafts: jax.Array,  # i32[B, k]
) -> Penalties:
    """The penalties of each of a row's ``J = 1 + k`` positions, ``[B*J, V]`` row-major: at
    position j the output counts the plain decode would have there if the row had output
    ``d_0..d_{j-1}`` (the row's counts plus those drafts; only an accepted prefix of drafts
    is ever emitted, so position j is used only when all of them were). The prompt mask and
    the parameters are the row's. The row's counts are broadcast, not copied, and the drafts
    are added as k comparisons with the vocabulary index: all elementwise, so XLA fuses them
    into the penalties' own pass over the logits instead of writing ``[B, J, V]`` counts."""
    rows, k = drafts.shape
    num, vocab = k + 1, penalties.output_counts.shape[-1]
    token = jnp.arange(vocab, dtype=jnp.int32)[None, None, :]
    position = jnp.arange(num, dtype=jnp.int32)[None, :, None]
    counts = jnp.broadcast_to(penalties.output_counts[:, None, :], (rows, num, vocab))
    for i in range(k):  # draft i counts at the positions after it
        counts = counts + ((position > i) & (drafts[:, i, None, None] == token)).astype(jnp.int32)
    prompt = jnp.broadcast_to(penalties.prompt_mask[:, None, :], (rows, num, vocab))
    rep = lambda a: jnp.repeat(a, num, axis=0)  # noqa: E731 - per row -> per position
    return Penalties(prompt.reshape(-1, vocab), counts.reshape(-1, vocab),
                     rep(penalties.presence), rep(penalties.frequency),
                     rep(penalties.repetition))  # fmt: skip


def record_kept(
    state: PenaltyState,
    slots: jax.Array,  # i32[B]
    fed: jax.Array,  # i32[B, J] the step's tokens: each row's last sampled token, its drafts
    accepted: jax.Array,  # i32[B] drafts kept
) -> PenaltyState:
    """Count a verify step's kept inputs as outputs: each row's last sampled token and its
    accepted drafts (`sampling.record_tokens` counts a plain decode row's input alike). The
    step's last emitted token (the bonus) is the row's next input, counted by the step that
    feeds it; a rejected position adds nothing."""
    kept = jnp.arange(fed.shape[1])[None, :] <= accepted[:, None]
    counts = state.output_counts.at[slots[:, None], fed].add(kept.astype(jnp.int32))
    return state._replace(output_counts=counts)


def record_history(
    state: SpecState,
    token_slots: jax.Array,  # i32[T] each token's row's slot (padding: the pad slot)
    positions: jax.Array,  # i32[T]
    tokens: jax.Array,  # i32[T]
    row_slots: jax.Array,  # i32[B]
    new_lens: jax.Array,  # i32[B] each row's length after the step
) -> SpecState:
    """A step's fed tokens into their slots' histories, and the rows' new lengths."""
    window = state.history.shape[1]
    history = state.history.at[token_slots, positions % window].set(tokens)
    return state._replace(seq_lens=state.seq_lens.at[row_slots].set(new_lens), history=history)
