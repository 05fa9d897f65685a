"""`jaxmamba bench throughput`: offline throughput through `LLM.generate`, as `vllm bench
throughput` measures it on its random dataset: every request queued at once, each sampled at
temperature 1 and top-p 1 with `ignore_eos` for exactly its output length; vLLM's figures
(requests/s, total tokens/s, output tokens/s) and its `--output-json` keys.

The random dataset has the lengths of vLLM's `RandomDataset`: input and output lengths uniform
over the integers of [floor(len·(1−r)), ceil(len·(1+r))] (r the range ratio, in [0, 1); an
output at least 1 token), each prompt one shared random prefix of `prefix_len` tokens then its
own random tokens. The tokens are ids drawn uniformly from the tokenizer's ids less its special
ones, and no special token is added, so a prompt has exactly `prefix_len` + its drawn length
tokens (vLLM draws consecutive ids from a random offset and sends them as text, which the
engine re-encodes with its special tokens).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxmamba.sampling_params import SamplingParams

DATASETS = ("random",)


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's bounds of a random length: [floor(length·(1−r)), ceil(length·(1+r))]."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio}")
    return math.floor(length * (1 - range_ratio)), math.ceil(length * (1 + range_ratio))


def token_pool(vocab_size: int, tokenizer=None) -> np.ndarray:
    """The ids prompts are drawn from: the model's vocab, less the tokenizer's special ids and
    any id past its vocab (padded embedding rows), as vLLM's random dataset leaves them out."""
    if tokenizer is None:
        return np.arange(vocab_size)
    return np.setdiff1d(np.arange(min(vocab_size, tokenizer.vocab_size)), tokenizer.all_special_ids)


def random_requests(
    num_prompts: int,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    token_ids: np.ndarray,
    *,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[BenchRequest]:
    """`num_prompts` requests whose random-part and output lengths are uniform over the
    integers of `input_range` and `output_range` (both ends included); every prompt starts
    with the same `prefix_len` random ids. All ids come from `token_ids`; `seed` fixes every
    draw (output lengths first, then input lengths, then the tokens)."""
    (in_lo, in_hi), (out_lo, out_hi) = input_range, output_range
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    if not 0 <= in_lo <= in_hi or not 1 <= out_lo <= out_hi:
        raise ValueError(
            f"lengths must be ranges low <= high, input from 0 and output from 1; got input "
            f"{input_range}, output {output_range}"
        )
    if prefix_len + in_lo < 1:
        raise ValueError(
            f"a prompt could be empty: prefix_len {prefix_len} + the shortest input {in_lo} is 0; "
            "raise the input length or the prefix, or lower the range ratio"
        )
    if len(token_ids) == 0:
        raise ValueError("token_ids is empty: no ids to draw prompts from")
    rng = np.random.default_rng(seed)
    output_lens = rng.integers(out_lo, out_hi + 1, num_prompts)
    input_lens = rng.integers(in_lo, in_hi + 1, num_prompts)
    return _with_prompts(rng, input_lens, output_lens, prefix_len, token_ids)


def redraw_prompts(
    requests: Sequence[BenchRequest], prefix_len: int, token_ids: np.ndarray, seed: int
) -> list[BenchRequest]:
    """`requests`' lengths with other random ids (a new shared prefix too): a pass that meets
    the same step buckets and finds none of their prefixes cached."""
    rng = np.random.default_rng(seed)
    input_lens = [len(r.prompt_token_ids) - prefix_len for r in requests]
    return _with_prompts(rng, input_lens, [r.output_len for r in requests], prefix_len, token_ids)


def _with_prompts(rng, input_lens, output_lens, prefix_len, token_ids) -> list[BenchRequest]:
    prefix = rng.choice(token_ids, prefix_len).tolist()
    return [
        BenchRequest(prefix + rng.choice(token_ids, int(n)).tolist(), int(out))
        for n, out in zip(input_lens, output_lens, strict=True)
    ]


def sample_requests(
    dataset_name: str,
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    prefix_len: int,
    token_ids: np.ndarray,
    seed: int,
) -> list[BenchRequest]:
    """The requests of a `vllm bench throughput` dataset (`random` is the one there is)."""
    if dataset_name not in DATASETS:
        raise ValueError(
            f"dataset {dataset_name!r} is not supported; supported: {', '.join(DATASETS)}"
        )
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    return random_requests(num_prompts, (in_lo, in_hi), (max(out_lo, 1), max(out_hi, 1)),
                           token_ids, prefix_len=prefix_len, seed=seed)  # fmt: skip


def check_fits(requests: Sequence[BenchRequest], max_model_len: int) -> None:
    """ValueError unless every request's prompt and output fit `max_model_len`."""
    longest = max(requests, key=lambda r: len(r.prompt_token_ids) + r.output_len)
    need = len(longest.prompt_token_ids) + longest.output_len
    if need > max_model_len:
        raise ValueError(
            f"the longest request needs {need} tokens ({len(longest.prompt_token_ids)} prompt + "
            f"{longest.output_len} output), more than max_model_len={max_model_len}"
        )


def bench_sampling_params(
    requests: Sequence[BenchRequest], *, n: int = 1, temperature: float = 1.0
) -> list[SamplingParams]:
    """vLLM's throughput sampling: `ignore_eos`, exactly each request's output length."""
    return [
        SamplingParams(n=n, temperature=temperature, top_p=1.0, ignore_eos=True,
                       max_tokens=r.output_len)
        for r in requests
    ]  # fmt: skip


@dataclass(frozen=True)
class ThroughputResult:
    elapsed_time: float  # seconds from the call to generate to its return
    num_requests: int
    prompt_tokens: int  # each request's prompt once, as vLLM counts them
    output_tokens: int  # every completion's tokens (n per request)
    compilations: int  # step programs compiled inside the timed pass

    @property
    def total_num_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def requests_per_second(self) -> float:
        return self.num_requests / self.elapsed_time

    @property
    def tokens_per_second(self) -> float:
        return self.total_num_tokens / self.elapsed_time

    @property
    def output_tokens_per_second(self) -> float:
        return self.output_tokens / self.elapsed_time

    def vllm_json(self) -> dict:
        """`vllm bench throughput --output-json`'s record."""
        return {
            "elapsed_time": self.elapsed_time,
            "num_requests": self.num_requests,
            "total_num_tokens": self.total_num_tokens,
            "requests_per_second": self.requests_per_second,
            "tokens_per_second": self.tokens_per_second,
        }

    def summary(self) -> str:
        """vLLM's printed lines."""
        return (
            f"Throughput: {self.requests_per_second:.2f} requests/s, "
            f"{self.tokens_per_second:.2f} total tokens/s, "
            f"{self.output_tokens_per_second:.2f} output tokens/s\n"
            f"Total num prompt tokens:  {self.prompt_tokens}\n"
            f"Total num output tokens:  {self.output_tokens}"
        )


def timed_generate(
    llm,
    requests: Sequence[BenchRequest],
    *,
    n: int = 1,
    temperature: float = 1.0,
    detokenize: bool = True,
    use_tqdm: bool = True,
):
    """Time one `llm.generate` of every request at once; (its `ThroughputResult`, outputs).
    `detokenize=False` leaves the text out (vLLM's `--disable-detokenize`): the engine makes
    no detokenizers while its tokenizer is unset, and the prompts are ids, so nothing else
    reads it."""
    params = bench_sampling_params(requests, n=n, temperature=temperature)
    prompts = [r.prompt_token_ids for r in requests]
    engine, compiles = llm.engine, llm.stats()["compilations"]
    tokenizer = engine.tokenizer
    if not detokenize:
        engine.tokenizer = None
    try:
        start = time.perf_counter()
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=use_tqdm)
        elapsed = time.perf_counter() - start
    finally:
        engine.tokenizer = tokenizer
    short = [
        (i, c.finish_reason)
        for i, (r, o) in enumerate(zip(requests, outputs, strict=True))
        for c in o.outputs
        if len(c.token_ids) != r.output_len
    ]
    if short:  # ignore_eos: only a failed step ends one early
        raise RuntimeError(
            f"{len(short)} completions ended before their output length (request, finish "
            f"reason: {short[:5]}): the figures would not count the work asked for"
        )
    result = ThroughputResult(
        elapsed_time=elapsed,
        num_requests=len(requests),
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        output_tokens=sum(len(c.token_ids) for o in outputs for c in o.outputs),
        compilations=llm.stats()["compilations"] - compiles,
    )
    return result, outputs
