"""Matmuls against quantized weights: FP8 (e4m3) or int8, kept as published — ``[..., N, K]``,
the output channels first, as HF checkpoints store a Linear — with float32 scales beside.

A weight's ``scale`` is ``f32[..., NS, KS]``: NS is 1 (one scale for the tensor), N (one per
output channel) or ``ceil(N / BLOCK)`` (blocks of BLOCK output channels); KS is 1 or
``ceil(K / BLOCK)`` (blocks of BLOCK input channels). The real weight is ``weight · scale``,
each scale spread over its block.

Two ways to multiply, chosen from the weight at trace time (``scaled_matmul``):

* **FP8 GEMM** — FP8 weights with one scale per output channel (KS = 1). The activations are
  quantized to FP8 too (the checkpoint's static ``input_scale``, else a scale per token: its
  absolute maximum / 448), ``dot_general`` multiplies the two FP8 operands with float32
  accumulation, and both scales multiply the output. This is the form XLA's GEMM rewriter
  turns into Hopper's FP8 GEMM (cuBLASLt), which wants K the minor dimension of both operands:
  hence the ``[N, K]`` layout. Elsewhere (CPU, TPU v5e/v6e) XLA upcasts the operands.
* **Dequantized weight** — int8 (weight-only: the scale, per output channel, multiplies the
  output) and block-scaled FP8 (KS > 1: each 128×128 block's scale multiplies the weight).
  The weight is converted to the compute dtype inside the step and multiplied by the
  unquantized activations; XLA fuses the conversion into the dot's operand where it can.

Either way the weight stays quantized in device memory: a decode step reads 1 byte a weight.
The small-M kernel (``gpu.py``) takes bf16 ``[K, N]`` weights, so quantized projections always
run on XLA's dot. Quantized MoE experts (``scaled_grouped_matmul``) run on the grouped-matmul
kernel where their scales are per output channel or per expert.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ..common import matmul_precision

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn; values beyond it convert to NaN, so clip
INT8_MAX = 127.0
BLOCK = 128  # rows/columns of a block-scaled weight's block


class QuantizedWeight(NamedTuple):
    weight: jax.Array  # [..., N, K] float8_e4m3fn or int8
    scale: jax.Array  # f32[..., NS, KS]
    input_scale: jax.Array | None = None  # f32[]: a static activation scale (FP8 only)

    def take(self, index: jax.Array) -> QuantizedWeight:
        """The matrices ``index`` picks of a stacked ``[X, N, K]`` weight (one expert, or
        one per row); the activation scale is shared."""
        return QuantizedWeight(self.weight[index], self.scale[index], self.input_scale)


def is_fp8_gemm(w: QuantizedWeight) -> bool:
    """Whether ``w`` multiplies as an FP8 GEMM (else as a dequantized weight)."""
    return w.weight.dtype == FP8 and w.scale.shape[-1] == 1


def expand_scale(scale: jax.Array, n: int, k: int) -> jax.Array:
    """``f32[..., NS, KS]`` -> ``f32[..., N or 1, K or 1]``: each block's scale repeated over
    the block (a per-tensor or per-channel axis stays 1 wide, for broadcasting)."""
    ns, ks = scale.shape[-2:]
    if ns not in (1, n):
        scale = jnp.repeat(scale, BLOCK, axis=-2)[..., :n, :]
    if ks != 1:
        scale = jnp.repeat(scale, BLOCK, axis=-1)[..., :k]
    return scale


def dequantize(w: QuantizedWeight, dtype) -> jax.Array:
    """The real weight ``[..., N, K]`` in ``dtype``."""
    n, k = w.weight.shape[-2:]
    return (w.weight.astype(jnp.float32) * expand_scale(w.scale, n, k)).astype(dtype)


def quantize_fp8(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``x / scale`` clipped to the finite FP8 range, as float8_e4m3fn (round to nearest)."""
    return jnp.clip(x.astype(jnp.float32) / scale, -FP8_MAX, FP8_MAX).astype(FP8)


def activation_scale(x: jax.Array) -> jax.Array:
    """The dynamic per-token scale ``f32[..., 1]`` of activations ``x [..., K]``."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True)
    return jnp.maximum(amax, 1e-12) / FP8_MAX


def scaled_matmul(
    x: jax.Array,  # [M, K], or [A, K] with a weight per row [A, N, K]
    w: QuantizedWeight,  # weight [N, K] or [A, N, K]
    *,
    dtype,  # the compute dtype (of x and of a dequantized weight)
    out_dtype=None,  # default dtype
) -> jax.Array:
    """``x @ real_weight.T`` accumulated in float32 -> ``[M, N]`` (``[A, N]``) in
    ``out_dtype``. A 3-D weight multiplies each row of ``x`` by its own matrix (the gathered
    experts of a decode step)."""
    batched = w.weight.ndim == 3
    if w.weight.ndim not in (2, 3) or x.ndim != 2 or x.shape[-1] != w.weight.shape[-1]:
        raise ValueError(
            f"expected x [M, K] and weight [N, K] or [M, N, K]; got x {x.shape}, "
            f"weight {w.weight.shape}"
        )
    if batched and x.shape[0] != w.weight.shape[0]:
        raise ValueError(f"x {x.shape} needs one weight per row, got weight {w.weight.shape}")
    n, k = w.weight.shape[-2:]
    dims = (((1,), (2,)), ((0,), (0,))) if batched else (((1,), (1,)), ((), ()))
    if is_fp8_gemm(w):
        sx = activation_scale(x) if w.input_scale is None else w.input_scale
        y = lax.dot_general(quantize_fp8(x, sx), w.weight, dims,
                            preferred_element_type=jnp.float32)  # fmt: skip
        sw = expand_scale(w.scale, n, 1)[..., 0]  # [N] or [A, N] (or 1-wide)
        y = y * sx * sw
    elif w.scale.shape[-1] == 1:  # weight-only, one scale per output channel
        precision = matmul_precision(dtype)
        y = lax.dot_general(x.astype(dtype), w.weight.astype(dtype), dims, precision=precision,
                            preferred_element_type=jnp.float32)  # fmt: skip
        y = y * expand_scale(w.scale, n, 1)[..., 0]
    else:  # block-scaled: the scales vary along K, so they go on the weight
        precision = matmul_precision(dtype)
        y = lax.dot_general(x.astype(dtype), dequantize(w, dtype), dims, precision=precision,
                            preferred_element_type=jnp.float32)  # fmt: skip
    return y.astype(out_dtype or dtype)


def scaled_grouped_matmul(
    x: jax.Array,  # [NB·BM, K] rows in blocks of one expert each
    w: QuantizedWeight,  # weight [X, N, K]
    block_expert: jax.Array,  # i32[NB]; -1: an unused block
    *,
    dtype,  # the compute dtype
    out_dtype=None,  # default dtype
    impl: str = "auto",
) -> jax.Array:
    """``grouped_matmul`` of quantized experts: ``x[block b] @ real_weight[e_b].T`` as
    ``[NB·BM, N]``, the same numbers as ``scaled_matmul`` of each block (float32 sums apart).

    A scale per output channel or per expert (KS = 1): the grouped-matmul kernel where
    ``impl`` runs it, on the published ``[X, N, K]`` bytes — FP8 activations (quantized per
    row, or at the static scale) times FP8 weights, or unquantized activations times int8
    converted in the kernel — and the scales on its float32 output. Block scales (KS > 1):
    the reference's loop over blocks, each a ``scaled_matmul``. Rows of unused blocks are
    unspecified."""
    from ..grouped_matmul import grouped_matmul, has_kernel

    out_dtype = out_dtype or dtype
    nb = block_expert.shape[0]
    if has_kernel(impl) and w.scale.shape[-1] == 1:
        n = w.weight.shape[-2]
        if is_fp8_gemm(w):
            sx = activation_scale(x) if w.input_scale is None else w.input_scale
            xq = quantize_fp8(x, sx)
        else:
            sx, xq = 1.0, x.astype(dtype)
        y = grouped_matmul(xq, w.weight, block_expert, out_dtype=jnp.float32, transpose_w=True,
                           impl=impl)  # fmt: skip
        sw = expand_scale(w.scale, n, 1)[..., 0][jnp.maximum(block_expert, 0)]  # [NB, N or 1]
        sw = jnp.repeat(sw, x.shape[0] // nb, axis=0)
        return (y * sx * sw).astype(out_dtype)

    def one_block(args):
        xb, e = args
        y = scaled_matmul(xb, w.take(jnp.maximum(e, 0)), dtype=dtype, out_dtype=jnp.float32)
        return jnp.where(e >= 0, y, 0.0).astype(out_dtype)

    y = lax.map(one_block, (x.reshape(nb, -1, x.shape[-1]), block_expert))
    return y.reshape(x.shape[0], -1)
