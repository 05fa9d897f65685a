"""min_tokens through `LLM.generate` against its references: transformers'
`MinNewTokensLengthLogitsProcessor` (HF `generate(min_new_tokens=...)`) for eos and stop token
ids, vLLM's stop-string rule (strings are looked for only once more than min_tokens tokens are
out) for stop strings, and vLLM's host stop check for a stop id that reaches the host early.

A large logit_bias on a stop id makes it the greedy choice at every step where it is not
masked, so without min_tokens generation would stop at the first token: each of the three
places that hold stops back (the device's stop-id mask, the host's stop check, the
detokenizer's stop-string gate) changes these outputs when it is disabled.
"""

from __future__ import annotations

import pytest
import torch

from jaxmamba import LLM, SamplingParams
from jaxmamba.engine.runner import StepOutput

from hf_fixtures import edit_tokenizer, make_mamba2_checkpoint

PROMPT = "the quick brown fox"
MAX_TOKENS = 10
MIN_TOKENS = 4
EOS = 2
BIAS = 50.0  # logits of the random model have std ~2: the biased id always wins unmasked


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    path, model = make_mamba2_checkpoint(
        tmp_path_factory.mktemp("min_tokens") / "m", with_tokenizer=True, seed=3
    )
    edit_tokenizer(path, bos_post_processor=True)  # HF's AutoTokenizer keeps its pipeline
    llm = LLM(str(path), max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32)
    llm.engine.scheduler.use_buckets(decode=[1, 2], tokens=[32])
    tok = AutoTokenizer.from_pretrained(path)
    return llm, model, tok, tok(PROMPT)["input_ids"]


class AddBias:
    """An HF logits processor: adds `bias` to one token's logit."""

    def __init__(self, token: int, bias: float):
        self.token, self.bias = token, bias

    def __call__(self, input_ids, scores):
        scores[:, self.token] += self.bias
        return scores


def hf_generate(model, ids: list[int], *, stop_ids: list[int], biased: int, min_tokens: int):
    """HF greedy with `stop_ids` as its eos ids: `MinNewTokensLengthLogitsProcessor` masks
    them until min_tokens new tokens are out, and generation stops on the first one after."""
    from transformers import LogitsProcessorList

    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_TOKENS,
            min_new_tokens=min_tokens, eos_token_id=stop_ids, pad_token_id=0,
            logits_processor=LogitsProcessorList([AddBias(biased, BIAS)]),
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def free_greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens from full forward passes, nothing masked, no stopping."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]


@pytest.mark.parametrize("kind", ["eos", "stop_token_ids"])
def test_stop_ids_are_held_back_until_min_tokens_as_in_hf(setup, kind):
    llm, model, _, ids = setup
    biased = EOS if kind == "eos" else 5
    extra = {} if kind == "eos" else {"stop_token_ids": [biased]}
    hf_stop_ids = [EOS] if kind == "eos" else [EOS, biased]
    assert biased in llm.model_cfg.eos_token_ids or kind != "eos"

    def ours(min_tokens):
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=min_tokens,
                            logit_bias={biased: BIAS}, **extra)  # fmt: skip
        (out,) = llm.generate(PROMPT, sp, use_tqdm=False)
        assert out.prompt_token_ids == ids
        return out.outputs[0]

    # Unmasked, the biased id ends generation at once: the bias does what the test needs.
    assert ours(0).token_ids == [biased]
    expected = hf_generate(model, ids, stop_ids=hf_stop_ids, biased=biased, min_tokens=MIN_TOKENS)
    assert len(expected) == MIN_TOKENS + 1 and expected[-1] == biased
    assert not set(expected[:-1]) & set(hf_stop_ids)
    got = ours(MIN_TOKENS)
    assert got.token_ids == expected
    assert got.finish_reason == "stop"
    assert got.stop_reason == (None if kind == "eos" else biased)


def test_the_host_never_stops_before_min_tokens_whatever_the_device_samples(setup):
    """vLLM's host check: a stop id that reaches the host while fewer than min_tokens tokens
    are out does not end the request. Every step's sample is overwritten with eos on its way to
    the host (as if the device's mask had let it through): the request must run to exactly
    min_tokens tokens and stop there; without min_tokens, at the first."""
    llm, _, _, _ = setup
    runner = llm.engine.runner
    real_step = runner.step

    def eos_step(*args, **kwargs):
        out = real_step(*args, **kwargs)
        return StepOutput(out.packed.at[:, 0].set(EOS), out.prompt_scores)

    runner.step = eos_step
    try:
        for min_tokens in (0, MIN_TOKENS):
            sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=min_tokens)
            (out,) = llm.generate(PROMPT, sp, use_tqdm=False)
            completion = out.outputs[0]
            assert completion.token_ids == [EOS] * max(min_tokens, 1)
            assert completion.finish_reason == "stop"
    finally:
        del runner.step


def vllm_stop_string_end(tok, tokens: list[int], stop: str, min_tokens: int):
    """Where vLLM's rule ends generation on `stop`: after token t, the first t > min_tokens
    whose text (decoded whole by the HF tokenizer) holds `stop` ending in the text token t
    added; returns (t, text before the stop string) or None."""
    for t in range(min_tokens + 1, len(tokens) + 1):
        before = tok.decode(tokens[: t - 1], skip_special_tokens=True)
        text = tok.decode(tokens[:t], skip_special_tokens=True)
        i = text.find(stop, max(len(before) - len(stop) + 1, 0))
        if i >= 0:
            return t, text[:i]
    return None


def test_stop_strings_are_looked_for_only_after_min_tokens(setup):
    llm, model, tok, ids = setup
    free = free_greedy(model, ids, MAX_TOKENS)
    # The first token's text is the stop string: found at once without min_tokens.
    stop = tok.decode(free[:1], skip_special_tokens=True).strip()
    if not stop:
        pytest.skip("the random model's first token decodes to no text")

    def ours(min_tokens):
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=min_tokens,
                            ignore_eos=True, stop=[stop])  # fmt: skip
        (out,) = llm.generate(PROMPT, sp, use_tqdm=False)
        return out.outputs[0]

    for min_tokens in (0, MIN_TOKENS):
        end = vllm_stop_string_end(tok, free, stop, min_tokens)
        got = ours(min_tokens)
        if end is None:
            assert (got.token_ids, got.finish_reason) == (free, "length")
            assert got.text == tok.decode(free, skip_special_tokens=True)
        else:
            t, text = end
            assert (got.token_ids, got.text) == (free[:t], text)
            assert (got.finish_reason, got.stop_reason) == ("stop", stop)
        if min_tokens == 0:
            assert end is not None and end[0] == 1  # found at once: min_tokens is what defers it
