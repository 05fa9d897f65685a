import dataclasses
import random
import shutil

import pytest

from jaxmamba.config import ModelConfig
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
        ModelConfig.from_preset("nemotron-h-tiny"),
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
    tiny = ModelConfig.from_preset("nemotron-h-tiny")
    assert isinstance(load_tokenizer("nemotron-h-tiny", tiny), ByteTokenizer)
    tiny.to_yaml(tmp_path / "nemotron-h-tiny.yaml")
    assert isinstance(load_tokenizer(tmp_path / "nemotron-h-tiny.yaml", tiny), ByteTokenizer)
    assert isinstance(load_tokenizer(str(tok_dir), None), HFTokenizer)
    assert load_tokenizer("mamba2-130m", ModelConfig.from_preset("mamba2-130m")) is None
    assert load_tokenizer(tmp_path, tiny) is None  # a directory without tokenizer.json
