"""One step of a model's largest prefill bucket, in a process of its own (the device's
``peak_bytes_in_use`` cannot be reset): prints, as JSON, the step temporaries the engine plans
for it (``runner.step_temporary_bytes``, what ``LLM`` subtracts from its cache budget) and the
device's bytes in use before the step and peak after it.

    python3 tests/gpu/memory_probe.py [--interpret]

The model is Nemotron-Nano-9B-v2's layer shapes (a Mamba2, an MLP, an attention and an MLP
layer; a 8192-token vocabulary keeps the weights small), or nemotron-h-tiny with
``--interpret`` (CPU: no memory figures, the path only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp

from jaxmamba.engine.batch import Bucket, RowSpec, StepBuilder
from jaxmamba.engine.runner import FULL, ModelRunner, jitted_step, step_temporary_bytes
from jaxmamba.export.compile_cache import setup_compilation_cache
from jaxmamba.model.cache import CacheSpec
from jaxmamba.model.families import config_from_preset
from jaxmamba.model.metadata import PackedStepInputs
from jaxmamba.model.params import init_params

PAGE_SIZE = 16


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--interpret", action="store_true", help="tiny model, any backend")
    args = p.parse_args()
    if os.environ.get("JAXMAMBA_COMPILATION_CACHE_DIR"):  # the test run's cache
        setup_compilation_cache(os.environ["JAXMAMBA_COMPILATION_CACHE_DIR"], quiet=True)
    if args.interpret:
        cfg, num_tokens = config_from_preset("nemotron-h-tiny"), 64
    else:
        cfg = dataclasses.replace(config_from_preset("nemotron-nano-9b-v2"), vocab_size=8192,
                                  layer_types=("mamba", "mlp", "attention", "mlp"))  # fmt: skip
        num_tokens = 1024
    dtype = jnp.bfloat16
    lengths = [num_tokens // 2, num_tokens // 4, num_tokens // 8, num_tokens // 8]
    max_pages = num_tokens // PAGE_SIZE
    spec = CacheSpec(num_slots=8, num_pages=8 * max_pages, page_size=PAGE_SIZE)
    params = init_params(cfg, dtype, seed=0)
    runner = ModelRunner(cfg, params, spec, dtype=dtype, impl="auto")
    rows = [
        RowSpec(tokens=list(range(1, n + 1)), prefix_len=0, state_slot=s,
                pages=[s * max_pages + i for i in range(-(-n // PAGE_SIZE))])
        for s, n in enumerate(lengths)
    ]  # fmt: skip
    bucket = Bucket(num_tokens, len(rows), 0)
    inputs = StepBuilder(spec, max_pages, cfg.vocab_size, cfg.chunk_size).build(rows, bucket)
    planned = step_temporary_bytes(cfg, params, spec, inputs, 0, dtype=dtype, impl="auto")

    run = runner.program_inputs((bucket, FULL), lambda _: inputs)  # the engine's (bitmask too)
    step_args, kwargs = runner.step_args(PackedStepInputs.pack(run), 0)
    compiled = jitted_step.lower(*step_args, **kwargs).compile()
    step_args = jax.block_until_ready(jax.device_put(step_args))
    device = jax.devices()[0]
    before = device.memory_stats() or {}
    jax.block_until_ready(compiled(*step_args))
    after = device.memory_stats() or {}
    print(json.dumps({
        "backend": jax.default_backend(),
        "planned_temporaries": planned,
        "in_use_before": before.get("bytes_in_use"),
        "peak_before": before.get("peak_bytes_in_use"),
        "peak_after": after.get("peak_bytes_in_use"),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
