"""On an accelerator: the built-in tiny model generates the same greedy tokens with the
platform's Pallas kernels (``impl="auto"``) as with the jnp references (``impl="ref"``).

    python scripts/gpu_sanity.py

Prints the share of requests whose tokens are identical; on a CPU both runs take the
references, so it says 100 % and checks nothing.
"""

from __future__ import annotations

import argparse

import numpy as np

from jaxmamba import LLM, SamplingParams


def greedy_tokens(impl: str) -> list[list[int]]:
    llm = LLM("nemotron-h-tiny", impl=impl, max_num_seqs=4, max_model_len=256,
              max_num_batched_tokens=128)  # fmt: skip
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 100, 37, 64, 1, 200)]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    return [o.outputs[0].token_ids for o in outputs]


def main() -> None:
    argparse.ArgumentParser(description=__doc__).parse_args()
    ref, auto = greedy_tokens("ref"), greedy_tokens("auto")
    agree = np.mean([a == b for a, b in zip(ref, auto, strict=True)])
    print(f"tiny model greedy tokens, pallas (auto) vs ref: {agree:.0%} of requests identical")


if __name__ == "__main__":
    main()
