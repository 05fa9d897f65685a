"""Multi-token-prediction speculative decoding (vLLM's ``"method": "mtp"``), on device: the
checkpoint's MTP layer proposes each row's k drafts inside the verify step (docs/speculative.md).

The MTP head (the ``mtp.*`` tensors of Qwen3-Next and Qwen3.5, as vLLM's
`qwen3_next_mtp.py` runs them, and of Nemotron-H, as its `nemotron_h_mtp.py` does) scores
position t from the target's final-normed hidden state ``h_t`` and the token at ``t + 1``:

    g_t = norm(layers(fc([rmsnorm_e(embed(x_{t+1})) | rmsnorm_h(h_t)])))

`layers` are the family's residual blocks (`Family.mtp_config`): Qwen's one decoder layer
(gated attention, then the model's MLP or MoE), Nemotron-H's `mtp_hybrid_override_pattern`
(attention, MLP and MoE blocks); attention blocks keep their own KV pages. `embed` and the
lm_head are the target's, and ``lm_head(g_t)`` predicts ``x_{t+2}``. Chained, ``g_t`` stands
in for ``h_{t+1}`` at the next position.

* **Its KV pages mirror the target's** (`SpecState.draft`, a `StateCache` of the head's
  attention layers on the target's slots and pages). Every plain step runs the head over the step's
  positions with the target's metadata (`advance_mtp`): position t pairs the target's hidden
  state there with the next token, which is the step's next input in the row or, at the row's
  last position, the token the step samples. Each slot also keeps ``g`` at its last position
  (`SpecState.mtp_hidden`), from which its next first draft follows. A prefix-cache hit or a
  chunk boundary finds the pages where the target's are; n > 1 forks copy the partial page and
  ``g`` inside the step that ends the prompt.
* **Drafting** (`propose_mtp`): ``d_1 = argmax lm_head(g_{L-1})`` from the slot's ``g``; then
  for i = 1..k-1 the head scores position ``L + i - 1`` from ``(g_{L+i-2}, d_i)``, a J-token
  forward over the verify step's metadata (later positions hold placeholders that nothing
  before them reads), and ``d_{i+1}`` is the argmax at it.
* **After acceptance** the head runs once more over the verify positions with the target's
  hidden states and emitted tokens (position j pairs ``h_{L+j}`` with the token emitted after
  it), which rewrites the draft-time KV; the row keeps ``g`` at its last kept position. KV past
  the kept positions lies past the row's length and is overwritten later, as the target's is.
* **Drafts are greedy**, a point mass, so the verify rule is the n-gram one and greedy output
  is the non-speculative one token for token.

The last prompt position's KV pairs the prompt with the request's first sampled token, so a
later prompt that hits a full cached page ending there drafts from another continuation's
pair at that position: acceptance drops, output does not change. A row whose prompt chunk
ends before the prompt does pairs its last chunk position with the sampled token as well
(the next chunk's first token is not in the step); that one position of the prompt is off.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxmamba.config import ModelConfig
from jaxmamba.model.cache import StateCache, copy_entries, init_cache
from jaxmamba.model.metadata import ForwardMetadata
from jaxmamba.step_contract import CacheSpec, StepInputs

if TYPE_CHECKING:  # the model code is imported on use (see `step.py`)
    from jaxmamba.model.model import Mamba2HybridLM, MtpHead

# The config.json key that counts a family's MTP layers (Qwen3.5's multimodal configs keep it
# in `text_config`).
MTP_LAYER_KEYS = {
    **dict.fromkeys(("qwen3_next", "nemotron_h"), "num_nextn_predict_layers"),
    **dict.fromkeys(("qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe"),
                    "mtp_num_hidden_layers"),
}  # fmt: skip


class MtpSpec(NamedTuple):
    """The static part of an MTP speculating step (a jit static argument)."""

    num_tokens: int  # k: drafts per row
    model: MtpHead
    # `SpecState.history` columns: the head does not read the token history.
    window: int = 1


def mtp_config(target: ModelConfig, hf_config: dict, model: str) -> ModelConfig:
    """The head's config: the target's, with the MTP layer's blocks (`Family.mtp_config`); a
    layout the head does not run (Nemotron-H's Mamba blocks) is a ValueError naming the model
    and the config field."""
    from jaxmamba.model.families import get_family

    try:
        return get_family(target.model_type).mtp_config(target, _text(hf_config))
    except ValueError as e:
        raise ValueError(f"speculative_config method 'mtp': {model}: {e}") from None


def _text(hf_config: dict) -> dict:
    return hf_config.get("text_config") or hf_config


def refuse_mtp_under_tp(tensor_parallel_size: int) -> ValueError:
    """The error for method "mtp" with tensor parallelism (`LLM` raises it before loading,
    `ModelRunner` for a runner built directly)."""
    return ValueError(
        f"speculative_config method 'mtp' with tensor_parallel_size={tensor_parallel_size} is "
        "not implemented: the MTP head reads the target's vocab-parallel embedding and lm_head "
        "whole; use 'ngram' or 'draft_model', or tensor_parallel_size=1 (docs/tensor_parallel.md)"
    )


def mtp_layers(hf_config: dict, model: str) -> int:
    """The checkpoint's MTP layer count; a family or checkpoint without one (or with more
    than one: the published ones have one) is a ValueError naming the model."""
    text = _text(hf_config)
    model_type = text.get("model_type", hf_config.get("model_type"))
    key = MTP_LAYER_KEYS.get(model_type)
    if key is None:
        raise ValueError(
            f"speculative_config method 'mtp': {model} (model_type {model_type!r}) has no MTP "
            f"layers this engine runs; MTP runs for {sorted(MTP_LAYER_KEYS)}"
        )
    count = text.get(key, 0) or 0
    if count == 0:
        raise ValueError(f"speculative_config method 'mtp': {model} has no MTP layers "
                         f"({key}={count})")  # fmt: skip
    if count != 1:
        raise ValueError(f"speculative_config method 'mtp': {model} has {key}={count}; one MTP "
                         "layer runs (the published checkpoints have one)")  # fmt: skip
    if text.get("mtp_use_dedicated_embeddings"):
        raise ValueError(f"speculative_config method 'mtp': {model} has "
                         "mtp_use_dedicated_embeddings=true; the MTP layer runs on the target's "
                         "embedding (false, as the published checkpoints have it)")  # fmt: skip
    return count


def load_mtp(model: str, path, num_tokens: int, target: ModelConfig, dtype,
             impl: str = "auto") -> tuple[MtpSpec, dict]:  # fmt: skip
    """The `MtpSpec` of checkpoint `path`'s MTP layer for `target` and its weights (the
    `mtp.*` tensors; the embedding and lm_head stay the target's)."""
    from jaxmamba.model.families import get_family
    from jaxmamba.model.loader import load_tensors

    if path is None:
        raise ValueError(f"speculative_config method 'mtp': {model} is not an HF checkpoint, so "
                         "it has no MTP layers (num_nextn_predict_layers=0)")  # fmt: skip
    hf_config = json.loads((path / "config.json").read_text())
    mtp_layers(hf_config, model)
    family = get_family(target.model_type)
    cfg = mtp_config(target, hf_config, model)
    params = load_tensors(path, family.mtp_param_map(cfg), dtype=dtype)
    from jaxmamba.model.model import MtpHead

    return MtpSpec(num_tokens, MtpHead(cfg, jnp.dtype(dtype), impl)), params


def init_mtp_state(mtp: MtpSpec, spec: CacheSpec) -> tuple[StateCache, jax.Array]:
    """The head's KV pages on the target's pages, and each slot's last ``g``."""
    cfg = mtp.model.cfg
    hidden = jnp.zeros((spec.num_slots + 1, cfg.hidden_size), mtp.model.dtype)
    return init_cache(cfg, spec, mtp.model.dtype), hidden


def _embed(params, ids: jax.Array, dtype) -> jax.Array:
    return params["embed"]["embedding"][ids].astype(dtype)


def next_tokens(
    input_ids: jax.Array,  # i32[T]
    sampled: jax.Array,  # i32[B] the step's sampled token per row
    meta: ForwardMetadata,
) -> jax.Array:
    """i32[T]: each position's next token: the row's next input, or at its last position the
    token the step samples."""
    following = jnp.minimum(jnp.arange(input_ids.shape[0]) + 1, input_ids.shape[0] - 1)
    same_row = (meta.token_rows[following] == meta.token_rows) & meta.token_valid[following]
    same_row = same_row & (jnp.arange(input_ids.shape[0]) + 1 < input_ids.shape[0])
    return jnp.where(same_row, input_ids[following], sampled[meta.token_rows])


def advance_mtp(
    mtp: MtpSpec,
    mtp_params,
    params,  # the target's (embedding)
    cache: StateCache,
    last_hidden: jax.Array,  # [S+1, E] each slot's g at its last position
    target_hidden: jax.Array,  # [T, E] the target's final-normed hidden states
    next_ids: jax.Array,  # i32[T] each position's next token (`next_tokens`)
    meta: ForwardMetadata,
    slots: jax.Array,  # i32[B]
    keep: jax.Array,  # i32[B] the step position whose g each row keeps
    inputs: StepInputs | None = None,  # a plain step's (its forks)
    num_decode: int = 0,
) -> tuple[StateCache, jax.Array]:
    """The head over a step's positions: its KV pages, and each row's g at `keep`. A step that
    ends a prompt with forks (n > 1) copies the partial page and g to its other samples."""
    model = mtp.model
    g, cache = model.apply({"params": mtp_params}, _embed(params, next_ids, model.dtype),
                           target_hidden.astype(model.dtype), cache, meta)  # fmt: skip
    last_hidden = last_hidden.at[slots].set(g[keep])
    if (inputs is not None and inputs.state_slots.shape[0] > num_decode
            and inputs.fork_src_slots is not None):  # fmt: skip
        cache = copy_entries(cache, inputs.fork_src_slots, inputs.fork_dst_slots,
                             inputs.fork_src_pages, inputs.fork_dst_pages)  # fmt: skip
        last_hidden = last_hidden.at[inputs.fork_dst_slots].set(last_hidden[inputs.fork_src_slots])
    return cache, last_hidden


def propose_mtp(
    mtp: MtpSpec,
    mtp_params,
    params,
    target: Mamba2HybridLM,
    cache: StateCache,
    last_hidden: jax.Array,  # [S+1, E]
    slots: jax.Array,  # i32[B]
    meta: ForwardMetadata,  # the verify step's
) -> tuple[jax.Array, StateCache]:
    """Each row's k greedy drafts (module docstring): ``i32[B, k]`` and the head's cache (its
    draft-time KV at the verify positions, rewritten by the `advance_mtp` after acceptance)."""
    model, k = mtp.model, mtp.num_tokens
    rows, num = slots.shape[0], k + 1

    def argmax(g):  # [B, E] -> i32[B]
        logits = target.apply({"params": params}, g, method="logits")
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    g0 = last_hidden[slots]
    first = argmax(g0)
    tokens = jnp.broadcast_to(first[:, None], (rows, num)).astype(jnp.int32)  # [B, J]
    hidden = jnp.broadcast_to(g0[:, None], (rows, num, g0.shape[-1]))  # [B, J, E]

    def one_pass(carry, i):
        tokens, hidden, cache = carry
        g, cache = model.apply({"params": mtp_params},
                               _embed(params, tokens.reshape(-1), model.dtype),
                               hidden.reshape(rows * num, -1), cache, meta)  # fmt: skip
        g = lax.dynamic_index_in_dim(g.reshape(rows, num, -1), i, axis=1, keepdims=False)
        tokens = lax.dynamic_update_index_in_dim(tokens, argmax(g), i + 1, axis=1)
        hidden = lax.dynamic_update_index_in_dim(hidden, g.astype(hidden.dtype), i + 1, axis=1)
        return (tokens, hidden, cache), None

    (tokens, _, cache), _ = lax.scan(
        one_pass, (tokens, hidden, cache), jnp.arange(k - 1, dtype=jnp.int32)
    )
    return tokens[:, :k], cache
