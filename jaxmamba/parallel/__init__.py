"""Tensor parallelism over a `jax.sharding.Mesh` (docs/tensor_parallel.md).

`plan.py` says how a model splits over `n` shards, `sharding.py` places parameters and the
cache on the mesh (host side), `collectives.py` is what the shard's layers do differently
(device side, inside `shard_map`), `step.py` is the engine's step over the mesh and
`multihost.py` the several-host path. The model modules import only `collectives`.
"""

from jaxmamba.parallel.collectives import ShardLayout
from jaxmamba.parallel.plan import AXIS, TensorParallelPlan

__all__ = ["AXIS", "ShardLayout", "TensorParallelPlan"]
