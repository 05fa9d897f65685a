"""Tensor parallelism (jaxmamba.parallel) on 4 virtual CPU devices, against HF and TP 1.

The checks run once, in a subprocess started with
`XLA_FLAGS=--xla_force_host_platform_device_count=4` (the flag must be set before jax starts,
and the rest of the suite runs on one device); it writes what it saw to a JSON file that the
tests below read. The model is a random Nemotron-H with a Mamba, an MLP, an attention and a
MoE layer (biases on), shaped so that nothing divides evenly: 12 Mamba heads in 3 groups,
12 query heads over 3 KV heads, MLP width 66, experts 22 wide, shared expert 30, vocabulary
97 — with TP 2 and 4 the groups and KV heads are repeated, the gated-norm groups straddle
shards, and the widths and vocabulary are padded.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from host_devices import run_with_host_devices

SIZES = (1, 2, 4)
PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
HF_CONFIG = dict(
    vocab_size=97, hidden_size=32, layers_block_type=[PATTERN[c] for c in "M-*EM"],
    mamba_num_heads=12, mamba_head_dim=4, n_groups=3, ssm_state_size=8, chunk_size=8,
    num_attention_heads=12, num_key_value_heads=3, head_dim=4, intermediate_size=66,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=22,
    moe_shared_expert_intermediate_size=30, n_group=4, topk_group=2, routed_scaling_factor=2.5,
    use_bias=True, mlp_bias=True,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip
ENGINE = dict(
    max_num_seqs=2,
    max_model_len=64,
    max_num_batched_tokens=16,
    page_size=4,
    compilation_cache=False,
)  # timed cold, as on CI
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tp") / "seen.json"
    return run_with_host_devices(__file__, out, timeout=1800)


def test_greedy_tokens_equal_hf_for_every_tp_size(seen):
    for n in SIZES:
        pairs = zip(seen["tokens"][str(n)], seen["hf_tokens"], strict=True)
        for i, (ours, ref) in enumerate(pairs):
            assert ours == ref, (n, i, ours, ref)
        assert seen["free_slots"][str(n)] == seen["free_slots"]["1"], seen["free_slots"]


def test_logprobs_equal_tp1_and_hf(seen):
    for n in SIZES:
        for ours, tp1, ref in zip(seen["logprobs"][str(n)], seen["logprobs"]["1"],
                                  seen["hf_logprobs"], strict=True):  # fmt: skip
            np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
            np.testing.assert_allclose(ours, tp1, atol=2e-5, rtol=0)


def test_prefix_cache_hits_and_chunked_prefill_under_tp(seen):
    block = seen["block"]
    assert seen["first_len"] > ENGINE["max_num_batched_tokens"]  # prefilled in chunks
    for n in SIZES:
        assert seen["cached_tokens"][str(n)] >= 2 * block, (n, seen["cached_tokens"])


def test_hlo_has_one_all_reduce_per_row_parallel_projection_and_gathers_no_weights(seen):
    for n in (2, 4):
        for kind, hlo in seen["hlo"][str(n)].items():
            assert hlo["all_reduce"] == hlo["expected_all_reduce"], (n, kind, hlo)
            assert hlo["all_reduce_instructions"] <= hlo["all_reduce"]
            assert hlo["zero_sized_arrays"] == 0, (n, kind)
            # the only all-gathers are of logits [rows (+ prompt tokens), padded vocab]:
            # one for sampling (in prefill steps it may also carry the prompt-logprobs
            # rows, or those come in a second one), never of a weight
            assert 1 <= len(hlo["all_gather_shapes"]) <= (1 if kind == "decode" else 2), hlo
            for shape in hlo["all_gather_shapes"]:
                assert shape[-1] == seen["padded_vocab"][str(n)], (n, kind, shape)


def test_forked_samples_and_prompt_logprobs_under_tp_equal_tp1(seen):
    """`fork_fn` and `score_fn` over the mesh: a seeded n = 2 request (sample 1 decodes from
    the state the fork copied) and its prompt logprobs are TP 1's."""
    tp1 = seen["forked_tokens"]["1"]
    assert len(tp1) == 2 and all(len(t) == MAX_TOKENS for t in tp1)
    assert seen["prompt_logprobs"]["1"][0] is None and len(seen["prompt_logprobs"]["1"]) > 1
    for n in (2, 4):
        assert seen["forked_tokens"][str(n)] == tp1, n
        for ours, ref in zip(seen["prompt_logprobs"][str(n)], seen["prompt_logprobs"]["1"],
                             strict=True):  # fmt: skip
            if ref is None:
                assert ours is None
                continue
            assert ours.keys() == ref.keys(), (n, ours, ref)
            for t in ref:
                assert abs(ours[t] - ref[t]) < 2e-5, (n, t, ours[t], ref[t])


def test_impossible_splits_are_refused_with_the_values(seen):
    assert "mamba_num_heads=12" in seen["refused"]["5"], seen["refused"]
    assert "tensor_parallel_size=5" in seen["refused"]["5"]


# ----- the subprocess -----


def _expected_all_reduces(cfg, n: int) -> int:
    """One per row-parallel projection (Mamba out_proj, attention o_proj, MLP down_proj, the
    routed experts' sum, the shared expert's down_proj), one for the vocab-parallel
    embedding, and one per Mamba layer whose gated-norm groups straddle shards."""
    straddle = (cfg.d_inner // n) % (cfg.d_inner // cfg.n_groups) != 0
    per_type = {"mamba": 1 + straddle, "attention": 1, "mlp": 1,
                "moe": 1 + bool(cfg.moe_shared_intermediate_size)}  # fmt: skip
    return 1 + sum(per_type[t] for t in cfg.layer_types)


def _hlo_collectives(llm, n: int) -> dict:
    import re

    from jaxmamba.engine.batch import Bucket
    from jaxmamba.parallel.step import jitted_tp_step

    runner, builder = llm.runner, llm.engine.builder
    out = {}
    kinds = {"decode": Bucket(2, 2, 2), "prefill": Bucket(16, 2, 0)}
    if n == 4:
        del kinds["prefill"]  # the same count as TP 2's: one compile less
    for kind, bucket in kinds.items():
        inputs = runner._put_inputs(builder.padding(bucket))
        args, kwargs = runner.step_args(inputs, bucket.num_decode)
        lowered = jitted_tp_step.lower(*args, **kwargs)
        # A zero-sized array (`tensor<0x...>`) that the shard_map takes as an operand: XLA
        # 0.11's SPMD partitioner segfaults on one (scripts/dev/xla_tp_segfault.py).
        zero_sized = lowered.as_text().count("tensor<0x")
        text = lowered.compile().as_text()
        gathers = re.findall(r"= \w+\[([\d,]*)\]\S* all-gather\(", text)
        # XLA may merge independent all-reduces (the MoE's routed and shared sums) into
        # one instruction over a tuple: count the arrays reduced.
        reduced = re.findall(r" all-reduce\(([^)]*)\)", text)
        out[kind] = dict(
            all_reduce=sum(len(args.split(",")) for args in reduced),
            all_reduce_instructions=len(reduced),
            expected_all_reduce=_expected_all_reduces(llm.runner.cfg, n),
            all_gather_shapes=[[int(d) for d in g.split(",")] for g in gathers],
            zero_sized_arrays=zero_sized,
        )
    return out


def main(out_path: str) -> None:
    import jax
    import torch
    from family_checks import hf_greedy
    from transformers import NemotronHConfig, NemotronHForCausalLM

    from jaxmamba import LLM, SamplingParams
    from jaxmamba.parallel.plan import TensorParallelPlan

    from hf_fixtures import perturb_parameters
    from model_helpers import random_prompts

    assert jax.device_count() == 4, jax.devices()
    torch.set_num_threads(1)
    path = Path(out_path).parent / "hf"
    # eager experts: torch's grouped_mm wants 16-byte strides, and 22 floats are not
    config = NemotronHConfig(**HF_CONFIG, experts_implementation="eager")
    model = NemotronHForCausalLM(config).float().eval()
    perturb_parameters(model, 0)
    model.save_pretrained(path)

    block = math.lcm(HF_CONFIG["chunk_size"], ENGINE["page_size"])
    rng = np.random.default_rng(1)
    first = random_prompts(rng, [2 * block + 5, 3], HF_CONFIG["vocab_size"])
    extended = first[0] + random_prompts(rng, [3], HF_CONFIG["vocab_size"])[0]
    prompts = [*first, extended]
    hf = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    seen = dict(block=block, first_len=len(first[0]), hf_tokens=[t for t, _ in hf],
                hf_logprobs=[lp for _, lp in hf], tokens={}, logprobs={}, cached_tokens={},
                hlo={}, padded_vocab={}, refused={}, free_slots={}, forked_tokens={},
                prompt_logprobs={})  # fmt: skip
    # n > 1 and prompt_logprobs: the fork and scoring programs run after the step, sharded too
    forked = SamplingParams(n=2, max_tokens=MAX_TOKENS, temperature=1.0, seed=7,
                            ignore_eos=True, prompt_logprobs=2)  # fmt: skip
    for n in SIZES:
        llm = LLM(str(path), tensor_parallel_size=n, **ENGINE)
        outs = llm.generate(prompt_token_ids=first, sampling_params=params, use_tqdm=False)
        outs += llm.generate(prompt_token_ids=[extended], sampling_params=params, use_tqdm=False)
        seen["tokens"][n] = [o.outputs[0].token_ids for o in outs]
        seen["logprobs"][n] = [
            [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]
            for c in (o.outputs[0] for o in outs)
        ]
        seen["cached_tokens"][n] = outs[-1].num_cached_tokens
        (out,) = llm.generate(prompt_token_ids=[first[0]], sampling_params=forked,
                              use_tqdm=False)  # fmt: skip
        seen["forked_tokens"][n] = [c.token_ids for c in out.outputs]
        seen["prompt_logprobs"][n] = [
            None if d is None else {str(t): p.logprob for t, p in d.items()}
            for d in out.prompt_logprobs
        ]
        seen["free_slots"][n] = llm.stats().get("free_slots")
        if n > 1:
            seen["padded_vocab"][n] = TensorParallelPlan(llm.model_cfg, n).padded_vocab
            seen["hlo"][n] = _hlo_collectives(llm, n)
        del llm
    try:
        LLM(str(path), tensor_parallel_size=5, **ENGINE)
    except ValueError as e:
        seen["refused"][5] = str(e)
    Path(out_path).write_text(json.dumps(seen))


if __name__ == "__main__":
    main(sys.argv[1])


def test_multihost_leader_sends_each_step_first_and_runs_the_full_sampler(monkeypatch):
    """The several-host leader sends the bucket and then the inputs to its followers before it
    dispatches a step, and runs the one program the followers have (the full sampler) even
    when no row reads what the variants leave out."""
    from jaxmamba.engine.runner import FULL, GREEDY, PLAIN, StepRunner
    from jaxmamba.parallel import multihost
    from jaxmamba.step_contract import CacheSpec, padding

    sent, ran = [], []
    monkeypatch.setattr(multihost, "_broadcast", lambda tree: sent.append(tree) or tree)

    class Runner(StepRunner):
        cache_spec = CacheSpec(num_slots=2, num_pages=2, page_size=16)
        structured_outputs = False  # no model vocabulary here for the FULL step's bitmask

        def held_samplers(self, bucket):
            return (FULL, PLAIN, GREEDY)

        def _run_step(self, inputs, bucket, sampler):
            ran.append((bucket, sampler))
            return "packed"

    inputs = padding(2, 2, 1, Runner.cache_spec)  # a pure decode bucket of greedy rows
    leader = multihost.lead(Runner())
    out = leader.step(inputs, 2, top_logprobs=False, ranks=False)
    assert out.packed == "packed" and out.prompt_scores is None
    assert ran == [((2, 2, 2), FULL)]
    assert sent[0].tolist() == [1, 2, 2, 2] and sent[1] is inputs
