"""The Mamba2 mixer over a step's packed tokens, reading and writing its layer's state pools.

Decode rows go through `mamba2_decode` (the single-token conv update and the selective state
update from the in_proj output, each state read and written once, in place by slot);
prefill/extend rows go through the varlen causal conv and the chunked SSD scan, starting
from their initial state and writing their final state — and, for rows that track this
step, the checkpoints at the tracked lengths (up to `MAX_PREFILL_CHECKPOINTS` per row: the
SSD scan's chunk-boundary states, and the K-1 conv inputs before each length gathered from
the pre-conv input and the initial conv state). A verify step's rows (speculative decoding)
read their state without writing it and return what `speculative.commit_state` needs to write
the state after the accepted prefix, once the step knows it.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxmamba.config import ModelConfig
from jaxmamba.kernels import ColumnView
from jaxmamba.kernels.conv1d import causal_conv1d_varlen, windows_at
from jaxmamba.kernels.mamba_decode import mamba2_decode
from jaxmamba.kernels.ssd import ssd_varlen
from jaxmamba.model.cache import slots_after
from jaxmamba.model.layers import Dtype, GatedGroupRMSNorm, Linear
from jaxmamba.model.metadata import ForwardMetadata
from jaxmamba.model.speculative import conv_verify, mamba2_verify
from jaxmamba.parallel.collectives import ShardLayout


def a_log_init(key, shape, dtype=jnp.float32):
    return jnp.log(jax.random.uniform(key, shape, dtype, 1.0, 16.0))


def _dt_bias_init(key, shape, dtype=jnp.float32):
    # softplus⁻¹ of dt drawn log-uniformly in [1e-3, 1e-1], as Mamba2 initialises it.
    dt = jnp.exp(jax.random.uniform(key, shape, dtype, jnp.log(1e-3), jnp.log(1e-1)))
    return dt + jnp.log(-jnp.expm1(-dt))


class DepthwiseConvWeights(nn.Module):
    """The causal conv's parameters: kernel `[K, conv_dim]` and an optional bias."""

    width: int
    channels: int
    use_bias: bool
    dtype: Dtype = jnp.float32
    axis: str = "mamba_conv"  # the logical axis of the channels

    @nn.compact
    def __call__(self) -> tuple[jax.Array, jax.Array | None]:
        init = nn.initializers.normal(0.2)
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(init, (None, self.axis)),
            (self.width, self.channels),
            self.dtype,
        )
        bias = None
        if self.use_bias:
            bias = self.param(
                "bias",
                nn.with_logical_partitioning(nn.initializers.zeros, (self.axis,)),
                (self.channels,),
                self.dtype,
            )
        return kernel, bias


class Mamba2Mixer(nn.Module):
    cfg: ModelConfig  # under tensor parallelism, one shard's (jaxmamba.parallel)
    dtype: Dtype = jnp.float32
    impl: str = "auto"
    small_m_impl: str | None = None  # see Linear
    tp: ShardLayout | None = None

    @nn.compact
    def __call__(
        self,
        x: jax.Array,  # [T, E]
        conv_pool: jax.Array,  # [S+1, K-1, conv_dim]
        ssm_pool: jax.Array,  # [S+1, H, P, N]
        meta: ForwardMetadata,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg = self.cfg
        H, P, G, N, K = (
            cfg.mamba_num_heads,
            cfg.mamba_head_dim,
            cfg.n_groups,
            cfg.ssm_state_size,
            cfg.conv_kernel,
        )
        d_inner, conv_dim = cfg.d_inner, cfg.conv_dim

        zxbcdt = Linear(
            cfg.in_proj_dim,
            ("embed", "mamba_in"),
            cfg.mamba_proj_bias,
            self.dtype,
            self.small_m_impl,
            name="in_proj",
        )(x)
        # z (columns [0, d_inner)): the gated norm reads it from zxbcdt in place.

        weight, bias = DepthwiseConvWeights(
            K, conv_dim, cfg.use_conv_bias, self.dtype, name="conv1d"
        )()
        dt_bias = self.param(
            "dt_bias", nn.with_logical_partitioning(_dt_bias_init, ("mamba_heads",)), (H,)
        )
        a_log = self.param(
            "A_log", nn.with_logical_partitioning(a_log_init, ("mamba_heads",)), (H,)
        )
        d_skip = self.param(
            "D", nn.with_logical_partitioning(nn.initializers.ones, ("mamba_heads",)), (H,)
        )
        A = -jnp.exp(a_log.astype(jnp.float32))

        outputs = []
        pending = None
        if meta.verify is not None:  # every token: J per row
            slots, num = meta.verify.state_slots, meta.verify.num_positions
            rows = slots.shape[0]
            xbc = zxbcdt[:, d_inner : d_inner + conv_dim].reshape(rows, num, conv_dim)
            conv_out, conv_inputs = conv_verify(conv_pool, xbc, weight, bias, slots)
            y_v, pending = mamba2_verify(
                ssm_pool,
                conv_out[..., :d_inner].reshape(rows, num, H, P),
                zxbcdt[:, d_inner + conv_dim :].reshape(rows, num, H),
                A,
                conv_out[..., d_inner : d_inner + G * N].reshape(rows, num, G, N),
                conv_out[..., d_inner + G * N :].reshape(rows, num, G, N),
                slots, D=d_skip, dt_bias=dt_bias,
            )  # fmt: skip
            pending = pending._replace(conv_inputs=conv_inputs)
            outputs.append(y_v.reshape(-1, d_inner))
        bd = 0 if meta.decode is None else meta.decode.state_slots.shape[0]  # decode tokens
        if meta.decode is not None:
            dec = meta.decode
            # One op from the in_proj output: conv update, state update, and the few tracking
            # rows' checkpoint copies (unused entries: pad → pad). HF and the reference
            # kernels clamp dt only in the chunked (prefill) path.
            y_d, conv_pool, ssm_pool = mamba2_decode(
                conv_pool, ssm_pool, zxbcdt, weight, bias, A, dec.state_slots,
                D=d_skip, dt_bias=dt_bias, dt_softplus=True,
                track_src=dec.track_src_slots, track_dst=dec.track_dst_slots,
                track_by_row=dec.track_slots, impl=self.impl,
            )  # fmt: skip
            outputs.append(y_d)

        if meta.prefill is not None:
            pre = meta.prefill
            # The kernels' inputs are column views: xBC and dt of the in_proj output, x, B and
            # C of the conv output. The GPU kernels read them in place (a slice in front of a
            # kernel's custom call is a copy); the references and TPU kernels slice them.
            # Behind decode rows the prefill rows start at row bd: one copy of their xBC | dt.
            packed, col = (zxbcdt, d_inner) if bd == 0 else (zxbcdt[bd:, d_inner:], 0)
            xbc_p = ColumnView.of(packed, col, (conv_dim,))
            dt_p = ColumnView.of(packed, col + conv_dim, (H,))
            has_init = pre.has_initial_state
            init_slots = slots_after(x, pre.init_slots)
            init_conv = jnp.where(has_init[:, None, None], conv_pool[init_slots], 0)
            # The conv checkpoints are windows of this layer's pre-conv input: one gather for
            # every (row, checkpoint) entry, whatever the kernel.
            conv_tracked = windows_at(
                xbc_p, init_conv, pre.cu_seqlens, pre.track_rows, pre.track_ends, K - 1
            )
            conv_out, conv_final, _ = causal_conv1d_varlen(
                xbc_p, weight, bias, pre.cu_seqlens, initial_states=init_conv,
                activation="silu", starts=pre.conv_starts, impl=self.impl,
            )  # fmt: skip
            x_p = ColumnView.of(conv_out, 0, (H, P))
            b_p = ColumnView.of(conv_out, d_inner, (G, N))
            c_p = ColumnView.of(conv_out, d_inner + G * N, (G, N))
            init_ssm = jnp.where(has_init[:, None, None, None], ssm_pool[init_slots], 0)
            y_p, ssm_final, ssm_tracked = ssd_varlen(
                x_p, dt_p, A, b_p, c_p, pre.cu_seqlens,
                chunk_size=cfg.chunk_size, D=d_skip, dt_bias=dt_bias, dt_softplus=True,
                dt_limit=tuple(cfg.time_step_limit), initial_states=init_ssm.astype(jnp.float32),
                start_positions=pre.start_positions, layout=pre.layout,
                state_chunks=pre.track_chunks, tracked=pre.tracked, impl=self.impl,
            )  # fmt: skip
            conv_pool = conv_pool.at[pre.state_slots].set(conv_final.astype(conv_pool.dtype))
            conv_pool = conv_pool.at[pre.track_slots].set(conv_tracked.astype(conv_pool.dtype))
            ssm_pool = ssm_pool.at[pre.state_slots].set(ssm_final.astype(ssm_pool.dtype))
            ssm_pool = ssm_pool.at[pre.track_slots].set(ssm_tracked.astype(ssm_pool.dtype))
            outputs.append(y_p.reshape(-1, d_inner))

        y = jnp.concatenate(outputs, axis=0) if len(outputs) > 1 else outputs[0]  # [T, H·P]
        y = GatedGroupRMSNorm(
            G, cfg.norm_eps, self.dtype, cfg.mamba_rms_norm, self.tp, self.impl, name="norm"
        )(y, zxbcdt, 0)
        out = Linear(
            cfg.hidden_size,
            ("mamba_inner", "embed"),
            cfg.mamba_proj_bias,
            self.dtype,
            self.small_m_impl,
            None if self.tp is None else self.tp.axis,
            name="out_proj",
        )(y)
        if pending is not None:  # a verify step: the state is written after acceptance
            return out, conv_pool, ssm_pool, pending
        return out, conv_pool, ssm_pool
