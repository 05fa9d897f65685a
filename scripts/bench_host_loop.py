"""The host side of the engine loop, per decode step, on a model small enough that the device's
part is small (built-in `nemotron-h-tiny`, random weights): where a step's host time goes.

`--rows` requests decode together (short prompts, `ignore_eos`, temperature 1, as
`bench_throughput.py` runs them); once every row decodes, `--steps` steps of `LLMEngine.step`
are timed phase by phase:

* schedule: `Scheduler.schedule` (rows, slots, pages, checkpoints)
* build: `StepBuilder.build` (the `StepInputs` host arrays)
* dispatch: `ModelRunner.step` until it returns (sampler choice, the jitted step's call and
  its host-to-device transfers; not the device's work, which runs on after the call);
  launch: the jitted step's call alone
* device: then blocking until that step is computed. The engine overlaps the device with
  the host; here the device runs alone, because on a CPU backend its threads share the
  cores with the host's phases and would inflate them (on a GPU they do not)
* postprocess: `LLMEngine._postprocess` of the previous step (read back, unpack, outputs;
  its wait for the output, "wait", is ~0 here, the step being computed already)
* step: the whole `LLMEngine.step` less device and wait: the host's time per step

Medians (and minima) over the timed steps, in ms; on a busy machine the minima are the
steadier figure. "build replayed": the input build alone, 200 times on one step's rows.
`--profile` prints cProfile's top functions over a second run of the same steps (the
profile's own overhead inflates every figure).

    PYTHONPATH=. python3 scripts/bench_host_loop.py [--rows 32 256] [--steps 40] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from collections import defaultdict

import jax
import numpy as np

from jaxmamba import LLM, SamplingParams


class PhaseTimer:
    """Wraps the engine's phase methods with perf_counter timers, per step."""

    def __init__(self, engine):
        self.engine, self.times = engine, defaultdict(list)
        self.current: dict[str, float] = {}
        self._wrapped = []  # (object, name, its own attribute before or None), to restore
        sched, builder, runner = engine.scheduler, engine.builder, engine.runner
        self._wrap(sched, "schedule", "schedule")
        self._wrap(builder, "build", "build")
        self._wrap(runner, "step", "dispatch", block=True)
        if hasattr(runner, "_jit_step"):
            self._wrap(runner, "_jit_step", "launch")
        post = engine._postprocess

        def postprocess(step, packed):
            start = time.perf_counter()
            jax.block_until_ready(packed)
            waited = time.perf_counter()
            out = post(step, packed)
            self._add("wait", waited - start)
            self._add("postprocess", time.perf_counter() - waited)
            return out

        self._wrapped.append((engine, "_postprocess", None))
        engine._postprocess = postprocess

    def _wrap(self, obj, name, phase, block=False):
        fn = getattr(obj, name)
        self._wrapped.append((obj, name, vars(obj).get(name)))

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            done = time.perf_counter()
            self._add(phase, done - start)
            if block:  # the device computes alone: on CPU it would slow the host's phases
                jax.block_until_ready(out)
                self._add("device", time.perf_counter() - done)
            return out

        setattr(obj, name, timed)

    def _add(self, phase, seconds):
        self.current[phase] = self.current.get(phase, 0.0) + seconds

    def step(self):
        self.current = {}
        start = time.perf_counter()
        self.engine.step()
        total = time.perf_counter() - start
        self.current["step"] = total - self.current.get("wait", 0.0) - self.current["device"]
        for phase, seconds in self.current.items():
            self.times[phase].append(seconds)

    def restore(self):
        for obj, name, own in reversed(self._wrapped):
            if own is None:
                delattr(obj, name)  # the class's method again
            else:
                setattr(obj, name, own)


class _Replayed(Exception):
    pass


def fill(engine, rows: int, prompt_len: int, max_tokens: int, seed: int) -> None:
    """Queue `rows` requests and step until every one of them decodes."""
    rng = np.random.default_rng(seed)
    vocab = engine.model_cfg.vocab_size
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(rows):
        ids = rng.integers(0, vocab - 16, prompt_len).tolist()
        engine.add_request(f"r{seed}-{i}", {"prompt": None, "prompt_token_ids": ids}, params)
    while any(r.in_prefill for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()  # the last prefill step's outputs


def drain(engine) -> None:
    engine.abort_all()
    while engine.has_unfinished_requests():
        engine.step()


def run(llm: LLM, rows: int, steps: int, profile: bool, top: int) -> dict:
    engine = llm.engine
    prompt_len, max_tokens = 16, 4 * steps + 16
    fill(engine, rows, prompt_len, max_tokens, seed=1)  # warm-up: every bucket it meets compiles
    for _ in range(4):
        engine.step()
    drain(engine)
    compiles = engine.runner.num_compiles
    fill(engine, rows, prompt_len, max_tokens, seed=2)
    for _ in range(3):
        engine.step()
    timer = PhaseTimer(engine)
    kinds = dict(engine.stats.step_kinds)
    try:
        for _ in range(steps):
            timer.step()
    finally:
        timer.restore()
    decode_steps = engine.stats.step_kinds["decode"] - kinds["decode"]
    assert decode_steps == steps, (decode_steps, steps)
    record = {
        "rows": rows,
        "steps": steps,
        "compiles_in_timed_steps": engine.runner.num_compiles - compiles,
        "sampler_steps": dict(getattr(engine.runner, "variant_steps", {})),
        "median_ms": {k: float(np.median(v)) * 1e3 for k, v in timer.times.items()},
        "min_ms": {k: float(np.min(v)) * 1e3 for k, v in timer.times.items()},
        "all_ms": {k: [round(x * 1e3, 3) for x in v] for k, v in timer.times.items()},
    }
    # The input build alone, replayed on one step's rows (less exposed to a busy machine).
    times = []
    try:
        with engine.scheduler.transaction():  # rolled back: the schedule is not run
            scheduled = engine.scheduler.schedule()
            for _ in range(200):
                start = time.perf_counter()
                engine.builder.build(scheduled.specs, scheduled.bucket, scheduled.num_decode_rows)
                times.append(time.perf_counter() - start)
            raise _Replayed
    except _Replayed:
        pass
    record["build_replay_ms"] = {"median": float(np.median(times)) * 1e3,
                                 "min": float(np.min(times)) * 1e3}  # fmt: skip
    if profile:  # the same steps again, the device still run alone (its wait is in the profile)
        timer = PhaseTimer(engine)
        prof = cProfile.Profile()
        prof.enable()
        try:
            for _ in range(steps):
                timer.step()
        finally:
            prof.disable()
            timer.restore()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
        record["profile"] = s.getvalue()
    drain(engine)
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, nargs="+", default=[32, 256])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--max-model-len", type=int, default=4096,
                   help="sets the page table's width (the 9B serving config: 4096)")  # fmt: skip
    p.add_argument("--profile", action="store_true", help="cProfile's top functions as well")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None, help="write the records as JSON here")
    args = p.parse_args()
    max_rows = max(args.rows)
    llm = LLM(
        "nemotron-h-tiny",
        max_num_seqs=max_rows,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=max(512, max_rows * 2),
        enable_prefix_caching=False,
        kv_cache_memory_bytes=256 * 2**20,
    )
    sched = llm.engine.scheduler
    sched.use_buckets(decode=sorted({*args.rows, max_rows}))  # only the sizes timed compile
    print(f"{jax.devices()[0].device_kind}: tiny model, max_model_len {args.max_model_len}",
          flush=True)  # fmt: skip
    records = []
    for rows in args.rows:
        record = run(llm, rows, args.steps, args.profile, args.top)
        records.append(record)
        med = record["median_ms"]
        low = record["min_ms"]
        print(f"rows {rows}: " + ", ".join(f"{k} {v:.3f} ({low[k]:.3f}) ms" for k, v in med.items())
              + f"; build replayed {record['build_replay_ms']['median']:.3f} "
              f"({record['build_replay_ms']['min']:.3f}) ms"
              f"; compiles in timed steps {record['compiles_in_timed_steps']}",
              flush=True)  # fmt: skip
        if args.profile:
            print(record["profile"], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
