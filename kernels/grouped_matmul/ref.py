"""The grouped matmul's reference: a loop over the row blocks, one expert's ``jnp.dot`` each."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..common import matmul_precision


def grouped_matmul_ref(
    x: jax.Array,  # [NB·BM, K]
    w: jax.Array,  # [X, K, N], or [X, N, K] with transpose_w
    block_expert: jax.Array,  # i32[NB]; -1: an unused block (zeros out)
    *,
    out_dtype=None,
    transpose_w: bool = False,
) -> jax.Array:
    nb = block_expert.shape[0]
    rows, k = x.shape
    precision = matmul_precision(x.dtype)
    out_dtype = out_dtype or x.dtype
    dims = (((1,), (1 if transpose_w else 0,)), ((), ()))

    def one_block(args):
        xb, e = args
        we = w[jnp.maximum(e, 0)]
        if we.dtype != x.dtype:  # int8 weights: converted to the activations' dtype
            we = we.astype(x.dtype)
        y = lax.dot_general(xb, we, dims, precision=precision,
                            preferred_element_type=jnp.float32)  # fmt: skip
        return jnp.where(e >= 0, y, 0.0).astype(out_dtype)

    y = lax.map(one_block, (x.reshape(nb, rows // nb, k), block_expert))
    return y.reshape(rows, w.shape[1 if transpose_w else 2])
