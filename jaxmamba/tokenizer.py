"""Tokenizers (host side): UTF-8 bytes for the random-weight byte presets, HF `tokenizer.json`
for checkpoints (directories and checkpoint presets). Both offer the transformers methods that
people call on `llm.get_tokenizer()` (`__call__`, `encode`, `decode`, `batch_decode`, the
token <-> id maps, `apply_chat_template`, the special tokens), with transformers' defaults
except `decode`'s `skip_special_tokens`, which is True here as in the engine's detokenizer."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from jaxmamba.chat import render_chat
from jaxmamba.config import ModelConfig, checkpoint_dir

# Presets whose vocabulary is ByteTokenizer's.
BYTE_TOKENIZER_PRESETS = ("nemotron-h-tiny",)

# The special-token names transformers knows, in the order its `all_special_tokens` lists them.
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class BatchEncoding(dict):
    """What calling a tokenizer returns: `input_ids` (and `attention_mask`), read as keys or as
    attributes, like transformers' `BatchEncoding`."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class _TransformersMethods:
    """The transformers-style surface, built on each tokenizer's `encode`, `decode`,
    `_id_to_token` and `_token_to_id`."""

    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    unk_token_id: int | None = None
    chat_template: Any = None
    # {"bos_token": "<s>", ...}: the chat template's variables.
    special_tokens: dict[str, str]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: int | Sequence[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def _id_to_token(self, i: int) -> str | None:
        raise NotImplementedError

    def _token_to_id(self, token: str) -> int | None:
        raise NotImplementedError

    def __call__(
        self,
        text: str | Sequence[str],
        *,
        add_special_tokens: bool = True,
        padding: bool | str = False,
        return_attention_mask: bool = True,
    ) -> BatchEncoding:
        """`input_ids` (and `attention_mask`) of one text, or of each of a list of texts;
        `padding=True` (or "longest") right-pads a list to its longest row with the pad id."""
        if padding not in (False, True, "longest", "do_not_pad"):
            raise ValueError(f"padding must be False, True, 'longest' or 'do_not_pad': {padding!r}")
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens=add_special_tokens)
            out = BatchEncoding(input_ids=ids)
            if return_attention_mask:
                out["attention_mask"] = [1] * len(ids)
            return out
        if not isinstance(text, Sequence) or not all(isinstance(t, str) for t in text):
            raise TypeError(f"text must be a str or a list of str, got {text!r}")
        rows = [self.encode(t, add_special_tokens=add_special_tokens) for t in text]
        masks = [[1] * len(r) for r in rows]
        if padding in (True, "longest"):
            if self.pad_token_id is None:
                raise ValueError("padding needs a pad token, and this tokenizer has none")
            width = max((len(r) for r in rows), default=0)
            masks = [m + [0] * (width - len(m)) for m in masks]
            rows = [r + [self.pad_token_id] * (width - len(r)) for r in rows]
        out = BatchEncoding(input_ids=rows)
        if return_attention_mask:
            out["attention_mask"] = masks
        return out

    def batch_decode(
        self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = True
    ) -> list[str]:
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]

    def convert_ids_to_tokens(
        self, ids: int | Sequence[int], skip_special_tokens: bool = False
    ) -> str | None | list[str | None]:
        """The token string of an id (None for an id outside the vocabulary), or of each id."""
        if isinstance(ids, int):
            return self._id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        """The id of a token string (the unknown token's id, or None, for one not in the
        vocabulary), or of each token."""
        if isinstance(tokens, str):
            i = self._token_to_id(tokens)
            return self.unk_token_id if i is None else i
        return [self.convert_tokens_to_ids(t) for t in tokens]

    @property
    def bos_token(self) -> str | None:
        return self._special_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self._special_token(self.eos_token_id)

    @property
    def pad_token(self) -> str | None:
        return self._special_token(self.pad_token_id)

    @property
    def unk_token(self) -> str | None:
        return self._special_token(self.unk_token_id)

    @property
    def all_special_ids(self) -> list[int]:
        ids = [self.bos_token_id, self.eos_token_id, self.unk_token_id, self.pad_token_id]
        return list(dict.fromkeys(i for i in ids if i is not None))

    @property
    def all_special_tokens(self) -> list[str]:
        return [self._id_to_token(i) for i in self.all_special_ids]

    def _special_token(self, i: int | None) -> str | None:
        return None if i is None else self._id_to_token(i)

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]] | list[list[dict[str, Any]]],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = True,
        **kwargs: Any,
    ) -> str | list[str] | list[int] | list[list[int]] | BatchEncoding:
        """A conversation (or a list of them) rendered with the tokenizer's chat template (or
        `chat_template`), as transformers 5 does: the text if `tokenize=False`, else its ids
        with no specials added (the template writes them), as a `BatchEncoding` if
        `return_dict`. Other keywords (`tools`, `documents`, template flags) go to the
        template."""
        if not isinstance(conversation, list | tuple) or not conversation:
            raise ValueError(f"a conversation must be a non-empty list, got {conversation!r}")
        batched = isinstance(conversation[0], list | tuple)
        texts = [
            render_chat(
                self,
                messages,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
            for messages in (conversation if batched else [conversation])
        ]
        text = texts if batched else texts[0]
        if not tokenize:
            return text
        out = self(text, add_special_tokens=False)
        return out if return_dict else out["input_ids"]


class ByteTokenizer(_TransformersMethods):
    """UTF-8 bytes are ids 0..255; 256 bos, 257 eos, 258 pad. Encoding adds the bos, as the
    byte presets' models expect; text is bytes only (a spelled "<s>" is three bytes, not the
    bos). Token strings are those of a byte-level BPE (GPT-2's
    byte-to-character map), as in the demo model's tokenizer.json."""

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 259

    _SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}

    def __init__(self):
        self.special_tokens = dict(self._SPECIALS)
        self._tokens = [*byte_level_chars(), *self._SPECIALS.values()]
        self._ids = {t: i for i, t in enumerate(self._tokens)}

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: int | Sequence[int], skip_special_tokens: bool = True) -> str:
        # Specials and ids the model may sample beyond the byte range carry no text either way.
        ids = [ids] if isinstance(ids, int) else ids
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def _id_to_token(self, i: int) -> str | None:
        return self._tokens[i] if 0 <= i < len(self._tokens) else None

    def _token_to_id(self, token: str) -> int | None:
        return self._ids.get(token)


def byte_level_chars() -> list[str]:
    """GPT-2's byte-to-character map (what the ByteLevel pre-tokenizer applies): printable
    Latin-1 bytes stand for themselves, the others for the characters from U+0100 on."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    chars, shifted = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


class HFTokenizer(_TransformersMethods):
    """`tokenizers.Tokenizer` from `<dir>/tokenizer.json`, encoding as transformers does: the
    tokenizer's own post-processor adds its specials (a BOS only if it adds one;
    transformers' generic tokenizer ignores `add_bos_token`, and so does this). Special ids are
    the tokens that `tokenizer_config.json` names, else the model config's, else common
    spellings; `chat_template` is the config's template (a string, a list of named templates
    or None), else `chat_template.jinja` beside it (where transformers 5 saves it)."""

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
        self.unk_token_id = self._special(named.get("unk_token"), None, ())
        self.special_tokens = dict(named)
        self.chat_template = tok_cfg.get("chat_template")
        jinja = file.parent / "chat_template.jinja"
        if self.chat_template is None and jinja.is_file():
            self.chat_template = jinja.read_text()

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary without added tokens (as transformers counts it)."""
        return self._tok.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: int | Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [ids] if isinstance(ids, int) else ids
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def _id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def _token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @staticmethod
    def _named_specials(tok_cfg: dict) -> dict[str, str]:
        out = {}
        for key in _SPECIAL_NAMES:
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


def with_tokenizer_eos(cfg: ModelConfig, tokenizer: Tokenizer | None) -> ModelConfig:
    """`cfg` whose stop ids include the tokenizer's eos, as vLLM's do."""
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    if eos is None or eos in cfg.eos_token_ids or not 0 <= eos < cfg.vocab_size:
        return cfg
    return dataclasses.replace(cfg, eos_token_ids=(*cfg.eos_token_ids, eos))
