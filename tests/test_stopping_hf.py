"""Stopping and prompt ids against transformers as the oracle: random HF checkpoints whose eos
ids are lists in config.json and in generation_config.json, tokenizers with and without a BOS
post-processor; greedy output stops exactly where HF `generate` stops, on the prompt ids that
the HF tokenizer (and `apply_chat_template`) gives."""

from __future__ import annotations

import json

import pytest
import torch

from jaxmamba import LLM, SamplingParams

from hf_fixtures import edit_tokenizer, make_mamba2_checkpoint, make_nemotron_h_checkpoint

PROMPT = "the quick brown fox"
FREE_TOKENS = 12
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ m['content'] | trim }}\n{% else %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": " a state space model "},
    {"role": "user", "content": "hello jax, hello world"},
]
MAKERS = {"nemotron_h": make_nemotron_h_checkpoint, "mamba2": make_mamba2_checkpoint}


def _free_greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens from full forward passes, no stopping: where stops may fall."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]


def _first_new(tokens: list[int], start: int, avoid: set[int]) -> int:
    """The first position >= start whose token appeared neither before it nor in `avoid`."""
    for i in range(start, len(tokens)):
        if tokens[i] not in tokens[:i] and tokens[i] not in avoid:
            return i
    pytest.skip("the random model repeats itself: no fresh token to stop on")


def _hf_generate(path, ids: list[int], **kw) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=FREE_TOKENS, pad_token_id=0, **kw
        )
    return out[0, len(ids) :].tolist()


def _write_eos(path, config_eos, generation_eos) -> None:
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = config_eos
    (path / "config.json").write_text(json.dumps(config))
    # Without generation_config.json, HF generate takes config.json's ids (with one, only its).
    gen_file = path / "generation_config.json"
    if generation_eos is None:
        gen_file.unlink(missing_ok=True)
    else:
        gen_file.write_text(json.dumps({"eos_token_id": generation_eos, "pad_token_id": 0}))


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": FREE_TOKENS, **kw})


@pytest.fixture(scope="module", params=sorted(MAKERS))
def checkpoint(request, tmp_path_factory):
    from transformers import AutoTokenizer

    path, model = MAKERS[request.param](
        tmp_path_factory.mktemp(request.param) / "m", with_tokenizer=True
    )
    edit_tokenizer(path, bos_post_processor=True, chat_template=CHAT_TEMPLATE)
    ids = AutoTokenizer.from_pretrained(path)(PROMPT)["input_ids"]
    return path, model, ids


@pytest.mark.parametrize("where", ["config.json", "generation_config.json", "both"])
def test_greedy_stops_where_hf_generate_stops_on_every_eos_id(checkpoint, where):
    path, model, ids = checkpoint
    free = _free_greedy(model, ids, FREE_TOKENS)
    i = _first_new(free, 3, {2})
    j = _first_new(free, i + 1, {2})
    first, later = free[i], free[j]
    # The id that stops generation is never the first of its list.
    if where == "config.json":
        _write_eos(path, [2, later, first], None)
    elif where == "generation_config.json":
        _write_eos(path, 2, [later, first])
    else:
        _write_eos(path, [2, later], [2, later, first])
    expected = _hf_generate(path, ids)
    assert expected == free[: i + 1]  # HF stops on `first`, generated at position i
    llm = LLM(str(path), max_num_seqs=2, max_model_len=64)
    assert first in llm.model_cfg.eos_token_ids and later in llm.model_cfg.eos_token_ids
    (out,) = llm.generate(PROMPT, _greedy())
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == expected
    assert out.outputs[0].finish_reason == "stop"
    (out,) = llm.generate(PROMPT, _greedy(ignore_eos=True))
    assert out.outputs[0].token_ids == free


def test_the_tokenizers_eos_stops_too(checkpoint, tmp_path):
    """vLLM stops on the tokenizer's eos as well; HF gets the same set passed explicitly."""
    import shutil

    path, model, ids = checkpoint
    free = _free_greedy(model, ids, FREE_TOKENS)
    i = _first_new(free, 2, {2})
    own = tmp_path / "m"
    shutil.copytree(path, own)
    _write_eos(own, 2, None)
    from tokenizers import Tokenizer

    name = Tokenizer.from_file(str(own / "tokenizer.json")).id_to_token(free[i])
    tok_cfg = json.loads((own / "tokenizer_config.json").read_text())
    tok_cfg["eos_token"] = name
    (own / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    expected = _hf_generate(own, ids, eos_token_id=[2, free[i]])
    assert expected == free[: i + 1]
    (out,) = LLM(str(own), max_num_seqs=2, max_model_len=64).generate(PROMPT, _greedy())
    assert out.outputs[0].token_ids == expected


@pytest.mark.parametrize("bos", [True, False])
def test_prompt_ids_and_chat_ids_are_the_hf_tokenizers(checkpoint, tmp_path, bos):
    import shutil

    from transformers import AutoTokenizer

    path, model, _ = checkpoint
    own = tmp_path / "m"
    shutil.copytree(path, own)
    _write_eos(own, 2, None)
    edit_tokenizer(own, bos_post_processor=bos, add_bos_token=not bos, chat_template=CHAT_TEMPLATE)
    hf_tok = AutoTokenizer.from_pretrained(own)
    llm = LLM(str(own), max_num_seqs=2, max_model_len=96)
    (out,) = llm.generate(PROMPT, _greedy())
    assert out.prompt_token_ids == hf_tok(PROMPT)["input_ids"]
    assert (out.prompt_token_ids[0] == 1) == bos
    chat_ids = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    chat_ids = chat_ids if isinstance(chat_ids, list) else chat_ids["input_ids"]
    text = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    (reply,) = llm.chat(MESSAGES, _greedy())
    assert reply.prompt == text and reply.prompt_token_ids == chat_ids
    assert reply.outputs[0].token_ids == _hf_generate(own, chat_ids)
    no_prompt = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False)
    (reply,) = llm.chat([MESSAGES], _greedy(), add_generation_prompt=False)
    assert reply.prompt == no_prompt
    other = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    (reply,) = llm.chat(MESSAGES, _greedy(max_tokens=2), chat_template=other)
    assert reply.prompt == hf_tok.apply_chat_template(MESSAGES, chat_template=other, tokenize=False)
    assert llm.get_tokenizer() is llm.tokenizer


def test_chat_without_a_template_says_so(checkpoint, tmp_path):
    import shutil

    path, _, _ = checkpoint
    own = tmp_path / "m"
    shutil.copytree(path, own)
    edit_tokenizer(own, bos_post_processor=True)
    llm = LLM(str(own), max_num_seqs=2, max_model_len=64)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat(MESSAGES)
    with pytest.raises(TypeError, match="message 0 must be a dict"):
        llm.chat(["hello"], chat_template=CHAT_TEMPLATE)
