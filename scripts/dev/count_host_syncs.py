"""Count host round-trips of the engine: device→host reads per step, compilations after
warm-up, host callbacks inside the jitted step, and (with --profile, on a GPU) the
profiler's synchronisation / D2H-copy events per step.

    python scripts/dev/count_host_syncs.py --model nemotron-h-tiny
    python scripts/dev/count_host_syncs.py --model nemotron-nano-9b-v2 --dtype bfloat16 --profile
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.extend
import numpy as np

from jaxmamba import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: trace_summary
from trace_summary import load_trace_events  # noqa: E402

CALLBACKS = ("callback", "infeed", "outfeed")
SYNC_MARKERS = ("Synchronize", "MemcpyDtoH", "Memcpy DtoH", "memcpy_d2h", "DeviceToHost")


def primitives(jaxpr) -> list[str]:
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names += primitives(sub)
    return names


def callbacks_in_step(llm: LLM) -> int:
    runner, engine = llm.runner, llm.engine
    count = 0
    for bucket in engine.scheduler.all_buckets():
        step = functools.partial(runner._step_fn, num_decode=bucket.num_decode)
        inputs = engine.builder.padding(bucket)
        jaxpr = jax.make_jaxpr(step)(runner.params, runner.cache, runner.slot_state, inputs).jaxpr
        count += sum(any(c in n for c in CALLBACKS) for n in primitives(jaxpr))
    return count


def workload(name: str, vocab: int, rng) -> tuple[list[list[int]], SamplingParams]:
    if name == "prefill-heavy":
        lengths, max_tokens = rng.integers(200, 400, 16), 2
    else:
        lengths, max_tokens = rng.integers(4, 16, 8), 64
    prompts = [rng.integers(0, vocab, n).tolist() for n in lengths]
    return prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def profile_syncs(llm: LLM, prompts, sp) -> dict[str, int]:
    trace_dir = tempfile.mkdtemp(prefix="jaxmamba-trace-")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    counts: dict[str, int] = {}
    for ev in load_trace_events(trace_dir):  # one trace: a fresh folder per call
        name = str(ev.get("name", ""))
        if any(m in name for m in SYNC_MARKERS):
            counts[name] = counts.get(name, 0) + 1
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="nemotron-h-tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--profile", action="store_true", help="count profiler sync events (GPU)")
    args = p.parse_args()

    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=512,
              precompile=True)  # fmt: skip
    print(
        f"precompiled {llm.stats()['compilations']} buckets in {time.perf_counter() - start:.0f} s"
    )
    print(f"host callbacks inside the jitted step (all buckets): {callbacks_in_step(llm)}")
    rng = np.random.default_rng(0)
    vocab = min(llm.model_cfg.vocab_size, 256)
    rows = []
    for name in ("prefill-heavy", "decode-heavy"):
        prompts, sp = workload(name, vocab, rng)
        before = llm.stats()
        with jax.transfer_guard("disallow"):  # any implicit transfer raises
            llm.generate(prompt_token_ids=prompts, sampling_params=sp)
        after = llm.stats()
        steps = after["steps"] - before["steps"]
        reads = after["device_reads"] - before["device_reads"]
        compiles = after["compilations"] - before["compilations"]
        syncs = ""
        if args.profile:
            counts = profile_syncs(llm, prompts, sp)
            total = sum(counts.values())
            syncs = f"{total / max(steps, 1):.2f} ({counts})"
        rows.append((name, steps, reads / steps, compiles, syncs))
    print("\n| workload | steps | device→host reads per step | compilations after warm-up |"
          " profiler sync/D2H events per step |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name, steps, per_step, compiles, syncs in rows:
        print(
            f"| {name} | {steps} | {per_step:.2f} | {compiles} | {syncs or 'n/a (no --profile)'} |"
        )


if __name__ == "__main__":
    main()
