"""Mixture-of-experts feed-forward: a router picks `k` of `X` experts per token, the routed
experts run as grouped matmuls over the tokens sorted by expert, plus an optional shared
expert that every token goes through.

Static shapes throughout; `grouped_experts` picks the formulation by platform and the
step's (static) token count:

* CUDA: the assignments sorted by expert, each expert's group padded to whole row blocks,
  and the Pallas grouped-matmul kernel (`kernels.grouped_matmul`) over the blocks, which
  reads only the experts hit and skips unused blocks (`blocked_experts`);
* elsewhere, `T·k <= X` (decode buckets): each assignment gathers its expert's weights and
  runs a batched matvec (`gathered_experts`); larger steps `jax.lax.ragged_dot` on TPU,
  where XLA lowers it to a grouped matmul (`ragged_experts`), and the blocked layout with
  the reference's loop over blocks on CPU.

A new routing changes values, never shapes, so nothing recompiles and nothing waits for the
host. Measurements behind the choice: `scripts/bench_moe.py` (docs/benchmarks.md).

Quantized experts (FP8 or int8, `kernels.matmul.quantized`) with a scale per channel or per
expert run "blocked" on the grouped-matmul kernel on CUDA (FP8 activations times FP8 weights,
or int8 weights converted in the kernel; the scales on its output: `scaled_grouped_matmul`);
block-scaled ones, and every quantized expert elsewhere, "gathered" at decode sizes and
"blocked" with the reference's loop over blocks otherwise (`ragged_dot` takes float weights
only).

Letters: T tokens, E hidden, X experts, k experts per token, F expert width.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from jaxmamba.config import ModelConfig
from jaxmamba.kernels.common import MIN_DOT_DIM, pow2_at_least
from jaxmamba.kernels.dispatch import current_platform
from jaxmamba.kernels.grouped_matmul import (
    assignment_blocks,
    build_expert_blocks,
    grouped_matmul,
    has_kernel,
)
from jaxmamba.kernels.matmul import QuantizedWeight, scaled_grouped_matmul, scaled_matmul
from jaxmamba.model.layers import MLP, Dtype, Linear, activate, matmul_precision, quantized_param
from jaxmamba.parallel.collectives import ShardLayout, reduce


def route_softmax_topk(
    logits: jax.Array,  # f32[T, X]
    k: int,
) -> tuple[jax.Array, jax.Array]:
    """Granite: the top-k logits, softmax over those k. Returns (f32[T, k] weights, i32[T, k])."""
    top, idx = lax.top_k(logits, k)
    return jax.nn.softmax(top, axis=-1), idx


def route_softmax(
    logits: jax.Array,  # f32[T, X]
    k: int,
    normalize: bool,
) -> tuple[jax.Array, jax.Array]:
    """Qwen3-Next / Qwen3.5: softmax over every expert, the top k of those probabilities,
    renormalised to sum to 1 when `normalize`. Returns (f32[T, k] weights, i32[T, k])."""
    top, idx = lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    if normalize:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top, idx


def route_sigmoid_grouped(
    logits: jax.Array,  # f32[T, X]
    correction_bias: jax.Array,  # f32[X]
    k: int,
    num_groups: int,
    topk_groups: int,
    normalize: bool,
    scaling: float,
) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V3 / Nemotron-H: sigmoid scores; experts are chosen by score + bias, only in
    the `topk_groups` groups whose two best biased scores sum highest; the weights are the
    unbiased scores of the chosen, optionally renormalised, times `scaling`."""
    T, X = logits.shape
    scores = jax.nn.sigmoid(logits)
    choice = scores + correction_bias
    if num_groups > 1:
        grouped = choice.reshape(T, num_groups, X // num_groups)
        group_scores = lax.top_k(grouped, 2)[0].sum(-1)  # [T, G]
        _, best = lax.top_k(group_scores, topk_groups)
        keep = jnp.zeros((T, num_groups), bool).at[jnp.arange(T)[:, None], best].set(True)
        choice = jnp.where(jnp.repeat(keep, X // num_groups, axis=1), choice, -jnp.inf)
    _, idx = lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    if normalize:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * scaling, idx


def grouped_experts(
    x: jax.Array,  # [T, E]
    weights: jax.Array,  # f32[T, k]
    idx: jax.Array,  # i32[T, k]
    w_up: jax.Array | QuantizedWeight,  # [X, E, F] ([X, E, 2F] gated: gate | up)
    w_down: jax.Array | QuantizedWeight,  # [X, F, E]; quantized: the last two axes swapped
    activation: str,
    dtype: Dtype,
    impl: str = "auto",
    method: str | None = None,
) -> jax.Array:
    """`sum_j weights[t, j] · expert_{idx[t, j]}(x[t])` as f32[T, E].

    `method` None picks by platform and step size: where `impl` runs the grouped-matmul
    kernel (CUDA), "blocked" at every size on the kernel; otherwise "gathered" for at most as
    many assignments as experts, else "ragged" on TPU (XLA lowers `ragged_dot` to a grouped
    matmul there) and "blocked" on the reference elsewhere (on CUDA, XLA's `ragged_dot` costs
    every expert densely: `scripts/bench_moe.py`). Quantized weights: "blocked" on the
    kernel where `impl` runs it and their scales are per channel or per expert
    (`scaled_grouped_matmul`); otherwise "gathered", else "blocked" on the reference."""
    T, k = idx.shape
    if isinstance(w_up, QuantizedWeight) or isinstance(w_down, QuantizedWeight):
        if method == "ragged":
            raise ValueError("grouped_experts method='ragged' takes float weights only")
        if not (_kernel_scales(w_up) and _kernel_scales(w_down)):
            impl = "ref"
        if not has_kernel(impl):
            method = method or ("gathered" if T * k <= _num_experts(w_up) else "blocked")
    if method is None:
        if has_kernel(impl):
            method = "blocked"
        elif T * k <= _num_experts(w_up):
            method = "gathered"
        else:
            platform = impl.partition("_")[2] or current_platform()  # "auto_tpu": TPU
            method = "ragged" if platform == "tpu" else "blocked"
    args = (x, weights, idx, w_up, w_down, activation, dtype)
    if method == "gathered":
        return gathered_experts(*args)
    if method == "blocked":
        return blocked_experts(*args, impl=impl)
    if method != "ragged":
        raise ValueError(f"grouped_experts method={method!r}: expected 'gathered', 'blocked', "
                         "'ragged' or None")  # fmt: skip
    return ragged_experts(*args)


def ragged_experts(x, weights, idx, w_up, w_down, activation: str, dtype) -> jax.Array:
    """`grouped_experts` as two `jax.lax.ragged_dot`s over the assignments sorted by expert
    (the group sizes a device array: `bincount` with a fixed length)."""
    T, k = idx.shape
    flat = idx.reshape(-1)  # [T·k]
    order = jnp.argsort(flat, stable=True)
    token = order // k  # the token of each sorted assignment
    sizes = jnp.bincount(flat, length=w_up.shape[0]).astype(jnp.int32)  # [X]
    precision = matmul_precision(dtype)
    xs = x.astype(dtype)[token]  # [T·k, E]
    h = lax.ragged_dot(xs, w_up.astype(dtype), sizes, precision=precision,
                       preferred_element_type=jnp.float32)  # fmt: skip
    h = activate(h, activation).astype(dtype)
    y = lax.ragged_dot(h, w_down.astype(dtype), sizes, precision=precision,
                       preferred_element_type=jnp.float32)  # fmt: skip
    y = y.astype(dtype).astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    return jnp.zeros((T, x.shape[-1]), jnp.float32).at[token].add(y)


def _num_experts(w: jax.Array | QuantizedWeight) -> int:
    return (w.weight if isinstance(w, QuantizedWeight) else w).shape[0]


def _grouped(x, w, block_expert, *, dtype, out_dtype=None, impl: str):
    """`grouped_matmul` of float or quantized (`scaled_grouped_matmul`) experts."""
    if isinstance(w, QuantizedWeight):
        return scaled_grouped_matmul(x, w, block_expert, dtype=dtype, out_dtype=out_dtype,
                                     impl=impl)  # fmt: skip
    return grouped_matmul(x, w.astype(dtype), block_expert, out_dtype=out_dtype, impl=impl)


def _kernel_scales(w: jax.Array | QuantizedWeight) -> bool:
    """Whether the grouped-matmul kernel can take `w`: float, or a scale per output channel
    or per expert (block scales vary along K: the reference's loop)."""
    return not isinstance(w, QuantizedWeight) or w.scale.shape[-1] == 1


def _per_row(xs, w, flat, dtype) -> jax.Array:
    """f32 `xs[a] @ w[flat[a]]` for each row a: only the routed experts are read."""
    if isinstance(w, QuantizedWeight):
        return scaled_matmul(xs, w.take(flat), dtype=dtype, out_dtype=jnp.float32)
    return jnp.einsum("ae,aef->af", xs, w.astype(dtype)[flat], precision=matmul_precision(dtype),
                      preferred_element_type=jnp.float32)  # fmt: skip


# Rows per block of `blocked_experts` on the reference (a loop over blocks: fewer, larger).
BLOCK_ROWS = 256


def kernel_block_rows(num_assignments: int, num_experts: int) -> int:
    """Rows per block for the grouped-matmul kernel: about one block per expert hit (the
    mean group, a power of two in [16, 128]), so W is read about once per expert."""
    mean = max(1, num_assignments // num_experts)
    return min(128, max(MIN_DOT_DIM, pow2_at_least(mean)))


def blocked_experts(x, weights, idx, w_up, w_down, activation: str, dtype,
                    block: int | None = None, impl: str = "ref") -> jax.Array:  # fmt: skip
    """`grouped_experts` over row blocks of one expert each (`kernels.grouped_matmul`): the
    assignments sorted by expert, every expert's group padded to whole blocks, then a grouped
    matmul pair (the Pallas kernel, or the reference's loop of one `[block, E] x [E, F]`
    matmul per block). `block` None: `kernel_block_rows` on the kernel, `BLOCK_ROWS` on the
    reference. Static sizes: at most `min(X, T·k)·(block-1)` padding rows beyond the routed
    ones. On the kernel, at most `X/4` assignments take a block each (`assignment_blocks`:
    the layout without a sort or scatters; a shared expert is then read once per token)."""
    T, k = idx.shape
    X, E = _num_experts(w_up), x.shape[-1]
    kernel = has_kernel(impl)
    if block is None:
        block = kernel_block_rows(T * k, X) if kernel else BLOCK_ROWS
    if kernel and 4 * T * k <= X:  # few assignments: a block each, no sort
        layout = assignment_blocks(idx, block)
    else:
        layout = build_expert_blocks(idx, X, block)
    xp = jnp.concatenate([x.astype(dtype), jnp.zeros((1, E), dtype)])[layout.rows]
    h = _grouped(xp, w_up, layout.block_expert, dtype=dtype, out_dtype=jnp.float32, impl=impl)
    h = activate(h, activation).astype(dtype)
    y = _grouped(h, w_down, layout.block_expert, dtype=dtype, impl=impl)  # [NB·BM, E]
    y = y[layout.position].astype(jnp.float32).reshape(T, k, E)  # assignment order
    return jnp.sum(y * weights[..., None], axis=1)


def gathered_experts(x, weights, idx, w_up, w_down, activation: str, dtype) -> jax.Array:
    """`grouped_experts` for few assignments: each (token, expert) pair reads its expert's
    weights (a gather), so only routed experts are read."""
    T, k = idx.shape
    flat = idx.reshape(-1)  # [T·k]
    xs = jnp.repeat(x.astype(dtype), k, axis=0)  # [T·k, E]
    h = activate(_per_row(xs, w_up, flat, dtype), activation).astype(dtype)
    y = _per_row(h, w_down, flat, dtype)
    y = y.astype(dtype).astype(jnp.float32) * weights.reshape(-1)[:, None]
    return y.reshape(T, k, -1).sum(axis=1)


class MoE(nn.Module):
    """Under tensor parallelism every shard holds all experts with 1/n of their hidden units
    (and of the shared expert's), so routing is replicated and the routed sum needs one
    all-reduce (the shared expert its own)."""

    cfg: ModelConfig  # under tensor parallelism, one shard's (jaxmamba.parallel)
    dtype: Dtype = jnp.float32
    small_m_impl: str | None = None  # see Linear (router and shared expert)
    tp: ShardLayout | None = None
    impl: str = "auto"  # the grouped-matmul kernel's (see grouped_experts)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [T, E] -> [T, E]
        cfg = self.cfg
        X, k, F, E = (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                      cfg.hidden_size)  # fmt: skip
        if cfg.moe_router == "sigmoid_grouped":
            # Nemotron-H keeps the router in float32 and scores float32 inputs.
            kernel = self.param(
                "router",
                nn.with_logical_partitioning(nn.initializers.normal(0.02), ("embed", None)),
                (E, X),
                jnp.float32,
            )
            bias = self.param(
                "router_bias", nn.with_logical_partitioning(nn.initializers.zeros, (None,)), (X,)
            )
            logits = jnp.dot(x.astype(jnp.float32), kernel, precision=lax.Precision.HIGHEST)
            weights, idx = route_sigmoid_grouped(
                logits, bias, k, cfg.moe_num_groups, cfg.moe_topk_groups,
                cfg.moe_norm_topk_prob, cfg.moe_routed_scaling,
            )  # fmt: skip
        else:
            # Granite, Qwen: logits in the model dtype, softmax weights rounded back to it.
            logits = Linear(X, ("embed", None), False, self.dtype, name="router")(x)
            if cfg.moe_router == "softmax":
                weights, idx = route_softmax(logits.astype(jnp.float32), k, cfg.moe_norm_topk_prob)
            else:
                weights, idx = route_softmax_topk(logits.astype(jnp.float32), k)
            weights = weights.astype(self.dtype).astype(jnp.float32)
        width = 2 * F if cfg.mlp_activation == "silu_glu" else F
        init = nn.initializers.normal(0.02)

        def weight(name, axes, shape):  # the checkpoint's quantized form, else the float param
            quantized = quantized_param(self, name)
            if quantized is not None:
                return quantized
            return self.param(name, nn.with_logical_partitioning(init, axes), shape, self.dtype)

        w_up = weight("experts_up", ("experts", "embed", "moe_mlp"), (X, E, width))
        w_down = weight("experts_down", ("experts", "moe_mlp", "embed"), (X, F, E))
        out = grouped_experts(
            x, weights, idx, w_up, w_down, cfg.mlp_activation, self.dtype, self.impl
        )
        out = reduce(out, self.tp)
        if cfg.moe_shared_intermediate_size:
            shared = MLP(
                E, cfg.moe_shared_intermediate_size, cfg.mlp_bias, cfg.mlp_activation,
                self.dtype, self.small_m_impl, None if self.tp is None else self.tp.axis,
                name="shared_expert",
            )(x)  # fmt: skip
            if cfg.moe_shared_expert_gate:
                # Every shard computes the whole gate (one output column): replicated.
                gate = Linear(1, ("embed", None), False, self.dtype, name="shared_expert_gate")(x)
                shared = (jax.nn.sigmoid(gate.astype(jnp.float32)) * shared).astype(self.dtype)
            out = out + shared.astype(jnp.float32)
        return out.astype(self.dtype)
