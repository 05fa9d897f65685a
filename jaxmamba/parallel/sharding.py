"""Host side of tensor parallelism: the mesh, where each parameter and cache array is split,
and the load-time rearrangement that puts each shard's parts of a fused tensor side by side.

A parameter is split along its one tensor-parallel logical axis (the names each layer
declares, `model.LOGICAL_AXES`) into `n` equal contiguous blocks, block `s` on shard `s`.
Fused tensors are rearranged first so that block `s` is exactly what shard `s`'s layer
expects: `in_proj`'s output columns `[z | x | B | C | dt]` become
`[z_0 | x_0 | B_0 | C_0 | dt_0 | z_1 | ...]`, the conv channels `[x | B | C]` likewise, with
B/C groups and KV heads repeated first where `n` exceeds them (`plan.py`); a Gated DeltaNet
in_proj's `[q | k | v | z | b | a]` and conv channels `[q | k | v]` the same way, key heads
repeated where `n` exceeds them. The state cache
is laid out the same way by construction: each shard's pools hold its own channels and
heads.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxmamba.model.cache import CACHE_LOGICAL_AXES, CacheSpec, StateCache, cache_shapes
from jaxmamba.parallel.plan import TensorParallelPlan

# Logical axes split over the tensor-parallel mesh axis; every other axis is replicated.
SHARDED_AXES = frozenset(
    {"vocab", "mlp", "q_heads", "kv_heads", "mamba_in", "mamba_inner", "mamba_conv",
     "mamba_heads", "moe_mlp", "gdn_in", "gdn_conv", "gdn_heads", "gdn_inner"}
)  # fmt: skip


def make_mesh(size: int, devices=None, axis: str = "tp") -> Mesh:
    """A 1-D mesh of the first `size` devices (all processes' devices under
    `jax.distributed`)."""
    devices = list(jax.devices() if devices is None else devices)
    if size > len(devices):
        raise ValueError(
            f"tensor_parallel_size={size} needs {size} devices, there are {len(devices)} "
            f"({devices[0].platform}); on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={size}"
        )
    return Mesh(np.array(devices[:size]), (axis,))


def _spec(logical, plan: TensorParallelPlan) -> tuple[int | None, PartitionSpec]:
    names = tuple(logical)
    dims = [d for d, name in enumerate(names) if name in SHARDED_AXES]
    if len(dims) > 1:
        raise ValueError(f"an array split along two tensor-parallel axes: {names}")
    if not dims:
        return None, PartitionSpec()
    return dims[0], PartitionSpec(*(plan.axis if d == dims[0] else None
                                    for d in range(len(names))))  # fmt: skip


def _repeat_blocks(a: np.ndarray, axis: int, count: int, width: int, times: int) -> np.ndarray:
    """`count` blocks of `width` along `axis`, each repeated `times` times in place."""
    if times == 1:
        return a
    shape = a.shape[:axis] + (count, width) + a.shape[axis + 1 :]
    out = np.repeat(a.reshape(shape), times, axis=axis)
    return out.reshape(a.shape[:axis] + (count * times * width,) + a.shape[axis + 1 :])


def _pad(a: np.ndarray, axis: int, size: int) -> np.ndarray:
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return np.pad(a, widths)


def _parts(plan: TensorParallelPlan, name: str, leaf: str, a: np.ndarray, axis: int):
    """The pieces of a fused axis, each already repeated/padded to a multiple of n."""
    cfg = plan.cfg
    G, N, d = cfg.n_groups, cfg.ssm_state_size, cfg.d_inner
    split = lambda sizes: np.split(a, np.cumsum(sizes)[:-1], axis=axis)  # noqa: E731
    group = lambda p: _repeat_blocks(p, axis, G, N, plan.groups // G)  # noqa: E731
    if name == "mamba_in":
        z, x, b, c, dt = split([d, d, G * N, G * N, cfg.mamba_num_heads])
        return [z, x, group(b), group(c), dt]
    if name == "mamba_conv":
        x, b, c = split([d, G * N, G * N])
        return [x, group(b), group(c)]
    if name in ("gdn_in", "gdn_conv"):
        hk, hv = cfg.gdn_num_key_heads, cfg.gdn_num_value_heads
        kd, vd = cfg.gdn_key_dim, cfg.gdn_value_dim
        sizes = [kd, kd, vd] + ([vd, hv, hv] if name == "gdn_in" else [])
        keys = lambda p: _repeat_blocks(p, axis, hk, cfg.gdn_key_head_dim, plan.gdn_key_heads // hk)  # noqa: E731
        q, k, *rest = split(sizes)
        return [keys(q), keys(k), *rest]
    if name == "kv_heads":
        hkv = cfg.num_key_value_heads
        return [_repeat_blocks(a, axis, hkv, cfg.head_dim, plan.kv_heads // hkv)]
    if name == "vocab":
        return [_pad(a, axis, plan.padded_vocab)]
    if name == "moe_mlp" and leaf == "experts_up" and cfg.mlp_activation == "silu_glu":
        gate, up = np.split(a, 2, axis=axis)
        return [_pad(p, axis, plan.padded(p.shape[axis])) for p in (gate, up)]
    if name in ("mlp", "moe_mlp"):
        return [_pad(a, axis, plan.padded(a.shape[axis]))]
    return [a]


def rearrange(plan: TensorParallelPlan, name: str, leaf: str, a: np.ndarray, axis: int):
    """`a` with its `axis` (logical `name`) rearranged so block s of n holds shard s's parts."""
    n = plan.size
    pieces = [np.split(p, n, axis=axis) for p in _parts(plan, name, leaf, a, axis)]
    return np.concatenate([piece[s] for s in range(n) for piece in pieces], axis=axis)


@functools.lru_cache(maxsize=8)
def _logical_axes(cfg):
    from jaxmamba.model.params import param_logical_axes

    return param_logical_axes(cfg)


def param_specs(plan: TensorParallelPlan):
    """The parameter tree's `PartitionSpec`s over the mesh (a pytree like the params')."""
    logical = _logical_axes(plan.cfg)
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    return jax.tree.map(lambda spec: _spec(spec, plan)[1], logical, is_leaf=is_spec)


def _map_params(plan: TensorParallelPlan, params, fn):
    """`fn(leaf_name, array, axis, logical_name, pspec)` over every parameter."""
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    flat_logical = jax.tree.leaves(_logical_axes(plan.cfg), is_leaf=is_spec)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    if len(flat) != len(flat_logical):
        raise ValueError(f"{len(flat)} parameters, the model declares {len(flat_logical)}")
    out = []
    for (path, a), logical in zip(flat, flat_logical, strict=True):
        axis, pspec = _spec(logical, plan)
        name = None if axis is None else tuple(logical)[axis]
        out.append(fn(str(getattr(path[-1], "key", path[-1])), a, axis, name, pspec))
    return jax.tree_util.tree_unflatten(treedef, out)


def shard_params(plan: TensorParallelPlan, params, mesh: Mesh):
    """The model's parameters (whole, as loaded) → arrays sharded over `mesh`, each
    rearranged for its shards. Goes through host memory one array at a time."""

    def one(leaf, a, axis, name, pspec):
        host = np.asarray(jax.device_get(a))
        if axis is not None:
            host = rearrange(plan, name, leaf, host, axis)
        # Each process places only its own devices' blocks (several hosts: every process
        # holds the whole array in host memory, as it loaded it).
        return jax.make_array_from_callback(
            host.shape, NamedSharding(mesh, pspec), lambda index: host[index]
        )

    return _map_params(plan, params, one)


def sharded_param_shapes(plan: TensorParallelPlan, params, mesh: Mesh):
    """`shard_params`' result as `ShapeDtypeStruct`s, from the parameters' shapes only."""

    def one(leaf, a, axis, name, pspec):
        shape = tuple(a.shape)
        if axis is not None:  # rearrange a 1-wide proxy to learn the grown axis
            proxy = np.zeros([shape[axis] if d == axis else 1 for d in range(len(shape))], np.int8)
            grown = rearrange(plan, name, leaf, proxy, axis).shape[axis]
            shape = shape[:axis] + (grown,) + shape[axis + 1 :]
        return jax.ShapeDtypeStruct(shape, a.dtype, sharding=NamedSharding(mesh, pspec))

    return _map_params(plan, params, one)


def cache_specs(plan: TensorParallelPlan, spec: CacheSpec, dtype) -> StateCache:
    """Each cache array's `PartitionSpec` (heads / channels split, slots and pages whole)."""
    shapes = cache_shapes(plan.cfg, spec, dtype)
    return StateCache(**{
        field: tuple(_spec(CACHE_LOGICAL_AXES[field], plan)[1] for _ in getattr(shapes, field))
        for field in StateCache._fields
    })  # fmt: skip


def sharded_cache_shapes(plan: TensorParallelPlan, spec: CacheSpec, dtype, mesh: Mesh):
    """The whole cache as `ShapeDtypeStruct`s with their shardings: each shard's pools are
    the shard model's (`shard_config`), side by side along the split axis."""
    local = cache_shapes(plan.shard_config(), spec, dtype)
    specs = cache_specs(plan, spec, dtype)

    def grow(s, pspec):
        axes = (tuple(pspec) + (None,) * s.ndim)[: s.ndim]
        shape = tuple(dim * plan.size if ax else dim for dim, ax in zip(s.shape, axes, strict=True))
        return jax.ShapeDtypeStruct(shape, s.dtype, sharding=NamedSharding(mesh, pspec))

    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    return jax.tree.map(grow, local, specs, is_leaf=is_spec)


def init_sharded_cache(plan: TensorParallelPlan, spec: CacheSpec, dtype, mesh: Mesh):
    """A zeroed cache, allocated shard by shard on its devices."""
    shapes = sharded_cache_shapes(plan, spec, dtype, mesh)
    shardings = jax.tree.map(lambda s: s.sharding, shapes)
    make = lambda: jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), shapes)  # noqa: E731
    return jax.jit(make, out_shardings=shardings)()


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
