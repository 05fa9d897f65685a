"""Several hosts, one model: every process (one per host) runs the same sharded step; the
scheduler runs on process 0 alone and broadcasts each step's inputs.

    from jaxmamba.parallel import multihost
    multihost.initialize()                      # jax.distributed.initialize, on every host
    llm = LLM(model, tensor_parallel_size=jax.device_count())   # the same call on every host
    if jax.process_index() == 0:
        outs = llm.generate(...)                # or serve; then
        multihost.stop_followers(llm)
    else:
        multihost.follow(llm)                   # runs the steps process 0 sends, until stopped

Every process loads the weights (each keeps its own devices' shards) and builds the same
engine, so the buckets, the cache and the compiled programs agree. Process 0's runner leads
(`lead`): before it dispatches a step it broadcasts a small header (the bucket) and
then the step's `StepInputs`; a follower builds padding inputs of that bucket (the same
pytree and shapes), receives process 0's values into them, and dispatches the same step.
The packed output is replicated, and only process 0 reads it. Nothing else of the engine
(scheduler, prefix cache, detokenizer) runs on the followers.

Untested across hosts: the single-host tests run the same step code over one process's
devices; `jax.distributed` with several processes has not been run here.
"""

from __future__ import annotations

import numpy as np

from jaxmamba.engine.batch import Bucket

_STEP, _STOP = 1, 0


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:  # fmt: skip
    """`jax.distributed.initialize` (arguments None: detected on TPU pods, SLURM, ...)."""
    import jax

    jax.distributed.initialize(coordinator_address, num_processes, process_id)


def _broadcast(tree):
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(tree)


def _send_step(inputs, num_decode: int):
    """The leader's `StepRunner.send_step`: the bucket, then the inputs, to every follower;
    returns the inputs as broadcast."""
    bucket = (len(inputs.input_ids), len(inputs.state_slots), num_decode)
    _broadcast(np.array([_STEP, *bucket], np.int32))
    return _broadcast(inputs)


def lead(runner):
    """Make `runner` (a `StepRunner`) process 0's: it sends every step to the followers
    first, and runs the full sampler program, the one the followers run whatever the step
    (they never read which its rows need)."""
    runner.send_step = _send_step
    runner.sampler_variants = False
    return runner


def leader(runner):
    """`runner`, made process 0's (`lead`) in a multi-process job."""
    import jax

    if jax.process_count() > 1 and jax.process_index() == 0:
        return lead(runner)
    return runner


def follow(llm) -> None:
    """A follower's loop: run every step process 0 broadcasts, until it stops."""
    runner, builder = llm.runner, llm.engine.builder
    while True:
        command, t, b, d = (int(x) for x in _broadcast(np.zeros(4, np.int32)))
        if command == _STOP:
            return
        inputs = _broadcast(builder.padding(Bucket(t, b, d)))
        runner.step(inputs, d)


def stop_followers(llm) -> None:
    """Process 0: end every follower's `follow` loop."""
    if llm.runner.send_step is _send_step:
        _broadcast(np.array([_STOP, 0, 0, 0], np.int32))
