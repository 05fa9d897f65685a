"""Check the several-host path of tensor parallelism on one CPU host: two processes
(jax.distributed over localhost, gloo collectives), two virtual CPU devices each, one model
split over all four (TP 4); process 0 schedules and broadcasts each step, process 1
follows. Prints the greedy tokens next to a one-process TP 1 run of the same model and
exits non-zero if they differ.

    PYTHONPATH=. python scripts/dev/tp_multiprocess.py      # ~3 min on 2 busy cores
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

MODEL = "nemotron-h-tiny"
ENGINE = dict(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16, page_size=4,
              compilation_cache=False)  # fmt: skip
PROMPTS = [list(range(5, 23)), [40, 41]]  # the first is prefilled in two chunks


def generate(tensor_parallel_size: int):
    from jaxmamba import LLM, SamplingParams

    llm = LLM(MODEL, tensor_parallel_size=tensor_parallel_size, **ENGINE)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    return llm, llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)


def worker(process_id: int, port: int) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from jaxmamba.parallel import multihost

    multihost.initialize(f"localhost:{port}", 2, process_id)
    if jax.process_index() == 0:
        llm, outs = generate(jax.device_count())
        print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
        multihost.stop_followers(llm)
    else:
        from jaxmamba import LLM

        multihost.follow(LLM(MODEL, tensor_parallel_size=jax.device_count(), **ENGINE))


def main() -> int:
    port = 12000 + os.getpid() % 1000
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")  # fmt: skip
    procs = [
        subprocess.Popen([sys.executable, __file__, str(i), str(port)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]  # fmt: skip
    outputs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        if p.returncode:
            print(err[-4000:], file=sys.stderr)
            return 1
    line = next(x for x in outputs[0][0].splitlines() if x.startswith("TOKENS "))
    sharded = json.loads(line.split(" ", 1)[1])
    _, outs = generate(1)
    single = [o.outputs[0].token_ids for o in outs]
    print(f"2 processes x 2 devices, TP 4: {sharded}\n1 process, TP 1:              {single}")
    return 0 if sharded == single else 1


if __name__ == "__main__":
    if len(sys.argv) == 3:
        worker(int(sys.argv[1]), int(sys.argv[2]))
    else:
        sys.exit(main())
