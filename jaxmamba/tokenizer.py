"""Tokenizers (host side): UTF-8 bytes for the random-weight byte presets, HF `tokenizer.json`
for checkpoints (directories and checkpoint presets)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Protocol

from jaxmamba.config import ModelConfig, checkpoint_dir

# Presets whose vocabulary is ByteTokenizer's.
BYTE_TOKENIZER_PRESETS = ("nemotron-h-tiny",)


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; 256 bos, 257 eos, 258 pad. Encoding adds the bos, as the
    byte presets' models expect."""

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 259

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # Specials and ids the model may sample beyond the byte range carry no text either way.
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """`tokenizers.Tokenizer` from `<dir>/tokenizer.json`, encoding as transformers does: the
    tokenizer's own post-processor adds its specials (a BOS only if it adds one;
    transformers' generic tokenizer ignores `add_bos_token`, and so does this). Special ids are
    the tokens that `tokenizer_config.json` names, else the model config's, else common
    spellings; `chat_template` is the config's template (a string, a list of named templates
    or None)."""

    _BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")
    _EOS_NAMES = ("</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>", "<|im_end|>")
    _PAD_NAMES = ("<pad>", "<|pad|>", "<|padding|>")

    def __init__(self, path: str | os.PathLike, cfg: ModelConfig | None = None):
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            self._tok = _Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise ValueError(f"cannot load tokenizer {file}: {e}") from e
        tok_cfg = _read_json(file.parent / "tokenizer_config.json")
        named = self._named_specials(tok_cfg)
        self.bos_token_id = self._special(
            named.get("bos_token"), cfg and cfg.bos_token_id, self._BOS_NAMES
        )
        self.eos_token_id = self._special(
            named.get("eos_token"), cfg and cfg.eos_token_id, self._EOS_NAMES
        )
        self.pad_token_id = self._special(
            named.get("pad_token"), cfg and cfg.pad_token_id, self._PAD_NAMES
        )
        self.special_tokens = dict(named)
        self.chat_template = tok_cfg.get("chat_template")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @staticmethod
    def _named_specials(tok_cfg: dict) -> dict[str, str]:
        out = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            v = tok_cfg.get(key)
            if isinstance(v, dict):  # AddedToken serialisation
                v = v.get("content")
            if isinstance(v, str):
                out[key] = v
        return out

    def _special(self, name: str | None, from_cfg: int | None, fallbacks: tuple[str, ...]):
        if name is not None and (i := self._tok.token_to_id(name)) is not None:
            return i
        if isinstance(from_cfg, int) and not isinstance(from_cfg, bool):
            return from_cfg
        for n in fallbacks:
            if (i := self._tok.token_to_id(n)) is not None:
                return i
        return None


def _read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def load_tokenizer(
    model_spec: str | os.PathLike, cfg: ModelConfig | None = None
) -> Tokenizer | None:
    """ByteTokenizer for the byte-level YAML presets, HFTokenizer for a checkpoint (directory
    or checkpoint preset) with tokenizer.json, else None (the caller then works on token ids
    only)."""
    path = Path(model_spec)
    if str(model_spec) in BYTE_TOKENIZER_PRESETS or (
        path.suffix in (".yaml", ".yml") and path.stem in BYTE_TOKENIZER_PRESETS
    ):
        return ByteTokenizer()
    checkpoint = checkpoint_dir(model_spec)
    if checkpoint is not None and (checkpoint / "tokenizer.json").is_file():
        return HFTokenizer(checkpoint, cfg)
    return None
