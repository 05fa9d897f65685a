"""Parameter pytrees: random initialisation, shapes, and logical axis names."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba.config import ModelConfig
from jaxmamba.model.cache import init_cache
from jaxmamba.model.metadata import ForwardMetadata
from jaxmamba.model.model import Mamba2HybridLM
from jaxmamba.model.quantization import quantize_params
from jaxmamba.step_contract import CacheSpec, padding


def _dummy_step(cfg: ModelConfig, dtype):
    """A one-row, `chunk_size`-token prefill: enough to trace every layer for `init`."""
    spec = CacheSpec(num_slots=1, num_pages=1, page_size=cfg.chunk_size)
    T = cfg.chunk_size
    # one row of T tokens on slot 0 and page 0; the rest padding
    inputs = padding(T, 1, 1, spec)._replace(
        query_start_loc=np.array([0, T], np.int32),
        state_slots=np.zeros(1, np.int32),
        init_slots=np.zeros(1, np.int32),
        page_table=np.zeros((1, 1), np.int32),
    )
    meta = ForwardMetadata.build(
        inputs, num_decode=0, chunk_size=cfg.chunk_size, page_size=T, pad_page=1, pad_slot=1
    )
    return inputs, init_cache(cfg, spec, dtype), meta


def _init_boxed(cfg: ModelConfig, dtype, seed: int):
    model = Mamba2HybridLM(cfg, jnp.dtype(dtype))
    inputs, cache, meta = _dummy_step(cfg, dtype)
    variables = model.init(
        jax.random.PRNGKey(seed),
        inputs.input_ids,
        cache,
        meta,
        method=Mamba2HybridLM.forward_logits,
    )
    return variables["params"]


def init_params(cfg: ModelConfig, dtype=jnp.float32, seed: int = 0):
    """Random parameters (plain arrays) for `cfg`, e.g. for the built-in presets."""
    return nn.unbox(jax.jit(lambda: _init_boxed(cfg, dtype, seed))())


def param_shapes(cfg: ModelConfig, dtype=jnp.float32):
    """The parameter pytree as `jax.ShapeDtypeStruct`s, without allocating anything."""
    return nn.unbox(jax.eval_shape(lambda: _init_boxed(cfg, dtype, 0)))


def param_logical_axes(cfg: ModelConfig):
    """The parameter pytree with each leaf replaced by its `PartitionSpec` of logical axis names."""
    return nn.get_partition_spec(jax.eval_shape(lambda: _init_boxed(cfg, jnp.float32, 0)))


def quantized_param_shapes(cfg: ModelConfig, dtype, method: str | None):
    """`param_shapes` as `quantize_params(..., method)` leaves them (`ShapeDtypeStruct`s,
    nothing allocated); the float shapes for `method` None."""
    shapes = param_shapes(cfg, dtype)
    if method is None:
        return shapes
    return jax.eval_shape(lambda p: quantize_params(p, cfg, method), shapes)
