"""GQA self-attention over the paged KV cache (Nemotron-H attention: no RoPE)."""

from __future__ import annotations

import flax.linen as nn
import jax

from jaxmamba.config import ModelConfig
from jaxmamba.kernels.attention import paged_attention, write_kv
from jaxmamba.model.layers import Dtype, Linear
from jaxmamba.model.metadata import ForwardMetadata


class Attention(nn.Module):
    cfg: ModelConfig
    dtype: Dtype
    impl: str = "auto"
    small_m_impl: str | None = None  # see Linear

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
        linear = lambda features, axes, name: Linear(  # noqa: E731
            features, axes, bias, self.dtype, self.small_m_impl, name=name
        )
        q = linear(hq * dh, ("embed", "q_heads"), "q_proj")(x)
        k = linear(hkv * dh, ("embed", "kv_heads"), "k_proj")(x)
        v = linear(hkv * dh, ("embed", "kv_heads"), "v_proj")(x)
        k_pages, v_pages = write_kv(
            k_pages,
            v_pages,
            k.reshape(num_tokens, hkv, dh).astype(k_pages.dtype),
            v.reshape(num_tokens, hkv, dh).astype(v_pages.dtype),
            meta.kv_slot_mapping,
        )
        o = paged_attention(
            q.reshape(num_tokens, hq, dh),
            k_pages,
            v_pages,
            meta.page_table,
            meta.token_rows,
            meta.positions,
            scale=dh**-0.5,
            impl=self.impl,
        )
        out = linear(cfg.hidden_size, ("q_heads", "embed"), "o_proj")(
            o.reshape(num_tokens, hq * dh)
        )
        return out, k_pages, v_pages
