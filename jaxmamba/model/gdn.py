"""The Gated DeltaNet mixer (Qwen3-Next, Qwen3.5 linear attention) over a step's packed tokens,
reading and writing its layer's slot pools.

`in_proj(x) -> [q | k | v | z | b | a]`; `[q | k | v] = silu(causal depthwise conv)`; the
delta rule per value head (`kernels.gdn`) with decay `g = -exp(A_log)·softplus(a + dt_bias)`
and write strength `beta = sigmoid(b)`; then per value head `rmsnorm(o)·w·silu(z)` and
`out_proj`. Decode rows run the conv update and the fused decode update, each state read and
written once in place by slot, then copy the few tracking rows' states to their checkpoint
slots; prefill/extend rows run the varlen conv and the chunked delta rule from their initial
states and write their final states and the checkpoints at the tracked lengths (the chunk-end
states, and the K-1 conv inputs before each length), as the Mamba2 mixer does. A verify
step's rows (speculative decoding) read their state without writing it, as the Mamba2
mixer's do.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from jaxmamba.config import ModelConfig
from jaxmamba.kernels.conv1d import causal_conv1d_update, causal_conv1d_varlen, windows_at
from jaxmamba.kernels.gdn import gdn_decode, gdn_gating, gdn_prefill
from jaxmamba.model.cache import slots_after
from jaxmamba.model.layers import Dtype, Linear
from jaxmamba.model.mamba2 import DepthwiseConvWeights, a_log_init
from jaxmamba.model.metadata import ForwardMetadata
from jaxmamba.model.speculative import conv_verify, gdn_verify
from jaxmamba.parallel.collectives import ShardLayout


class GatedRMSNorm(nn.Module):
    """`rmsnorm(y)·w·silu(z)` over the last axis (one value head), as HF `RMSNormGated`: the
    normalised y is rounded to the model dtype before the weight, the gate is float32."""

    eps: float
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, y: jax.Array, z: jax.Array) -> jax.Array:  # [..., Dv], [..., Dv]
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, (None,)), (y.shape[-1],)
        )
        y = y.astype(jnp.float32)
        y = (y * lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + self.eps)).astype(self.dtype)
        out = scale * y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
        return out.astype(self.dtype)


def _split_qkv(qkv: jax.Array, cfg: ModelConfig):  # [T, gdn_conv_dim]
    kd, t = cfg.gdn_key_dim, qkv.shape[0]
    hk, dk = cfg.gdn_num_key_heads, cfg.gdn_key_head_dim
    q = qkv[:, :kd].reshape(t, hk, dk)
    k = qkv[:, kd : 2 * kd].reshape(t, hk, dk)
    v = qkv[:, 2 * kd :].reshape(t, cfg.gdn_num_value_heads, cfg.gdn_value_head_dim)
    return q, k, v


def _copy_slots(pool: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    return pool.at[dst].set(pool[src])


class GatedDeltaNetMixer(nn.Module):
    cfg: ModelConfig  # under tensor parallelism, one shard's (jaxmamba.parallel)
    dtype: Dtype = jnp.float32
    impl: str = "auto"
    small_m_impl: str | None = None  # see Linear
    tp: ShardLayout | None = None

    @nn.compact
    def __call__(
        self,
        x: jax.Array,  # [T, E]
        conv_pool: jax.Array,  # [S+1, K-1, gdn_conv_dim]
        state_pool: jax.Array,  # [S+1, HV, Dk, Dv]
        meta: ForwardMetadata,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg = self.cfg
        hv, K = cfg.gdn_num_value_heads, cfg.conv_kernel
        conv_dim, value_dim = cfg.gdn_conv_dim, cfg.gdn_value_dim

        proj = Linear(
            cfg.gdn_in_proj_dim, ("embed", "gdn_in"), False, self.dtype, self.small_m_impl,
            name="in_proj",
        )(x)  # fmt: skip
        z = proj[:, conv_dim : conv_dim + value_dim]
        b = proj[:, conv_dim + value_dim : conv_dim + value_dim + hv]
        a = proj[:, conv_dim + value_dim + hv :]
        conv = DepthwiseConvWeights(K, conv_dim, False, self.dtype, "gdn_conv", name="conv1d")
        weight, _ = conv()
        dt_bias = self.param(
            "dt_bias", nn.with_logical_partitioning(nn.initializers.ones, ("gdn_heads",)), (hv,)
        )
        a_log = self.param("A_log", nn.with_logical_partitioning(a_log_init, ("gdn_heads",)), (hv,))

        outputs = []
        pending = None
        if meta.verify is not None:  # every token: J per row
            slots, num = meta.verify.state_slots, meta.verify.num_positions
            rows = slots.shape[0]
            qkv_in = proj[:, :conv_dim].reshape(rows, num, conv_dim)
            qkv, conv_inputs = conv_verify(conv_pool, qkv_in, weight, None, slots)
            q, k, v = _split_qkv(qkv.reshape(rows * num, conv_dim), cfg)
            shaped = lambda t: t.reshape(rows, num, *t.shape[1:])  # noqa: E731
            o_v, pending = gdn_verify(
                state_pool, shaped(q), shaped(k), shaped(v), shaped(a), shaped(b), a_log, dt_bias,
                slots, scale=cfg.gdn_key_head_dim**-0.5,
            )  # fmt: skip
            pending = pending._replace(conv_inputs=conv_inputs)
            outputs.append(o_v.reshape(rows * num, hv, -1))
        bd = 0 if meta.decode is None else meta.decode.state_slots.shape[0]  # decode tokens
        if meta.decode is not None:
            dec = meta.decode
            qkv, conv_pool = causal_conv1d_update(
                conv_pool, proj[:bd, :conv_dim], weight, None, dec.state_slots,
                activation="silu", impl=self.impl,
            )  # fmt: skip
            q, k, v = _split_qkv(qkv, cfg)
            o_d, state_pool = gdn_decode(
                state_pool, q, k, v, a[:bd], b[:bd], a_log, dt_bias, dec.state_slots,
                impl=self.impl,
            )  # fmt: skip
            # Checkpoints of the rows whose length crossed the track interval: their states
            # after this token (unused entries copy the pad slot onto itself).
            conv_pool = _copy_slots(conv_pool, dec.track_src_slots, dec.track_dst_slots)
            state_pool = _copy_slots(state_pool, dec.track_src_slots, dec.track_dst_slots)
            outputs.append(o_d)

        if meta.prefill is not None:
            pre = meta.prefill
            qkv_in = proj[bd:, :conv_dim]
            has_init = pre.has_initial_state
            init_slots = slots_after(x, pre.init_slots)
            init_conv = jnp.where(has_init[:, None, None], conv_pool[init_slots], 0)
            conv_tracked = windows_at(
                qkv_in, init_conv, pre.cu_seqlens, pre.track_rows, pre.track_ends, K - 1
            )
            qkv, conv_final, _ = causal_conv1d_varlen(
                qkv_in, weight, None, pre.cu_seqlens, initial_states=init_conv,
                activation="silu", starts=pre.conv_starts, impl=self.impl,
            )  # fmt: skip
            q, k, v = _split_qkv(qkv, cfg)
            g, beta = gdn_gating(a[bd:], b[bd:], a_log, dt_bias)
            init_state = jnp.where(
                has_init[:, None, None, None], state_pool[init_slots].astype(jnp.float32), 0
            )
            o_p, state_final, state_tracked = gdn_prefill(
                q, k, v, g, beta, pre.cu_seqlens, chunk_size=cfg.chunk_size,
                initial_states=init_state, start_positions=pre.start_positions,
                layout=pre.layout, state_chunks=pre.track_chunks, tracked=pre.tracked,
                impl=self.impl,
            )  # fmt: skip
            conv_pool = conv_pool.at[pre.state_slots].set(conv_final.astype(conv_pool.dtype))
            conv_pool = conv_pool.at[pre.track_slots].set(conv_tracked.astype(conv_pool.dtype))
            state_pool = state_pool.at[pre.state_slots].set(state_final.astype(state_pool.dtype))
            state_pool = state_pool.at[pre.track_slots].set(state_tracked.astype(state_pool.dtype))
            outputs.append(o_p)

        o = jnp.concatenate(outputs, axis=0) if len(outputs) > 1 else outputs[0]  # [T, HV, Dv]
        o = GatedRMSNorm(cfg.norm_eps, self.dtype, name="norm")(o, z.reshape(o.shape))
        out = Linear(
            cfg.hidden_size,
            ("gdn_inner", "embed"),
            False,
            self.dtype,
            self.small_m_impl,
            None if self.tp is None else self.tp.axis,
            name="out_proj",
        )(o.reshape(-1, value_dim))
        if pending is not None:  # a verify step: the state is written after acceptance
            return out, conv_pool, state_pool, pending
        return out, conv_pool, state_pool
