"""The streaming engine: deltas, incremental UTF-8 detokenization, stop strings, n samples."""

from __future__ import annotations

import numpy as np
import pytest

from jaxmamba import LLM, SamplingParams
from jaxmamba.engine.detokenizer import IncrementalDetokenizer
from jaxmamba.engine.engine import sibling_seed
from jaxmamba.tokenizer import ByteTokenizer, HFTokenizer

from hf_fixtures import write_tokenizer

TEXT = "naïve café — 日本語 ✓ 𝄞 done"  # 2-, 3- and 4-byte characters


@pytest.fixture(scope="module")
def llm():
    return LLM(
        "nemotron-h-tiny",
        max_num_seqs=4,
        max_model_len=96,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,
    )


def sample(max_tokens, seed, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True, **kw)


def stream(llm, prompts, params):
    """Every request's deltas, through add_request/step, keyed by request id."""
    engine = llm.engine
    for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, sp)
    deltas: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.setdefault(out.request_id, []).append(out)
    return deltas


def feed_one_at_a_time(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """The text deltas of streaming `ids` a token a step, the last one after the flush."""
    pieces = []
    for t in ids:
        detok.update([t], stopped_on_token=False)
        pieces.append(detok.take_delta(finished=False))
    detok.flush()
    pieces.append(detok.take_delta(finished=True))
    return pieces


def test_byte_split_multibyte_text_streams_without_replacement_chars():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    pieces = feed_one_at_a_time(detok, list(TEXT.encode("utf-8")))
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in p for p in pieces)


def test_invalid_bytes_stream_as_one_decode_of_everything():
    rng = np.random.default_rng(0)
    tok = ByteTokenizer()
    for _ in range(20):
        ids = rng.integers(0, 256, 40).tolist()
        detok = IncrementalDetokenizer(tok)
        pieces = feed_one_at_a_time(detok, ids)
        assert "".join(pieces) == bytes(ids).decode("utf-8", errors="replace")


class VocabTokenizer:
    """Ids are strings of a fixed vocabulary; 0 is a special token."""

    vocab = ["<eos>", " a", "b", " c", "d"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.vocab[i] for i in ids if not (skip_special_tokens and i == 0))


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(skip):
    detok = IncrementalDetokenizer(VocabTokenizer(), skip_special_tokens=skip)
    for t in (1, 0, 2):
        detok.update([t], stopped_on_token=False)
    detok.flush()
    assert detok.take_delta(finished=True) == (" ab" if skip else " a<eos>b")


def test_streamed_deltas_concatenate_to_the_final_text(llm):
    prompts = ["Hello", "ünï", "日本"]
    params = [sample(40, seed=s) for s in (1, 2, 3)]
    deltas = stream(llm, prompts, params)
    finals = llm.generate(prompts, params, use_tqdm=False)
    tok = llm.tokenizer
    non_ascii = 0
    for i, final in enumerate(finals):
        outs = deltas[f"r{i}"]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        ids = [t for o in outs for t in o.outputs[0].token_ids]
        text = "".join(o.outputs[0].text for o in outs)
        assert ids == final.outputs[0].token_ids and len(ids) == 40
        assert text == final.outputs[0].text == tok.decode(ids)
        assert outs[-1].outputs[0].finish_reason == "length"
        non_ascii += sum(t >= 0x80 for t in ids)
    assert non_ascii > 0  # the random model samples bytes that are not ASCII


def first_stop(ids, stops, tok, include):
    """Oracle: the first token after which the text holds a stop string; of those it holds,
    the first in `stops` order (vLLM's choice); the text cut there."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k])
        hits = [s for s in stops if s in text]
        if hits:
            s = hits[0]
            pos = text.find(s)
            return ids[:k], text[: pos + len(s) if include else pos], s
    return None


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_match_a_plain_search_over_the_text(llm, include):
    tok = llm.tokenizer
    prompts = [[256, 10 + i, 20 + i] for i in range(4)]
    params = [sample(60, seed=i) for i in range(4)]
    free = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    rng = np.random.default_rng(1)
    params, expected = [], []
    for i, out in enumerate(free):
        ids, text = out.outputs[0].token_ids, out.outputs[0].text
        clean = [j for j in range(10, len(text) - 3) if "\ufffd" not in text[j : j + 3]]
        j = int(rng.choice(clean))
        # Both complete at the same token; the later-starting one comes first in the list.
        stops = [text[j + 1 : j + 3], text[j : j + 3], "\x00never"]
        params.append(sample(60, seed=i, stop=stops, include_stop_str_in_output=include))
        expected.append(first_stop(ids, stops, tok, include))
    deltas = stream(llm, prompts, params)
    for i, (want_ids, want_text, want_stop) in enumerate(expected):
        outs = deltas[f"r{i}"]
        last = outs[-1].outputs[0]
        assert [t for o in outs for t in o.outputs[0].token_ids] == want_ids
        assert "".join(o.outputs[0].text for o in outs) == want_text
        assert (last.finish_reason, last.stop_reason) == ("stop", want_stop)


@pytest.mark.parametrize(("include", "want_text"), [(False, "abc"), (True, "abcde")])
def test_several_stop_strings_in_one_update_pick_the_first_in_list_order(include, want_text):
    """vLLM's check_stop_strings: list order, not position, decides; with
    include_stop_str_in_output the text is cut after the stop string, not at the new end."""
    detok = IncrementalDetokenizer(
        ByteTokenizer(), stop=("de", "bc", "zz"), include_stop_str_in_output=include
    )
    assert detok.update(list(b"abcdefg"), stopped_on_token=False) == "de"
    assert detok.take_delta(finished=True) == want_text


def test_a_stop_token_ends_the_text_without_a_stop_string_search():
    """As vLLM: when an eos/stop token ends the sequence, stop strings are not searched."""
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=("xy",), include_stop_str_in_output=True)
    assert detok.update(list(b"axy"), stopped_on_token=True) is None
    assert detok.take_delta(finished=True) == "axy"


def test_n_samples_equal_independent_requests_with_their_seeds(llm):
    prompt = [256, 7, 8, 9]
    (together,) = llm.generate(prompt_token_ids=[prompt], sampling_params=sample(12, 5, n=3),
                               use_tqdm=False)  # fmt: skip
    assert [c.index for c in together.outputs] == [0, 1, 2]
    alone = llm.generate(
        prompt_token_ids=[prompt] * 3,
        sampling_params=[sample(12, sibling_seed(5, i)) for i in range(3)],
        use_tqdm=False,
    )
    assert [c.token_ids for c in together.outputs] == [a.outputs[0].token_ids for a in alone]
    assert [c.text for c in together.outputs] == [a.outputs[0].text for a in alone]
    assert len({tuple(c.token_ids) for c in together.outputs}) == 3


def test_max_tokens_none_runs_to_max_model_len(llm):
    prompt = [256, 1, 2, 3, 4]
    sp = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate(prompt_token_ids=[prompt], sampling_params=sp, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 96 - len(prompt)
    assert out.outputs[0].finish_reason == "length"


def test_abort_frees_slot_and_pages_in_the_next_step(llm):
    engine, scheduler = llm.engine, llm.engine.scheduler
    free_slots, free_pages = scheduler.slots.num_free, scheduler.pages.num_free
    engine.add_request("keep", [256, 1, 2], sample(30, 1))
    engine.add_request("drop", [256, 3, 4], sample(30, 2))
    for _ in range(4):
        engine.step()
    (dropped,) = [r for r in scheduler.running if r.request_id == "drop"]
    held_pages = len(dropped.owned_pages)
    assert held_pages > 0 and dropped.slot is not None
    slots_before, pages_before = scheduler.slots.num_free, scheduler.pages.num_free
    engine.abort_request("drop")
    outs = engine.step()
    assert scheduler.slots.num_free == slots_before + 1
    assert scheduler.pages.num_free == pages_before + held_pages
    assert dropped not in scheduler.running and "drop" not in {o.request_id for o in outs}
    seen = set()
    while engine.has_unfinished_requests():
        seen |= {o.request_id for o in engine.step()}
    assert seen == {"keep"}
    assert (scheduler.slots.num_free, scheduler.pages.num_free) == (free_slots, free_pages)


def test_metaspace_bpe_streams_as_one_decode_of_everything(tmp_path):
    write_tokenizer(tmp_path, 300)
    tok = HFTokenizer(tmp_path)
    rng = np.random.default_rng(2)
    for skip in (True, False):
        ids = rng.integers(0, tok.vocab_size, 60).tolist()
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        pieces = feed_one_at_a_time(detok, ids)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
