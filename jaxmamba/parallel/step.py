"""The engine's step over a tensor-parallel mesh: the same `step_fn`, one shard's model,
inside one `shard_map`.

Every device runs the step on its shard of the parameters and the cache, with the step's
inputs, the sampler's per-slot state and hence the metadata replicated; the Pallas kernels
see their shard's heads as a whole model's. The layers all-reduce after each row-parallel
projection, the logits are gathered, and every device samples the same tokens from the
same full logits, so the packed output (read from any one device) and the per-slot state
stay replicated. One dispatch per step for the whole mesh.

Speculative decoding (docs/speculative.md) runs here unchanged: a verify step's layers keep
their shard's heads' per-position terms and commit them to their shard of the cache, and
the n-gram history, the slot lengths and a draft model's (`DraftSpec`) states live in the
replicated slot state. The draft model is not split: every device holds its whole weights
and runs it on the same inputs, so every device proposes the same drafts without a
collective.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
from jax.sharding import Mesh, PartitionSpec

from jaxmamba.model.draft import DraftSpec
from jaxmamba.model.speculative import NgramSpec
from jaxmamba.model.step import FULL, fork_fn, init_slot_state, logits_fn, score_fn, step_fn
from jaxmamba.parallel.plan import TensorParallelPlan

REPLICATED = PartitionSpec()


@dataclass(frozen=True)
class MeshPlan:
    """A plan and the mesh it runs on (static: a jit argument)."""

    plan: TensorParallelPlan
    mesh: Mesh


def _shard_mapped(fn, mesh_plan: MeshPlan, params, spec, dtype, out_cache: bool,
                  extra_args: int = 0):  # fmt: skip
    """`fn(params, cache, a, b, *extra)` over the mesh: params and cache split, the rest
    (`extra_args` more of them) replicated."""
    from jaxmamba.parallel.sharding import cache_specs, param_specs

    plan = mesh_plan.plan
    params, cache = param_specs(plan, params), cache_specs(plan, spec, dtype)
    in_specs = (params, cache, REPLICATED, REPLICATED) + (REPLICATED,) * extra_args
    out_specs = (REPLICATED, cache, REPLICATED) if out_cache else (REPLICATED, cache)
    # check_vma off: the Pallas calls carry no replication annotations; the outputs marked
    # replicated are, since each is computed from all-reduced or gathered values (or, for a
    # draft model's drafts, by the same replicated computation on every device).
    return jax.shard_map(fn, mesh=mesh_plan.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)  # fmt: skip


def tp_step_fn(params, cache, slot_state, inputs, draft_params=None, *, model, spec,
               num_decode, mesh_plan, sampler: str = FULL,
               speculative: NgramSpec | DraftSpec | None = None):  # fmt: skip
    """`model.step.step_fn` over the mesh (`model` is the shard model). `speculative`: a
    speculating runner's step (its slot state has `spec`, replicated); a `DraftSpec`'s
    `draft_params` are replicated, its model the whole draft."""
    body = functools.partial(step_fn, model=model, spec=spec, num_decode=num_decode,
                             sampler=sampler, speculative=speculative)  # fmt: skip
    extra = () if draft_params is None else (draft_params,)
    mapped = _shard_mapped(body, mesh_plan, params, spec, model.dtype, out_cache=True,
                           extra_args=len(extra))  # fmt: skip
    return mapped(params, cache, slot_state, inputs, *extra)


def tp_logits_fn(params, cache, inputs, *, model, spec, num_decode, mesh_plan):
    def body(params, cache, _unused, inputs):
        return logits_fn(params, cache, inputs, model=model, spec=spec, num_decode=num_decode)

    return _shard_mapped(body, mesh_plan, params, spec, model.dtype, out_cache=False)(
        params, cache, (), inputs
    )


def tp_score_fn(params, prompt_hidden, targets, *, model, spec, mesh_plan):
    """`model.step.score_fn` over the mesh: each device's logits shard, gathered, then the same
    prompt logprobs on every device."""
    from jaxmamba.parallel.sharding import param_specs

    body = functools.partial(score_fn, model=model, spec=spec)
    in_specs = (param_specs(mesh_plan.plan, params), REPLICATED, REPLICATED)
    return jax.shard_map(body, mesh=mesh_plan.mesh, in_specs=in_specs, out_specs=REPLICATED,
                         check_vma=False)(params, prompt_hidden, targets)  # fmt: skip


def tp_fork_fn(cache, *forks, model, spec, mesh_plan):
    """`model.step.fork_fn` over the mesh: each device copies its shard of the slots and pages."""
    from jaxmamba.parallel.sharding import cache_specs

    body = functools.partial(fork_fn, model=model, spec=spec)
    specs = cache_specs(mesh_plan.plan, spec, model.dtype)
    return jax.shard_map(body, mesh=mesh_plan.mesh, in_specs=(specs, *[REPLICATED] * len(forks)),
                         out_specs=specs, check_vma=False)(cache, *forks)  # fmt: skip


jitted_tp_step = jax.jit(
    tp_step_fn,
    static_argnames=("model", "spec", "num_decode", "mesh_plan", "sampler", "speculative"),
    donate_argnames=("cache", "slot_state"),
)
jitted_tp_score = jax.jit(tp_score_fn, static_argnames=("model", "spec", "mesh_plan"))
jitted_tp_fork = jax.jit(
    tp_fork_fn, static_argnames=("model", "spec", "mesh_plan"), donate_argnames=("cache",)
)
jitted_tp_logits = jax.jit(
    tp_logits_fn,
    static_argnames=("model", "spec", "num_decode", "mesh_plan"),
    donate_argnames=("cache",),
)


def mesh_plan(cfg, size: int, mesh: Mesh | None = None) -> MeshPlan:
    """The plan for `size` shards of `cfg` on `mesh` (default: the first `size` devices)."""
    from jaxmamba.parallel.sharding import make_mesh

    if mesh is None:
        mesh = make_mesh(size)
    elif mesh.devices.size != size and size != 1:
        raise ValueError(f"tensor_parallel_size={size} but the mesh has {mesh.devices.size} "
                         "devices")  # fmt: skip
    axis = mesh.axis_names[0]
    return MeshPlan(TensorParallelPlan(cfg, int(mesh.devices.size), axis), mesh)


def lower_step(mesh_plan: MeshPlan, param_shapes, spec, inputs, num_decode: int, *, dtype,
               impl: str = "auto", small_m_impl: str | None = None,
               speculative: NgramSpec | DraftSpec | None = None,
               draft_params=None):  # fmt: skip
    """Lower the sharded step from shapes only (`param_shapes`: the whole model's, as
    `param_shapes` gives them; `inputs`: a `StepInputs` of arrays or shapes) — for memory
    sizing and deviceless compiles over a TPU topology's devices. `speculative` (and a
    `DraftSpec`'s `draft_params`, arrays or shapes): a speculating runner's step."""
    import jax.numpy as jnp

    from jaxmamba.model.model import Mamba2HybridLM
    from jaxmamba.parallel.sharding import (
        replicated,
        sharded_cache_shapes,
        sharded_param_shapes,
    )

    plan, mesh = mesh_plan.plan, mesh_plan.mesh
    dtype = jnp.dtype(dtype)
    model = Mamba2HybridLM(plan.shard_config(), dtype, impl, small_m_impl, plan.layout())
    rep = replicated(mesh)
    on_mesh = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep)  # noqa: E731
    slot_state = jax.eval_shape(lambda: init_slot_state(plan.cfg, spec, dtype, speculative))
    args = (
        sharded_param_shapes(plan, param_shapes, mesh),
        sharded_cache_shapes(plan, spec, dtype, mesh),
        jax.tree.map(on_mesh, slot_state),
        jax.tree.map(on_mesh, inputs),
    )
    if draft_params is not None:
        args += (jax.tree.map(on_mesh, draft_params),)
    extra = {} if speculative is None else {"speculative": speculative}
    return jitted_tp_step.lower(*args, model=model, spec=spec, num_decode=num_decode,
                                mesh_plan=mesh_plan, **extra)  # fmt: skip


def step_memory(cfg, size: int, params, spec, inputs, num_decode: int, *, dtype,
                impl: str = "auto", small_m_impl: str | None = None,
                speculative: NgramSpec | DraftSpec | None = None,
                draft_params=None):  # fmt: skip
    """XLA's memory analysis (one device's) of the sharded step of this bucket."""
    lowered = lower_step(mesh_plan(cfg, size), params, spec, inputs, num_decode, dtype=dtype,
                         impl=impl, small_m_impl=small_m_impl, speculative=speculative,
                         draft_params=draft_params)  # fmt: skip
    return lowered.compile().memory_analysis()
