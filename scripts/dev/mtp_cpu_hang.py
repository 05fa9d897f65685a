"""Reproduce the XLA:CPU hang of an MTP verify step, or show that its work-around holds.

Builds the test suite's Qwen3-Next checkpoint with an MTP head that agrees with the target
(`tests/test_speculative_mtp.py`), starts a greedy generation with `method: "mtp"`, and at
its first verify step runs that same step `--runs` times more, waiting for each. A run that
is not done after `--timeout` seconds is a hang: Python's stacks are printed and the script
exits 1 (every XLA thread is then idle, the main thread waiting for the step's output).

    python scripts/dev/mtp_cpu_hang.py                    # the engine as it is: 300 runs pass
    python scripts/dev/mtp_cpu_hang.py --fusion-emitters  # the default jit: hangs in ~100 runs

`--fusion-emitters` puts the MTP runner back on the default step jit, compiled with XLA:CPU's
fusion emitters (docs/speculative.md, MTP; docs/history.md, 2026-12-07).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import tempfile
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=300)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds one run may take")
    p.add_argument("--fusion-emitters", action="store_true",
                   help="MTP steps through the default jit (with the fusion emitters)")  # fmt: skip
    args = p.parse_args()
    os.environ["JAXMAMBA_SAMPLER_VARIANTS"] = "0"

    import test_speculative_mtp as mtp_tests

    from jaxmamba import LLM, SamplingParams
    from jaxmamba.engine.runner import ModelRunner, step_bucket
    from jaxmamba.model import step

    from hf_fixtures import make_qwen3_next_checkpoint

    dispatch = ModelRunner.step
    hammered = False

    def step_and_repeat(self, inputs, num_decode, **kwargs):
        nonlocal hammered
        out = dispatch(self, inputs, num_decode, **kwargs)
        if num_decode and not hammered and self.speculative is not None:
            hammered = True
            jax.block_until_ready(out)
            start = time.perf_counter()
            for _ in range(args.runs):
                faulthandler.dump_traceback_later(args.timeout, exit=True)  # exit code 1
                jax.block_until_ready(dispatch(self, inputs, num_decode, **kwargs))
            faulthandler.cancel_dump_traceback_later()
            print(f"{args.runs} runs of the verify step {step_bucket(inputs, num_decode)} "
                  f"finished in {time.perf_counter() - start:.1f} s: no hang")  # fmt: skip
        return out

    ModelRunner.step = step_and_repeat
    path, _ = make_qwen3_next_checkpoint(Path(tempfile.mkdtemp()), seed=2)
    mtp_tests._add_mtp(path, seed=3, agree=True)
    llm = LLM(str(path), speculative_config=mtp_tests.MTP, **mtp_tests.ENGINE)
    if args.fusion_emitters:
        llm.engine.runner._jit_step = step.jitted_step
    jit = "jitted_step" if args.fusion_emitters else "jitted_step_without_cpu_fusion_emitters"
    print(f"backend {jax.default_backend()}, MTP steps through {jit}")
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    llm.generate(None, greedy, prompt_token_ids=mtp_tests.PROMPTS, use_tqdm=False)
    return 0 if hammered else 2


if __name__ == "__main__":
    sys.exit(main())
