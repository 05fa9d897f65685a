import dataclasses
import random

import pytest

from jaxmamba.config import ModelConfig
from jaxmamba.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

from hf_fixtures import write_tokenizer

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
    assert tok.encode(text, add_bos=False) == ids[1:]
    assert tok.decode(ids) == text
    # Specials and out-of-range ids (the model's vocab is 272) carry no text.
    assert tok.decode([256, *ids[1:5], 257, 258, 271, *ids[5:]]) == text


def test_byte_tokenizer_replaces_invalid_utf8():
    tok = ByteTokenizer()
    assert tok.decode([0x68, 0xC3, 0x69, 0xFF]) == "h\ufffdi\ufffd"
    assert tok.decode([0xE4, 0xB8]) == "\ufffd"  # a truncated 3-byte sequence


def test_hf_tokenizer_round_trips_and_takes_specials_from_config(tok_dir):
    cfg = dataclasses.replace(
        ModelConfig.from_preset("nemotron-h-tiny"),
        bos_token_id=3,
        eos_token_id=1,
        eos_token_ids=(1,),
        pad_token_id=2,
    )
    tok = HFTokenizer(tok_dir, cfg)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (3, 1, 2)
    ids = tok.encode(TEXT)
    assert ids[0] == 3 and len(ids) < len(TEXT)  # BPE merged something
    assert all(0 <= i < 97 for i in ids)
    assert tok.encode(TEXT, add_bos=False) == ids[1:]
    assert tok.decode(ids[1:]) == TEXT


def test_hf_tokenizer_falls_back_to_tokenizer_specials(tok_dir):
    tok = HFTokenizer(tok_dir)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    ids = tok.encode(TEXT)
    assert ids[0] == 1
    assert tok.decode([*ids, 2, 0]) == TEXT  # specials skipped


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
