import dataclasses
import json
import random
import shutil

import numpy as np
import pytest

from jaxmamba.config import preset_path
from jaxmamba.model.families import config_from_preset
from jaxmamba.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

from hf_fixtures import edit_tokenizer, write_tokenizer

TEXT = "hello jax, the state space model keeps a state"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path, vocab_size=97)
    return path


def test_byte_tokenizer_round_trips_random_unicode():
    tok = ByteTokenizer()
    rng = random.Random(0)
    text = "".join(
        chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x400, 0x9FFF)])) for _ in range(200)
    )
    ids = tok.encode(text)
    assert ids[0] == 256 and ids[1:] == list(text.encode("utf-8"))
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == text
    # Specials and out-of-range ids (the model's vocab is 272) carry no text.
    assert tok.decode([256, *ids[1:5], 257, 258, 271, *ids[5:]]) == text


def test_byte_tokenizer_replaces_invalid_utf8():
    tok = ByteTokenizer()
    assert tok.decode([0x68, 0xC3, 0x69, 0xFF]) == "h\ufffdi\ufffd"
    assert tok.decode([0xE4, 0xB8]) == "\ufffd"  # a truncated 3-byte sequence


def test_hf_tokenizer_takes_specials_from_tokenizer_config_then_model_config(tok_dir, tmp_path):
    cfg = dataclasses.replace(
        config_from_preset("nemotron-h-tiny"),
        bos_token_id=3,
        eos_token_id=1,
        eos_token_ids=(1,),
        pad_token_id=2,
    )
    # tokenizer_config.json names <s>, </s>, <pad>: the tokenizer's own ids win (as in HF).
    tok = HFTokenizer(tok_dir, cfg)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    shutil.copy(tok_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = HFTokenizer(tmp_path, cfg)  # no tokenizer_config.json: the model config's
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (3, 1, 2)
    tok = HFTokenizer(tmp_path)  # neither: common spellings
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)


def test_hf_tokenizer_round_trips_and_skips_specials(tok_dir):
    tok = HFTokenizer(tok_dir)
    ids = tok.encode(TEXT)
    assert len(ids) < len(TEXT)  # BPE merged something
    assert all(0 <= i < 97 for i in ids)
    assert tok.decode([1, *ids, 2, 0]) == TEXT  # specials skipped


@pytest.mark.parametrize("bos_post_processor", [True, False])
@pytest.mark.parametrize("add_bos_token", [True, False, None])
def test_hf_tokenizer_encodes_as_transformers_does(tmp_path, bos_post_processor, add_bos_token):
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path, vocab_size=97)
    edit_tokenizer(tmp_path, bos_post_processor=bos_post_processor, add_bos_token=add_bos_token)
    ours, hf = HFTokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    for text in (TEXT, "hello", " a  b ", "zz<s>q", "é"):
        expected = hf(text)["input_ids"]
        assert ours.encode(text) == expected, text
        plain = hf(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text, add_special_tokens=False) == plain
        assert (expected[0] == 1) == bos_post_processor
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)


def test_bad_tokenizer_file_raises_with_its_path(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match=str(tmp_path / "tokenizer.json")):
        HFTokenizer(tmp_path)


def test_load_tokenizer_dispatch(tmp_path, tok_dir):
    tiny = config_from_preset("nemotron-h-tiny")
    assert isinstance(load_tokenizer("nemotron-h-tiny", tiny), ByteTokenizer)
    tiny.to_yaml(tmp_path / "nemotron-h-tiny.yaml")
    assert isinstance(load_tokenizer(tmp_path / "nemotron-h-tiny.yaml", tiny), ByteTokenizer)
    assert isinstance(load_tokenizer(str(tok_dir), None), HFTokenizer)
    assert load_tokenizer("mamba2-130m", config_from_preset("mamba2-130m")) is None
    assert load_tokenizer(tmp_path, tiny) is None  # a directory without tokenizer.json


# transformers' methods on `llm.get_tokenizer()`, against `PreTrainedTokenizerFast` over the
# same tokenizer.json: the demo's byte-level vocabulary and a BPE with merges (Metaspace).

DEMO_DIR = preset_path("nemotron-h-demo")
SPECIAL_NAMES = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}{{ suffix | default('') }}"
)


def random_texts(rng: random.Random, specials: list[str], n: int = 40) -> list[str]:
    """Empty, whitespace, ASCII, accents, CJK, emoji, control characters and special tokens
    spelled inside the text."""
    pools = [
        [chr(c) for c in range(32, 127)],
        list(" \t\n  "),
        [chr(c) for c in range(0xC0, 0x180)],
        [chr(c) for c in range(0x4E00, 0x4E80)],
        [chr(c) for c in range(0x1F600, 0x1F640)],
        [chr(c) for c in range(0, 32)],
        specials,
    ]
    texts = ["", " ", "\n", "é", "😀", "".join(specials), "a" + specials[0] + "b"]
    for _ in range(n):
        texts.append("".join(rng.choice(rng.choice(pools)) for _ in range(rng.randrange(1, 30))))
    return texts


def plain(x):
    """A BatchEncoding (ours or transformers') as a dict; text and id lists as they are."""
    return dict(x) if hasattr(x, "keys") else x


@pytest.fixture(scope="module", params=["demo", "bpe"])
def tokenizers(request, tok_dir, tmp_path_factory):
    """(ours, transformers') over one tokenizer.json, both with CHAT_TEMPLATE."""
    from transformers import PreTrainedTokenizerFast

    if request.param == "demo":
        path = tmp_path_factory.mktemp("demo_tok")
        shutil.copy(DEMO_DIR / "tokenizer.json", path / "tokenizer.json")
    else:
        path = tok_dir
    config = {**SPECIAL_NAMES, "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(path / "tokenizer.json"), chat_template=CHAT_TEMPLATE, **SPECIAL_NAMES
    )
    return HFTokenizer(path), hf


def test_call_and_encode_match_transformers_on_random_and_edge_texts(tokenizers):
    ours, hf = tokenizers
    texts = random_texts(random.Random(1), list(SPECIAL_NAMES.values()))
    for text in texts:
        for add in (True, False):
            want = hf(text, add_special_tokens=add)
            got = ours(text, add_special_tokens=add)
            assert dict(got) == dict(want), text
            assert (
                got.input_ids
                == ours.encode(text, add_special_tokens=add)
                == hf.encode(text, add_special_tokens=add)
            )
    assert dict(ours(texts)) == dict(hf(texts))
    assert dict(ours(texts, padding=True)) == dict(hf(texts, padding=True))
    assert dict(ours(texts, return_attention_mask=False)) == dict(
        hf(texts, return_attention_mask=False)
    )


def test_decode_and_token_maps_match_transformers_on_random_ids(tokenizers):
    ours, hf = tokenizers
    rng = np.random.default_rng(2)
    rows = [rng.integers(0, len(hf), n).tolist() for n in (0, 1, 5, 40, 40, 40)]
    rows.append([hf.bos_token_id, *rows[3], hf.eos_token_id, hf.pad_token_id])
    for skip in (True, False):
        assert ours.batch_decode(rows, skip_special_tokens=skip) == hf.batch_decode(
            rows, skip_special_tokens=skip
        )
        for ids in rows:
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            )
            assert ours.convert_ids_to_tokens(ids, skip_special_tokens=skip) == (
                hf.convert_ids_to_tokens(ids, skip_special_tokens=skip)
            )
    ids = rows[-1]
    assert ours.decode(ids[1], skip_special_tokens=False) == hf.decode(ids[1])
    assert ours.convert_ids_to_tokens(ids[1]) == hf.convert_ids_to_tokens(ids[1])
    tokens = [*hf.convert_ids_to_tokens(ids), "<s>", "not-a-token", "</s>"]
    assert ours.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)
    assert ours.convert_tokens_to_ids("not-a-token") is hf.convert_tokens_to_ids("not-a-token")
    assert ours.convert_tokens_to_ids(tokens[0]) == hf.convert_tokens_to_ids(tokens[0])
    assert ours.convert_ids_to_tokens([len(hf) + 5]) == hf.convert_ids_to_tokens([len(hf) + 5])


def test_special_tokens_and_sizes_match_transformers(tokenizers):
    ours, hf = tokenizers
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(ours, name) == getattr(hf, name), name
        assert getattr(ours, name + "_id") == getattr(hf, name + "_id"), name
    assert ours.all_special_tokens == hf.all_special_tokens
    assert ours.all_special_ids == hf.all_special_ids
    assert (ours.vocab_size, len(ours)) == (hf.vocab_size, len(hf))


def test_apply_chat_template_matches_transformers(tokenizers):
    ours, hf = tokenizers
    specials = list(SPECIAL_NAMES.values())
    rng = random.Random(3)
    texts = random_texts(rng, specials, n=6)
    conversations = [[{"role": "user", "content": text}] for text in texts[:4]] + [
        [
            {"role": "system", "content": texts[7]},
            {"role": "user", "content": texts[8]},
            {"role": "assistant", "content": texts[9]},
            {"role": "user", "content": texts[10]},
        ]
    ]
    for conversation in conversations:
        for kw in (
            {},
            {"add_generation_prompt": True},
            {"tokenize": False},
            {"tokenize": False, "add_generation_prompt": True, "suffix": "é"},
            {"return_dict": False},
            {"return_dict": False, "add_generation_prompt": True},
        ):
            want = hf.apply_chat_template(conversation, **kw)
            got = ours.apply_chat_template(conversation, **kw)
            assert plain(got) == plain(want), (conversation, kw)
    assert dict(ours.apply_chat_template(conversations)) == dict(
        hf.apply_chat_template(conversations)
    )
    assert ours.apply_chat_template(conversations, tokenize=False) == hf.apply_chat_template(
        conversations, tokenize=False
    )
    other = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    assert ours.apply_chat_template(
        conversations[0], chat_template=other, tokenize=False
    ) == hf.apply_chat_template(conversations[0], chat_template=other, tokenize=False)


def test_byte_tokenizer_methods_match_transformers_over_the_demo_vocabulary():
    from transformers import PreTrainedTokenizerFast

    ours = ByteTokenizer()
    hf = PreTrainedTokenizerFast(tokenizer_file=str(DEMO_DIR / "tokenizer.json"), **SPECIAL_NAMES)
    texts = random_texts(random.Random(4), ["é"])  # no special spellings: bytes here
    assert dict(ours(texts)) == dict(hf(texts))
    assert dict(ours(texts, padding=True, add_special_tokens=False)) == dict(
        hf(texts, padding=True, add_special_tokens=False)
    )
    ids = list(range(259))
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    tokens = [*hf.convert_ids_to_tokens(ids), "not-a-token"]
    assert ours.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)
    rows = [list(t.encode("utf-8")) for t in texts]
    assert ours.batch_decode(rows) == hf.batch_decode(rows)
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(ours, name) == getattr(hf, name), name
    assert ours.all_special_tokens == hf.all_special_tokens
    assert ours.all_special_ids == hf.all_special_ids
    # Text is bytes only here (a spelled "<s>" stays 3 bytes), so the template writes none.
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    conversation = [{"role": "user", "content": "naïve 😀"}]
    assert ours.apply_chat_template(conversation, chat_template=template) == dict(
        hf.apply_chat_template(conversation, chat_template=template)
    )


def test_apply_chat_template_without_a_template_says_how_to_give_one(tmp_path):
    write_tokenizer(tmp_path, vocab_size=97)
    with pytest.raises(ValueError, match="chat_template"):
        HFTokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_jinja_beside_the_tokenizer_is_read(tmp_path):
    write_tokenizer(tmp_path, vocab_size=97)
    (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    tok = HFTokenizer(tmp_path)
    assert tok.chat_template == CHAT_TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<s>[user] hi</s>"
