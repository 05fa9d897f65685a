"""Draft-model speculative decoding (vLLM's ``"method": "draft_model"``), on device: a second,
smaller model of the same vocabulary proposes each row's k drafts inside the verify step, and
its own per-slot state follows what the target emitted (docs/speculative.md).

* **Its state mirrors the target's, slot for slot and page for page** (`SpecState.draft`: a
  `StateCache` of the draft's shapes on the target's `CacheSpec`). Every plain step (prefill,
  chunked prefill, decode, mixed) runs the draft over the same tokens with the same
  `ForwardMetadata` (`advance_draft`), so it writes its working states, prefix-cache
  checkpoints and KV pages at the same slot and page indices the target does: a prefix-cache
  hit, a decode checkpoint or a chunk boundary finds the draft's state where it finds the
  target's. n > 1 forks copy its states and pages inside the step that ends the prompt (the
  target's copies run after it, `step.fork_fn`). The draft runs at the target's chunk size:
  one chunk layout serves every recurrent layer of a step.
* **Drafting** (`propose_draft`): the draft scores the row's J = 1 + k verify positions with
  its own verify forward (read the state, write nothing, return the per-position terms),
  k + 1 times in a scan. Pass i feeds the row's last token and the drafts ``d_1..d_i`` known
  so far (later positions hold placeholders that nothing before them reads: every layer is
  causal) and takes ``d_{i+1}`` as the argmax of the draft's logits at position i. The last
  pass sees all J true tokens; its per-position terms are what the draft keeps.
* **Rollback** (`speculative.commit_pending`): the target keeps ``a + 1`` positions (the last
  token and a accepted drafts), and the draft writes the state after the same ``a + 1``
  positions of its own last pass, so both have consumed exactly the emitted sequence but the
  bonus token, which the next step feeds to both. Nothing is rolled back twice or replayed.
* **Drafts are greedy**, a point mass, so the verify step's acceptance rule is the n-gram's
  (`speculative.verify_sample`): greedy rows accept a draft equal to the target's argmax, and
  sampled rows accept d with probability p(d) and otherwise draw from ``normalize(max(p -
  onehot(d), 0))``; every emitted token is distributed as the target's p. Drafts sampled from
  the draft's q would accept more at high temperature but need q at every position and the
  general rule (accept with ``min(1, p(d) / q(d))``, residual ``max(p - q, 0)``).

Each pass costs the draft a J-token forward instead of a one-token one: at decode sizes the
cost is reading the draft's weights, which is the same.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxmamba.config import ModelConfig
from jaxmamba.model.cache import StateCache, copy_entries, init_cache
from jaxmamba.model.metadata import ForwardMetadata
from jaxmamba.model.speculative import RecurrentPending
from jaxmamba.step_contract import CacheSpec, StepInputs

if TYPE_CHECKING:  # the model code is imported on use (see `step.py`)
    from jaxmamba.model.model import Mamba2HybridLM


class DraftSpec(NamedTuple):
    """The static part of a draft-model speculating step (a jit static argument)."""

    num_tokens: int  # k: drafts per row
    model: Mamba2HybridLM  # the draft, at the target's chunk size (`draft_spec`)
    # `SpecState.history` columns: the draft does not read the token history.
    window: int = 1


def draft_config(draft: ModelConfig, target: ModelConfig) -> ModelConfig:
    """The draft's config as the engine runs it: the target's chunk size (one chunk layout a
    step serves every recurrent layer, target's and draft's). A vocabulary that differs from
    the target's is a ValueError: drafts are target token ids."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft model's vocab_size {draft.vocab_size} differs "
            f"from the target's {target.vocab_size}; a draft model must share the target's "
            "tokenizer and vocabulary"
        )
    return dataclasses.replace(draft, chunk_size=target.chunk_size)


def draft_spec(num_tokens: int, draft: ModelConfig, target: ModelConfig, dtype,
               impl: str = "auto", small_m_impl: str | None = None) -> DraftSpec:  # fmt: skip
    """The `DraftSpec` of a draft model of config `draft` for `target` (`draft_config`),
    computing in `dtype` with the target's kernels."""
    from jaxmamba.model.model import Mamba2HybridLM

    model = Mamba2HybridLM(draft_config(draft, target), jnp.dtype(dtype), impl, small_m_impl)
    return DraftSpec(num_tokens, model)


def init_draft_cache(draft: DraftSpec, spec: CacheSpec) -> StateCache:
    """The draft's cache: its own states and KV pages, on the target's slots and pages."""
    return init_cache(draft.model.cfg, spec, draft.model.dtype)


def advance_draft(
    draft: DraftSpec,
    params,
    cache: StateCache,
    input_ids: jax.Array,  # i32[T] the step's tokens, as the target consumed them
    meta: ForwardMetadata,  # the target's
    inputs: StepInputs,
    num_decode: int,
) -> StateCache:
    """A plain step's tokens through the draft: its working states, checkpoints and KV pages
    advance as the target's do. A step that ends a prompt with forks (n > 1) then copies the
    prompt's draft state and partial last page to its other samples."""
    _, cache = draft.model.apply({"params": params}, input_ids, cache, meta)
    if inputs.state_slots.shape[0] > num_decode and inputs.fork_src_slots is not None:
        cache = copy_entries(cache, inputs.fork_src_slots, inputs.fork_dst_slots,
                             inputs.fork_src_pages, inputs.fork_dst_pages)  # fmt: skip
    return cache


def propose_draft(
    draft: DraftSpec,
    params,
    cache: StateCache,
    last_tokens: jax.Array,  # i32[B] each row's last sampled token (its verify position 0)
    meta: ForwardMetadata,  # the verify step's
) -> tuple[jax.Array, tuple[RecurrentPending | None, ...], StateCache]:
    """Each row's k greedy drafts from the draft model (module docstring). Returns the drafts
    ``i32[B, k]``, the draft's per-position terms over the row's J true tokens (for
    `commit_pending` once the target has accepted) and its cache with their KV written."""
    rows, k = last_tokens.shape[0], draft.num_tokens
    num = k + 1
    model = draft.model

    def forward(tokens, cache):  # tokens [B, J+1]: the last column catches pass k's argmax
        hidden, cache, pending = model.apply({"params": params}, tokens[:, :num].reshape(-1),
                                             cache, meta)  # fmt: skip
        return hidden.reshape(rows, num, -1), cache, pending

    def one_pass(carry, i):
        tokens, cache, _ = carry
        hidden, cache, pending = forward(tokens, cache)
        h = lax.dynamic_index_in_dim(hidden, i, axis=1, keepdims=False)  # [B, E]
        logits = model.apply({"params": params}, h, method="logits")
        guess = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        tokens = lax.dynamic_update_index_in_dim(tokens, guess, i + 1, axis=1)
        return (tokens, cache, pending), None

    # Placeholders: the last token (any valid id; no position reads a later one).
    tokens = jnp.broadcast_to(last_tokens[:, None], (rows, num + 1)).astype(jnp.int32)
    shapes = jax.eval_shape(forward, tokens, cache)[2]
    pending = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    (tokens, cache, pending), _ = lax.scan(
        one_pass, (tokens, cache, pending), jnp.arange(num, dtype=jnp.int32)
    )
    return tokens[:, 1:num], pending, cache
