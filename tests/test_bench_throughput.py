"""`jaxmamba.bench_throughput`: the random dataset's lengths follow vLLM's definition (uniform
over [floor(len·(1−r)), ceil(len·(1+r))], a shared prefix in front), its draws follow the seed,
and the timed pass counts what it generated, with or without the text."""

from __future__ import annotations

import numpy as np
import pytest

from jaxmamba import LLM
from jaxmamba.bench_throughput import (
    BenchRequest,
    check_fits,
    random_requests,
    redraw_prompts,
    sample_requests,
    timed_generate,
    token_pool,
)
from jaxmamba.tokenizer import ByteTokenizer

POOL = token_pool(272, ByteTokenizer())  # the tiny preset: 272 rows, bytes + 3 specials


def sample(**overrides):
    kwargs = dict(num_prompts=400, input_len=20, output_len=10, range_ratio=0.5, prefix_len=6,
                  token_ids=POOL, seed=3)  # fmt: skip
    return sample_requests("random", **{**kwargs, **overrides})


def test_token_pool_is_the_tokenizers_ids_less_its_specials():
    assert POOL.tolist() == list(range(256))  # 256..258 are bos/eos/pad, 259.. padding rows
    assert token_pool(10).tolist() == list(range(10))  # no tokenizer: the whole vocab


def test_lengths_are_uniform_over_vllms_range_after_a_shared_prefix():
    requests = sample()
    prefixes = {tuple(r.prompt_token_ids[:6]) for r in requests}
    assert len(prefixes) == 1
    # 20 ± 50 %: [10, 30]; 10 ± 50 %: [5, 15]. 400 draws reach both ends of each range.
    assert {len(r.prompt_token_ids) - 6 for r in requests} == set(range(10, 31))
    assert {r.output_len for r in requests} == set(range(5, 16))
    ids = np.concatenate([r.prompt_token_ids for r in requests])
    assert set(ids.tolist()) <= set(POOL.tolist())


def test_range_ratio_zero_gives_every_request_the_exact_lengths():
    requests = sample(range_ratio=0.0, prefix_len=0)
    assert {(len(r.prompt_token_ids), r.output_len) for r in requests} == {(20, 10)}


def test_rounding_is_vllms_floor_below_and_ceil_above():
    # 5 ± 30 %: [floor(3.5), ceil(6.5)] = [3, 7]; output 1 ± 30 %: [0, 2] raised to [1, 2].
    requests = sample(input_len=5, output_len=1, range_ratio=0.3, prefix_len=0)
    assert {len(r.prompt_token_ids) for r in requests} == {3, 4, 5, 6, 7}
    assert {r.output_len for r in requests} == {1, 2}


def test_the_seed_reproduces_the_requests_and_another_seed_does_not():
    assert sample() == sample()
    other = sample(seed=4)
    assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in sample()]


def test_redrawn_prompts_keep_the_lengths_with_other_tokens_and_prefix():
    requests = sample(num_prompts=20)
    again = redraw_prompts(requests, 6, POOL, seed=9)
    assert [(len(r.prompt_token_ids), r.output_len) for r in again] == [
        (len(r.prompt_token_ids), r.output_len) for r in requests
    ]
    assert len({tuple(r.prompt_token_ids[:6]) for r in again}) == 1
    assert again[0].prompt_token_ids[:6] != requests[0].prompt_token_ids[:6]


def test_the_scripts_recorded_lengths_reproduce():
    """scripts/bench_throughput.py's recorded run (docs/benchmarks.md, Offline throughput): 32
    requests over input [128, 512], output [32, 128], seed 0: 10,150 + 2,644 tokens."""
    requests = random_requests(32, (128, 512), (32, 128), POOL)
    assert sum(len(r.prompt_token_ids) for r in requests) == 10_150
    assert sum(r.output_len for r in requests) == 2_644


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(range_ratio=1.0), r"\[0, 1\), got 1.0"),
        (dict(range_ratio=-0.1), r"\[0, 1\), got -0.1"),
        (dict(input_len=1, range_ratio=0.5, prefix_len=0), "a prompt could be empty"),
        (dict(prefix_len=-1), "prefix_len must be >= 0, got -1"),
        (dict(num_prompts=0), "num_prompts must be >= 1, got 0"),
    ],
)
def test_bad_settings_are_errors_that_name_them(overrides, match):
    with pytest.raises(ValueError, match=match):
        sample(**overrides)


def test_an_empty_prompt_is_fine_with_a_prefix():
    requests = sample(input_len=1, range_ratio=0.5, prefix_len=1)  # drawn from [0, 2]
    assert {len(r.prompt_token_ids) for r in requests} == {1, 2, 3}


def test_a_dataset_other_than_random_is_an_error_naming_random():
    with pytest.raises(ValueError, match="'sharegpt' is not supported; supported: random"):
        sample_requests("sharegpt", num_prompts=1, input_len=4, output_len=4, range_ratio=0.0,
                        prefix_len=0, token_ids=POOL, seed=0)  # fmt: skip


def test_a_request_past_max_model_len_is_an_error_before_the_run():
    requests = [BenchRequest([1] * 50, 14), BenchRequest([1] * 60, 8)]
    check_fits(requests, 68)
    with pytest.raises(ValueError, match=r"needs 68 tokens \(60 prompt \+ 8 output\), more than "
                       r"max_model_len=67"):  # fmt: skip
        check_fits(requests, 67)


@pytest.fixture(scope="module")
def llm():
    return LLM("nemotron-h-tiny", dtype="float32", max_num_seqs=2, max_model_len=64,
               max_num_batched_tokens=16)  # fmt: skip


def test_timed_pass_counts_every_completion_and_leaves_text_out_when_asked(llm):
    requests = sample(num_prompts=3, input_len=9, output_len=4, range_ratio=0.0, prefix_len=3)
    for detokenize in (True, False):
        result, outputs = timed_generate(llm, requests, n=2, detokenize=detokenize,
                                         use_tqdm=False)  # fmt: skip
        assert llm.engine.tokenizer is llm.get_tokenizer()  # put back
        completions = [c for o in outputs for c in o.outputs]
        assert len(completions) == 6 and all(len(c.token_ids) == 4 for c in completions)
        texts = {type(c.text) for c in completions}
        assert texts == ({str} if detokenize else {type(None)})
        assert [o.prompt_token_ids for o in outputs] == [r.prompt_token_ids for r in requests]
        assert (result.num_requests, result.prompt_tokens, result.output_tokens) == (3, 36, 24)
        assert result.tokens_per_second * result.elapsed_time == pytest.approx(60)


def test_a_completion_cut_short_is_an_error_not_a_figure(llm):
    (request,) = sample(num_prompts=1, input_len=60, output_len=8, range_ratio=0.0, prefix_len=0)
    with pytest.raises(RuntimeError, match=r"1 completions ended before their output length"):
        timed_generate(llm, [request], use_tqdm=False)  # 60 + 8 > max_model_len=64
