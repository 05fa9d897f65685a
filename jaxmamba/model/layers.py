"""Building blocks shared by the mixers: linear projections, RMS norms, the MLPs.

Every parameter is declared with logical axis names (see `LOGICAL_AXES` in `model.py`) so a
tensor-parallel mesh can shard it later without touching the layers.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from jaxmamba.kernels.common import matmul_precision
from jaxmamba.kernels.gated_norm import gated_group_rmsnorm
from jaxmamba.kernels.matmul import MAX_ROWS, QuantizedWeight, scaled_matmul, small_m_matmul
from jaxmamba.model.quantization import quantized_names
from jaxmamba.parallel.collectives import ShardLayout, group_mean_square

Dtype = Any


def quantized_param(module: nn.Module, name: str) -> QuantizedWeight | None:
    """The quantized form of `module`'s param `name` (`jaxmamba.model.quantization`), where its
    params hold one (a quantized checkpoint, or `quantization=`); else None. Random init
    always makes the float param."""
    weight, scale, input_scale = quantized_names(name)
    if not module.has_variable("params", weight):
        return None
    get = lambda n: module.get_variable("params", n)  # noqa: E731
    static = get(input_scale) if module.has_variable("params", input_scale) else None
    return QuantizedWeight(get(weight), get(scale), static)


class Linear(nn.Module):
    """`y = x @ kernel (+ bias)` with kernel `[in, out]`, accumulated in float32.

    `small_m_impl` (None: always XLA's dot) routes inputs of at most `MAX_ROWS` rows — decode
    steps — through `small_m_matmul` with that impl; longer inputs keep XLA's dot.

    `reduce_axis` (tensor parallelism, inside `shard_map`): the input features are split
    over that mesh axis (a row-parallel projection), so the float32 partial products are
    summed over it (one all-reduce) before the bias.

    Params holding a quantized weight (`weight [out, in]` FP8 or int8 and its scales) in place
    of `kernel` run `scaled_matmul` (XLA's dot, at every size).
    """

    features: int
    axes: tuple[str | None, str | None]
    use_bias: bool = False
    dtype: Dtype = jnp.float32
    small_m_impl: str | None = None
    reduce_axis: str | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(self.dtype)
        rows = x.size // x.shape[-1]
        # Accumulated in float32 either way; the product is rounded to the model dtype by the
        # matmul itself unless a bias or an all-reduce follows: a float32 product converted
        # afterwards costs a write and a read of it through HBM.
        out_dtype = jnp.float32 if self.use_bias or self.reduce_axis else self.dtype
        quantized = quantized_param(self, "kernel")
        if quantized is not None:
            y = scaled_matmul(
                x.reshape(rows, x.shape[-1]), quantized, dtype=self.dtype, out_dtype=out_dtype
            ).reshape(*x.shape[:-1], self.features)
        else:
            y = self._float_matmul(x, rows, out_dtype)
        if self.reduce_axis is not None:
            y = lax.psum(y.astype(jnp.float32), self.reduce_axis)
        if self.use_bias:
            bias = self.param(
                "bias",
                nn.with_logical_partitioning(nn.initializers.zeros, self.axes[1:]),
                (self.features,),
                self.dtype,
            )
            y = y + bias.astype(jnp.float32)
        return y.astype(self.dtype)

    def _float_matmul(self, x: jax.Array, rows: int, out_dtype) -> jax.Array:
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(nn.initializers.normal(0.02), self.axes),
            (x.shape[-1], self.features),
            self.dtype,
        )
        if self.small_m_impl is not None and 0 < rows <= MAX_ROWS:
            # Loaded params already have the model dtype (the cast is a no-op); params kept in
            # another dtype (float32 test params in a bf16 model) are rounded to it here.
            y = small_m_matmul(
                x.reshape(rows, x.shape[-1]),
                kernel.astype(self.dtype),
                out_dtype=out_dtype,
                impl=self.small_m_impl,
            ).reshape(*x.shape[:-1], self.features)
        else:
            precision = matmul_precision(self.dtype)
            y = jnp.dot(x, kernel, preferred_element_type=out_dtype, precision=precision)
        return y


class RMSNorm(nn.Module):
    """RMSNorm with the weight applied in float32 and the result cast to `dtype` (as HF does)."""

    eps: float
    dtype: Dtype = jnp.float32
    axis_name: str | None = "embed"  # None: replicated (a norm over each head's dims)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,)),
            (x.shape[-1],),
            jnp.float32,
        )
        x = x.astype(jnp.float32)
        x = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (scale * x).astype(self.dtype)


class GatedGroupRMSNorm(nn.Module):
    """`rmsnorm(y * silu(z))` normalised within `num_groups` equal groups of the last axis;
    with `normalize=False` just `y * silu(z)`, without parameters (Falcon-H1's
    `mamba_rms_norm=False`). z is columns `[z_offset, z_offset + W)` of `z_source` (the
    mixer's in_proj output), which `gated_group_rmsnorm` reads in place on the GPU kernel
    (`impl`, the mixer's). Under tensor parallelism (`tp`) `y`/`z` are one shard's columns and
    the groups are `tp.norm_group_size` columns wide, whatever `num_groups` says: that path and
    `normalize=False` are XLA fusions."""

    num_groups: int
    eps: float
    dtype: Dtype = jnp.float32
    normalize: bool = True
    tp: ShardLayout | None = None
    impl: str = "auto"

    @nn.compact
    def __call__(
        self,
        y: jax.Array,  # [..., W]
        z_source: jax.Array,  # [..., Wz]
        z_offset: int = 0,
    ) -> jax.Array:
        width = y.shape[-1]
        if not self.normalize:
            z = lax.slice_in_dim(z_source, z_offset, z_offset + width, axis=-1)
            gated = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
            return gated.astype(self.dtype)
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, ("mamba_inner",)),
            (width,),
            jnp.float32,
        )
        if self.tp is None:
            out = gated_group_rmsnorm(
                y.reshape(-1, width),
                z_source.reshape(-1, z_source.shape[-1]),
                scale,
                num_groups=self.num_groups,
                eps=self.eps,
                z_offset=z_offset,
                out_dtype=self.dtype,
                impl=self.impl,
            )
            return out.reshape(y.shape)
        z = lax.slice_in_dim(z_source, z_offset, z_offset + width, axis=-1)
        y = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
        ms = group_mean_square(y.reshape(-1, width), self.tp.norm_group_size, self.tp)
        return (scale * y * lax.rsqrt(ms.reshape(y.shape) + self.eps)).astype(self.dtype)


def activate(h: jax.Array, activation: str) -> jax.Array:
    """The MLP nonlinearity on float32 `h`; for "silu_glu", `h` is `[gate | up]` on its last
    axis."""
    if activation == "relu2":
        return jnp.square(jax.nn.relu(h))
    gate, up = jnp.split(h, 2, axis=-1)
    return jax.nn.silu(gate) * up


class MLP(nn.Module):
    """`down(relu(up(x))²)` (Nemotron-H, "relu2") or `down(silu(gate(x)) * up(x))`
    (Llama-style SwiGLU, "silu_glu")."""

    hidden_size: int
    intermediate_size: int
    use_bias: bool
    activation: str = "relu2"
    dtype: Dtype = jnp.float32
    small_m_impl: str | None = None
    reduce_axis: str | None = None  # tensor parallelism: down_proj's all-reduce (see Linear)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        linear = lambda features, axes, name, reduce=None: Linear(  # noqa: E731
            features, axes, self.use_bias, self.dtype, self.small_m_impl, reduce, name=name
        )
        F = self.intermediate_size
        if self.activation == "relu2":
            h = linear(F, ("embed", "mlp"), "up_proj")(x).astype(jnp.float32)
        else:
            gate = linear(F, ("embed", "mlp"), "gate_proj")(x)
            up = linear(F, ("embed", "mlp"), "up_proj")(x)
            h = jnp.concatenate([gate, up], axis=-1).astype(jnp.float32)
        h = activate(h, self.activation).astype(self.dtype)
        return linear(self.hidden_size, ("mlp", "embed"), "down_proj", self.reduce_axis)(h)
