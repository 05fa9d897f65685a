"""The hybrid language model: embed → [Mamba2 | Gated DeltaNet | attention | MLP | MoE |
Mamba2 ‖ attention] × L → norm → lm_head.

Functional at the jit boundary: `params`, `cache` and the step's `ForwardMetadata` go in,
hidden states and the new cache come out (`Mamba2HybridLM.apply`). The layer pattern comes
from `ModelConfig.layer_types` (each family's config adapter writes it, see
`jaxmamba.model.families`); a pure Mamba2 LM is the pattern with only "mamba".
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxmamba.config import ModelConfig
from jaxmamba.kernels.matmul import model_small_m_impl
from jaxmamba.model.attention import Attention
from jaxmamba.model.cache import StateCache
from jaxmamba.model.gdn import GatedDeltaNetMixer
from jaxmamba.model.layers import MLP, Dtype, Linear, RMSNorm, matmul_precision
from jaxmamba.model.mamba2 import Mamba2Mixer
from jaxmamba.model.metadata import ForwardMetadata
from jaxmamba.model.moe import MoE
from jaxmamba.parallel.collectives import ShardLayout, embed_lookup, gather_logits

# Logical axis names used by parameters and caches. A sharding rule maps each to a mesh axis.
LOGICAL_AXES = (
    "vocab", "embed", "mlp", "q_heads", "kv_heads",
    "mamba_in", "mamba_inner", "mamba_conv", "mamba_heads", "slots", "pages",
    "experts", "moe_mlp", "gdn_in", "gdn_conv", "gdn_heads", "gdn_inner",
)  # fmt: skip


class ParallelMixer(nn.Module):
    """Falcon-H1: a Mamba2 mixer and attention side by side on the same normed input, summed
    (their µP multipliers are folded into the projections by the family's parameter map)."""

    cfg: ModelConfig
    dtype: Dtype
    impl: str = "auto"
    small_m_impl: str | None = None
    tp: ShardLayout | None = None

    @nn.compact
    def __call__(self, x, conv_pool, ssm_pool, k_pages, v_pages, meta):
        cfg, small_m, tp = self.cfg, self.small_m_impl, self.tp
        m, conv_pool, ssm_pool, *pending = Mamba2Mixer(
            cfg, self.dtype, self.impl, small_m, tp, name="mamba"
        )(x, conv_pool, ssm_pool, meta)
        a, k_pages, v_pages = Attention(cfg, self.dtype, self.impl, small_m, tp, name="attention")(
            x, k_pages, v_pages, meta
        )
        out = (m.astype(jnp.float32) + a.astype(jnp.float32)).astype(self.dtype)
        return out, conv_pool, ssm_pool, k_pages, v_pages, *pending


class Block(nn.Module):
    """Pre-norm residual block: `x + residual_multiplier · mixer(rmsnorm(x))`; the residual
    stream stays float32."""

    cfg: ModelConfig
    layer_type: str
    dtype: Dtype
    impl: str = "auto"
    small_m_impl: str | None = None
    tp: ShardLayout | None = None

    @nn.compact
    def __call__(self, x, cache_entry, meta):
        cfg, small_m, tp = self.cfg, self.small_m_impl, self.tp
        h = RMSNorm(cfg.norm_eps, self.dtype, name="norm")(x)
        if self.layer_type == "mamba":
            out, *cache_entry = Mamba2Mixer(cfg, self.dtype, self.impl, small_m, tp, name="mixer")(
                h, *cache_entry, meta
            )
        elif self.layer_type == "gdn":
            out, *cache_entry = GatedDeltaNetMixer(
                cfg, self.dtype, self.impl, small_m, tp, name="mixer"
            )(h, *cache_entry, meta)
        elif self.layer_type == "attention":
            out, *cache_entry = Attention(cfg, self.dtype, self.impl, small_m, tp, name="mixer")(
                h, *cache_entry, meta
            )
        elif self.layer_type == "parallel":
            out, *cache_entry = ParallelMixer(
                cfg, self.dtype, self.impl, small_m, tp, name="mixer"
            )(h, *cache_entry, meta)
        elif self.layer_type == "moe":
            out = MoE(cfg, self.dtype, small_m, tp, self.impl, name="mixer")(h)
        else:
            out = MLP(
                cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.mlp_activation,
                self.dtype, small_m, None if tp is None else tp.axis, name="mixer",
            )(h)  # fmt: skip
        out = out.astype(jnp.float32)
        if cfg.residual_multiplier != 1:
            out = out * cfg.residual_multiplier
        return x + out, tuple(cache_entry)


class LMHead(nn.Module):
    """Holds the untied output projection `kernel [E, V]`."""

    hidden_size: int
    vocab_size: int
    dtype: Dtype

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param(
            "kernel",
            nn.with_logical_partitioning(nn.initializers.normal(0.02), ("embed", "vocab")),
            (self.hidden_size, self.vocab_size),
            self.dtype,
        )


class Mamba2HybridLM(nn.Module):
    """`small_m_impl` is the impl of `small_m_matmul` for every projection Linear of a step
    of at most `kernels.matmul.MAX_ROWS` tokens (the decode buckets): None (the default)
    follows `impl`, the Pallas GPU kernel where `impl` runs the GPU kernels and XLA's dot
    elsewhere; "xla" keeps XLA's dot (`kernels.matmul.model_small_m_impl`). Longer steps and
    the lm_head keep XLA's dot.

    `tp` (tensor parallelism, `jaxmamba.parallel`): this module is one shard's model, run
    inside `shard_map` — `cfg` holds the shard's sizes, the vocabulary is split into
    `tp.vocab_rows` rows per shard, and the layers all-reduce where `tp` says."""

    cfg: ModelConfig
    dtype: Dtype = jnp.float32
    impl: str = "auto"
    small_m_impl: str | None = None
    tp: ShardLayout | None = None

    def setup(self):
        cfg, tp = self.cfg, self.tp
        small_m = model_small_m_impl(self.impl, self.small_m_impl)
        vocab_rows = cfg.vocab_size if tp is None else tp.vocab_rows
        self.embed = nn.Embed(
            vocab_rows,
            cfg.hidden_size,
            dtype=self.dtype,
            param_dtype=self.dtype,
            embedding_init=nn.with_logical_partitioning(
                nn.initializers.normal(1.0), ("vocab", "embed")
            ),
        )
        self.layers = [
            Block(cfg, layer_type, self.dtype, self.impl, small_m, tp)
            for layer_type in cfg.layer_types
        ]
        self.norm_f = RMSNorm(cfg.norm_eps, self.dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = LMHead(cfg.hidden_size, vocab_rows, self.dtype)

    def __call__(
        self,
        input_ids: jax.Array,  # i32[T]
        cache: StateCache,
        meta: ForwardMetadata,
    ) -> tuple[jax.Array, StateCache]:
        """Run every layer over the step's tokens; returns normed hidden `[T, E]` and the cache.
        A verify step (`meta.verify`) also returns each recurrent layer's
        `speculative.RecurrentPending`: its state is written once the step has accepted."""
        cfg = self.cfg
        if cfg.attention_layers and meta.attention_blocks is None:
            meta = meta.with_attention_blocks(
                cfg.num_attention_heads, cfg.num_key_value_heads, self.impl
            )
        if self.tp is None:
            x = self.embed(input_ids).astype(jnp.float32)
        else:
            table = self.embed.embedding.astype(self.dtype)
            x = embed_lookup(table, input_ids, self.tp).astype(jnp.float32)
        if cfg.embedding_multiplier != 1:
            x = x * cfg.embedding_multiplier
        conv, ssm = list(cache.conv), list(cache.ssm)
        k_pages, v_pages = list(cache.k_pages), list(cache.v_pages)
        recurrent_index = {layer: i for i, layer in enumerate(cfg.recurrent_layers)}
        attention_index = {layer: i for i, layer in enumerate(cfg.attention_layers)}
        pending = [None] * len(conv)
        for layer, block in enumerate(self.layers):
            if layer in recurrent_index and layer in attention_index:
                m, a = recurrent_index[layer], attention_index[layer]
                entry = (conv[m], ssm[m], k_pages[a], v_pages[a])
                x, (conv[m], ssm[m], k_pages[a], v_pages[a], *rest) = block(x, entry, meta)
                pending[m] = rest[0] if rest else None
            elif layer in recurrent_index:
                m = recurrent_index[layer]
                x, (conv[m], ssm[m], *rest) = block(x, (conv[m], ssm[m]), meta)
                pending[m] = rest[0] if rest else None
            elif layer in attention_index:
                a = attention_index[layer]
                x, (k_pages[a], v_pages[a]) = block(x, (k_pages[a], v_pages[a]), meta)
            else:
                x, _ = block(x, (), meta)
        hidden = self.norm_f(x)
        cache = StateCache(tuple(conv), tuple(ssm), tuple(k_pages), tuple(v_pages))
        if meta.verify is not None:
            return hidden, cache, tuple(pending)
        return hidden, cache

    def forward_logits(self, input_ids, cache, meta) -> tuple[jax.Array, StateCache]:
        """Logits for every token `[T, V]` and the new cache (also what `init` traces)."""
        hidden, cache = self(input_ids, cache, meta)
        return self.logits(hidden), cache

    def logits(self, hidden: jax.Array) -> jax.Array:
        """`[..., E]` → float32 logits `[..., V]`."""
        if self.cfg.tie_word_embeddings:
            kernel = self.embed.embedding.T
        else:
            kernel = self.lm_head()
        logits = jnp.dot(
            hidden.astype(self.dtype),
            kernel,
            preferred_element_type=jnp.float32,
            precision=matmul_precision(self.dtype),
        )
        if self.cfg.logits_multiplier != 1:
            logits = logits * self.cfg.logits_multiplier
        return gather_logits(logits, self.tp)


class MtpHead(nn.Module):
    """A checkpoint's multi-token-prediction layer (`jaxmamba.model.mtp`): the target's
    embedding of the next token and its hidden state, each RMS-normed, concatenated in that
    order and projected (`fc`), then the residual blocks of `cfg.layer_types` (attention, MLP
    or MoE; each attention block on its own KV pages) and a final norm. `cfg` is
    `mtp.mtp_config`'s."""

    cfg: ModelConfig
    dtype: Dtype = jnp.float32
    impl: str = "auto"
    small_m_impl: str | None = None

    @nn.compact
    def __call__(
        self,
        embeds: jax.Array,  # [T, E] the target's embeddings of each position's next token
        hidden: jax.Array,  # [T, E] the target's (or the head's own) hidden state there
        cache: StateCache,
        meta: ForwardMetadata,
    ) -> tuple[jax.Array, StateCache]:
        cfg = self.cfg
        small_m = model_small_m_impl(self.impl, self.small_m_impl)
        if cfg.attention_layers and meta.attention_blocks is None:
            meta = meta.with_attention_blocks(
                cfg.num_attention_heads, cfg.num_key_value_heads, self.impl
            )
        e = RMSNorm(cfg.norm_eps, self.dtype, name="pre_fc_norm_embedding")(embeds)
        h = RMSNorm(cfg.norm_eps, self.dtype, name="pre_fc_norm_hidden")(hidden)
        x = Linear(cfg.hidden_size, (None, "embed"), False, self.dtype, small_m,
                   name="fc")(jnp.concatenate([e, h], axis=-1))  # fmt: skip
        x = x.astype(jnp.float32)
        k_pages, v_pages = list(cache.k_pages), list(cache.v_pages)
        attention_index = {layer: i for i, layer in enumerate(cfg.attention_layers)}
        for layer, layer_type in enumerate(cfg.layer_types):
            block = Block(cfg, layer_type, self.dtype, self.impl, small_m, name=f"layers_{layer}")
            if layer in attention_index:
                a = attention_index[layer]
                x, (k_pages[a], v_pages[a]) = block(x, (k_pages[a], v_pages[a]), meta)
            else:
                x, _ = block(x, (), meta)
        out = RMSNorm(cfg.norm_eps, self.dtype, name="norm")(x)
        return out, cache._replace(k_pages=tuple(k_pages), v_pages=tuple(v_pages))
