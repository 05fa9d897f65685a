"""GQA self-attention over the paged KV cache, with RoPE when the config sets `rope_theta`
(Nemotron-H: none; Bamba: on half of each head; Granite/Falcon-H1: on all of it; Qwen3-Next
and Qwen3.5: on a quarter), and Qwen3-Next's per-head q/k RMSNorm and sigmoid output gate.

FP8 pages (`kv_cache_dtype="fp8"`: the cache's pages are float8_e4m3fn) hold K/s_k and V/s_v,
with the per-tensor scales of the checkpoint (`k_cache_scale`, `v_cache_scale` params) or 1
(vLLM's default). The kernels only upcast what they read: s_k multiplies the queries
(q·(s_k k) = (s_k q)·k) and s_v the output (attention is linear in V)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxmamba.config import ModelConfig
from jaxmamba.kernels.attention import paged_attention, write_kv
from jaxmamba.kernels.matmul.quantized import FP8, quantize_fp8
from jaxmamba.model.layers import Dtype, Linear, RMSNorm
from jaxmamba.model.metadata import ForwardMetadata
from jaxmamba.model.quantization import K_CACHE_SCALE, V_CACHE_SCALE
from jaxmamba.parallel.collectives import ShardLayout


def apply_rope(
    x: jax.Array,  # [T, H, Dh]
    positions: jax.Array,  # i32[T]
    theta: float,
    dim: int,
) -> jax.Array:
    """Rotate the first `dim` dims of each head by position, in halves (HF `rotate_half`
    layout), in float32; the remaining dims pass through."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))  # [dim/2]
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, dim/2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    rot = x[..., :dim].astype(jnp.float32)
    x1, x2 = rot[..., : dim // 2], rot[..., dim // 2 :]
    rot = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([rot.astype(x.dtype), x[..., dim:]], axis=-1)


class Attention(nn.Module):
    cfg: ModelConfig  # under tensor parallelism, one shard's (jaxmamba.parallel)
    dtype: Dtype
    impl: str = "auto"
    small_m_impl: str | None = None  # see Linear
    tp: ShardLayout | None = None

    @nn.compact
    def __call__(
        self,
        x: jax.Array,  # [T, E]
        k_pages: jax.Array,  # [NP+1, page_size, Hkv, Dh]
        v_pages: jax.Array,  # [NP+1, page_size, Hkv, Dh]
        meta: ForwardMetadata,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg = self.cfg
        hq, hkv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        num_tokens = x.shape[0]
        linear = lambda features, axes, name, reduce=None: Linear(  # noqa: E731
            features, axes, bias, self.dtype, self.small_m_impl, reduce, name=name
        )
        gated = cfg.attention_output_gate
        # With the output gate, q_proj yields [q_h | gate_h] for each head h.
        q = linear(hq * dh * (2 if gated else 1), ("embed", "q_heads"), "q_proj")(x)
        q = q.reshape(num_tokens, hq, -1)
        if gated:
            q, gate = q[..., :dh], q[..., dh:]
        k = linear(hkv * dh, ("embed", "kv_heads"), "k_proj")(x).reshape(num_tokens, hkv, dh)
        v = linear(hkv * dh, ("embed", "kv_heads"), "v_proj")(x).reshape(num_tokens, hkv, dh)
        if cfg.attention_qk_norm:
            q = RMSNorm(cfg.norm_eps, self.dtype, None, name="q_norm")(q)
            k = RMSNorm(cfg.norm_eps, self.dtype, None, name="k_norm")(k)
        if cfg.rope_theta:
            rope_dim = cfg.rope_dim or dh
            q = apply_rope(q, meta.positions, cfg.rope_theta, rope_dim)
            k = apply_rope(k, meta.positions, cfg.rope_theta, rope_dim)
        fp8 = k_pages.dtype == FP8
        if fp8:
            k_scale, v_scale = self._cache_scale(K_CACHE_SCALE), self._cache_scale(V_CACHE_SCALE)
            k = quantize_fp8(k, 1.0 if k_scale is None else k_scale)
            v = quantize_fp8(v, 1.0 if v_scale is None else v_scale)
            if k_scale is not None:
                q = (q.astype(jnp.float32) * k_scale).astype(q.dtype)
        k_pages, v_pages = write_kv(
            k_pages,
            v_pages,
            k.astype(k_pages.dtype),
            v.astype(v_pages.dtype),
            meta.kv_slot_mapping,
        )
        o = paged_attention(
            q,
            k_pages,
            v_pages,
            meta.page_table,
            meta.token_rows,
            meta.positions,
            scale=cfg.attention_scale or dh**-0.5,
            blocks=meta.attention_blocks,
            impl=self.impl,
        )
        if fp8 and v_scale is not None:
            o = (o.astype(jnp.float32) * v_scale).astype(o.dtype)
        if gated:
            o = (o.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(o.dtype)
        reduce = None if self.tp is None else self.tp.axis
        out = linear(cfg.hidden_size, ("q_heads", "embed"), "o_proj", reduce)(
            o.reshape(num_tokens, hq * dh)
        )
        return out, k_pages, v_pages

    def _cache_scale(self, name: str) -> jax.Array | None:
        """The checkpoint's per-tensor KV-cache scale `name` (None: 1)."""
        return self.get_variable("params", name) if self.has_variable("params", name) else None
