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

import dataclasses
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
def _logical_axes(cfg) -> dict[tuple[str, ...], tuple]:
    """The float parameter tree's logical axis names, by path."""
    from jaxmamba.model.params import param_logical_axes

    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    flat, _ = jax.tree_util.tree_flatten_with_path(param_logical_axes(cfg), is_leaf=is_spec)
    return {_keys(path): tuple(spec) for path, spec in flat}


def _keys(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", k)) for k in path)


@dataclasses.dataclass(frozen=True)
class _Placement:
    """Where one parameter goes: `axis` (None: replicated) of logical `name`, as float leaf
    `leaf` (a quantized weight's and scales' float leaf) in `role` ("float", "weight",
    "scale")."""

    axis: int | None
    name: str | None
    leaf: str
    role: str
    pspec: PartitionSpec


def _placement(plan: TensorParallelPlan, path: tuple[str, ...], shape) -> _Placement:
    """A parameter's placement. A quantized weight `[..., N, K]` (`quantization.py`) splits
    like the float kernel `[..., K, N]` it stands for, its axes swapped; its scales
    `[..., NS, KS]` along the same axis where they vary along it (NS or KS > 1), else
    replicated; an activation or KV-cache scale is replicated."""
    from jaxmamba.model.quantization import quantized_leaf

    axes = _logical_axes(plan.cfg)
    if path in axes:
        axis, pspec = _spec(axes[path], plan)
        return _Placement(axis, None if axis is None else axes[path][axis], path[-1], "float",
                          pspec)  # fmt: skip
    leaf, role = quantized_leaf(path[-1])
    if role in ("weight", "scale") and path[:-1] + (leaf,) in axes:
        logical = axes[path[:-1] + (leaf,)]
        logical = (*logical[:-2], logical[-1], logical[-2])  # [..., N, K]
        axis, pspec = _spec(logical, plan)
        if role == "scale" and axis is not None and shape[axis] == 1:  # one scale for all
            axis, pspec = None, PartitionSpec()
        return _Placement(axis, None if axis is None else logical[axis], leaf, role, pspec)
    if role == "replicated" and len(shape) == 0:
        return _Placement(None, None, leaf, role, PartitionSpec())
    raise ValueError(f"parameter {'/'.join(path)} {list(shape)} is not one the model declares")


def _scale_rows(plan: TensorParallelPlan, p: _Placement, s: np.ndarray, weight_shape):
    """Scales `f32[..., NS, KS]` split along the weight's output rows (NS > 1): spread to one
    row of scales per output row (block scales repeated), then rearranged like the rows."""
    from jaxmamba.kernels.matmul.quantized import BLOCK

    n = weight_shape[-2]
    if s.shape[-2] != n:
        s = np.repeat(s, BLOCK, axis=-2)[..., :n, :]
    return rearrange(plan, p.name, p.leaf, s, p.axis)


def _scale_columns(plan: TensorParallelPlan, p: _Placement, path, s: np.ndarray, weight_shape):
    """Block scales `f32[..., NS, KS]` split along the weight's input columns (a row-parallel
    block-scaled weight): each shard's columns must be whole 128-blocks."""
    from jaxmamba.kernels.matmul.quantized import BLOCK

    k = weight_shape[-1]
    proxy = np.zeros([1] * (len(weight_shape) - 1) + [k], np.int8)
    padded = rearrange(plan, p.name, p.leaf, proxy, len(weight_shape) - 1).shape[-1]
    width = padded // plan.size
    if len(_parts(plan, p.name, p.leaf, proxy, proxy.ndim - 1)) != 1 or width % BLOCK:
        raise ValueError(
            f"tensor_parallel_size={plan.size}: the block-scaled weight {'/'.join(path)} "
            f"{list(weight_shape)} splits its {k} input columns into {width} a shard (padded to "
            f"{padded}), not whole {BLOCK}-column blocks of its scales; serve it on fewer devices"
        )
    blocks = padded // BLOCK
    widths = [(0, 0)] * (s.ndim - 1) + [(0, blocks - s.shape[-1])]
    s = np.pad(s, widths, constant_values=1.0)  # the padded columns' weights are zero
    if blocks == plan.size:
        # One block a shard: its scale twice, so that the shard's weight still reads as
        # block-scaled (a 1-wide scale would make it an FP8 GEMM, `scaled_matmul`, quantizing
        # activations the whole weight does not); `expand_scale` uses the first.
        s = np.repeat(s, 2, axis=-1)
    return s


def _host_param(plan: TensorParallelPlan, p: _Placement, path, a: np.ndarray, weight_shape):
    """One parameter as placed on the mesh (host array), rearranged for its shards."""
    if p.axis is None:
        return a
    if p.role != "scale":
        return rearrange(plan, p.name, p.leaf, a, p.axis)
    if p.axis == a.ndim - 2:
        return _scale_rows(plan, p, a, weight_shape)
    return _scale_columns(plan, p, path, a, weight_shape)


def _map_params(plan: TensorParallelPlan, params, fn):
    """`fn(path, array, placement, weight_shape)` over every parameter (`weight_shape`: for a
    quantized weight's scales, the shape of the weight, else None)."""
    from jaxmamba.model.quantization import quantized_names

    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    shapes = {_keys(path): tuple(a.shape) for path, a in flat}
    out = []
    for path, a in flat:
        path = _keys(path)
        p = _placement(plan, path, a.shape)
        weight_shape = None
        if p.role == "scale":
            weight_shape = shapes[path[:-1] + (quantized_names(p.leaf)[0],)]
        out.append(fn(path, a, p, weight_shape))
    return jax.tree_util.tree_unflatten(treedef, out)


def param_specs(plan: TensorParallelPlan, params):
    """The `PartitionSpec`s over the mesh of `params` (a tree of arrays or shapes, as
    `shard_params` places it)."""
    return _map_params(plan, params, lambda path, a, p, ws: p.pspec)


def shard_params(plan: TensorParallelPlan, params, mesh: Mesh):
    """The model's parameters (whole, as loaded; float or quantized) → arrays sharded over
    `mesh`, each rearranged for its shards. Goes through host memory one array at a time."""

    def one(path, a, p, weight_shape):
        host = _host_param(plan, p, path, np.asarray(jax.device_get(a)), weight_shape)
        # Each process places only its own devices' blocks (several hosts: every process
        # holds the whole array in host memory, as it loaded it).
        return jax.make_array_from_callback(
            host.shape, NamedSharding(mesh, p.pspec), lambda index: host[index]
        )

    return _map_params(plan, params, one)


def sharded_param_shapes(plan: TensorParallelPlan, params, mesh: Mesh):
    """`shard_params`' result as `ShapeDtypeStruct`s, from the parameters' shapes only."""

    def one(path, a, p, weight_shape):
        shape = tuple(a.shape)
        if p.role == "scale":  # small: placed for real, on zeros
            shape = _host_param(plan, p, path, np.zeros(shape, np.float32), weight_shape).shape
        elif p.axis is not None:  # rearrange a 1-wide proxy to learn the grown axis
            axis = p.axis
            proxy = np.zeros([shape[axis] if d == axis else 1 for d in range(len(shape))], np.int8)
            grown = rearrange(plan, p.name, p.leaf, proxy, axis).shape[axis]
            shape = shape[:axis] + (grown,) + shape[axis + 1 :]
        return jax.ShapeDtypeStruct(shape, a.dtype, sharding=NamedSharding(mesh, p.pspec))

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


def replicate_params(params, mesh: Mesh, *, allocate: bool = True):
    """Whole parameters (a draft model's) → a copy on every device of `mesh`, through host
    memory one array at a time, each process placing only its own devices' copies (as
    `shard_params`); `allocate=False`: their `ShapeDtypeStruct`s only."""
    sharding = replicated(mesh)
    if not allocate:
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                            params)  # fmt: skip

    def one(a):
        host = np.asarray(jax.device_get(a))
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(one, params)
