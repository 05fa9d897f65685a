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
engine, so the buckets, the cache and the compiled programs agree. Process 0's runner is a
`LeaderRunner`: before it dispatches a step it broadcasts a small header (the bucket) and
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


class LeaderRunner:
    """Process 0's runner: a `ModelRunner` whose every step is first sent to the followers."""

    def __init__(self, runner):
        self._runner = runner

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def step(self, inputs, num_decode: int, *, top_logprobs: bool = True, ranks: bool = True):
        # The followers run the full sampler program (the sharded step has no other), so the
        # leader does too whatever `top_logprobs` and `ranks` say: it serves every step.
        del top_logprobs, ranks
        bucket = (len(inputs.input_ids), len(inputs.state_slots), num_decode)
        _broadcast(np.array([_STEP, *bucket], np.int32))
        inputs = _broadcast(inputs)
        return self._runner.step(inputs, num_decode)

    def stop(self) -> None:
        _broadcast(np.array([_STOP, 0, 0, 0], np.int32))


def leader(runner):
    """Process 0's `LeaderRunner` in a multi-process job; otherwise `runner` itself."""
    import jax

    if jax.process_count() > 1 and jax.process_index() == 0:
        return LeaderRunner(runner)
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
    if isinstance(llm.runner, LeaderRunner):
        llm.runner.stop()
