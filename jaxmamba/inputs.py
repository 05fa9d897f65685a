"""Prompts in vLLM's forms, turned into (text or None, token ids) on the host.

Accepted, alone or in a list (or tuple): a `str`; `{"prompt": str}`; `{"prompt_token_ids":
ids}`, where ids are a sequence or 1-D integer numpy array of ints; or, through the
`prompt_token_ids=` keyword, one id sequence or a list of them (a 2-D integer array too).
Anything else is a `TypeError` that names the type found; ids outside the vocab and empty
prompts are a `ValueError`.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxmamba.tokenizer import Tokenizer

Prompt = tuple[str | None, list[int]]

_DICT_KEYS = ("prompt", "prompt_token_ids")


def parse_prompts(
    prompts: Any,
    prompt_token_ids: Any = None,
    tokenizer: Tokenizer | None = None,
    vocab_size: int | None = None,
) -> list[Prompt]:
    """Every prompt as (its text or None, its token ids), in order."""
    if prompts is not None and prompt_token_ids is not None:
        raise ValueError("pass prompts or prompt_token_ids, not both")
    if prompt_token_ids is not None:
        out = [(None, ids) for ids in _id_lists(prompt_token_ids)]
    elif prompts is None:
        raise ValueError("no prompts: pass prompts or prompt_token_ids")
    elif _is_single(prompts):
        out = [_one(prompts, "prompt", tokenizer)]
    elif isinstance(prompts, list | tuple):
        out = [_one(p, f"prompts[{i}]", tokenizer) for i, p in enumerate(prompts)]
    else:
        raise TypeError(
            f"prompts must be a str, a dict with 'prompt' or 'prompt_token_ids', or a list of "
            f"them, got {_type(prompts)}"
        )
    if not out:
        raise ValueError("no prompts: the list is empty")
    for i, (_, ids) in enumerate(out):
        _check_ids(f"prompt {i}", ids, vocab_size)
    return out


def _is_single(p: Any) -> bool:
    return isinstance(p, str | dict)


def _one(p: Any, where: str, tokenizer: Tokenizer | None) -> Prompt:
    if isinstance(p, str):
        return p, _encode(p, where, tokenizer)
    if isinstance(p, dict):
        unknown = sorted(str(k) for k in p if k not in _DICT_KEYS)
        if unknown or len(p) != 1:
            raise TypeError(
                f"{where} must be a dict with exactly one of the keys {list(_DICT_KEYS)}, "
                f"got keys {sorted(map(str, p))}"
            )
        if "prompt" in p:
            text = p["prompt"]
            if not isinstance(text, str):
                raise TypeError(f"{where}['prompt'] must be a str, got {_type(text)}")
            return text, _encode(text, where, tokenizer)
        return None, _ids(p["prompt_token_ids"], f"{where}['prompt_token_ids']")
    raise TypeError(
        f"{where} must be a str or a dict with 'prompt' or 'prompt_token_ids', got {_type(p)} "
        "(token ids go in {'prompt_token_ids': ids} or prompt_token_ids=)"
    )


def _encode(text: str, where: str, tokenizer: Tokenizer | None) -> list[int]:
    if tokenizer is None:
        raise ValueError(
            f"{where} is text but this model has no tokenizer: pass token ids instead "
            "({'prompt_token_ids': ids} or prompt_token_ids=)"
        )
    return tokenizer.encode(text)


def _id_lists(value: Any) -> list[list[int]]:
    """The `prompt_token_ids=` keyword: one id sequence, or a sequence of them."""
    where = "prompt_token_ids"
    if isinstance(value, np.ndarray):
        if value.ndim == 1:
            return [_ids(value, where)]
        if value.ndim == 2:
            return [_ids(row, f"{where}[{i}]") for i, row in enumerate(value)]
        raise TypeError(f"{where} must be a 1-D or 2-D integer array, got {value.ndim}-D")
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise TypeError(f"{where} must be a list of ints or a list of lists, got {_type(value)}")
    if len(value) and all(_is_int(t) for t in value):
        return [_ids(value, where)]
    return [_ids(row, f"{where}[{i}]") for i, row in enumerate(value)]


def _ids(value: Any, where: str) -> list[int]:
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or not np.issubdtype(value.dtype, np.integer):
            raise TypeError(
                f"{where} must be a 1-D integer array, got a {value.ndim}-D {value.dtype} array"
            )
        return [int(t) for t in value]
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise TypeError(f"{where} must be a list of ints, got {_type(value)}")
    for j, t in enumerate(value):
        if not _is_int(t):
            raise TypeError(f"{where}[{j}] must be an int token id, got {t!r} ({_type(t)})")
    return [int(t) for t in value]


def _is_int(t: Any) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool | np.bool_)


def _check_ids(where: str, ids: list[int], vocab_size: int | None) -> None:
    if not ids:
        raise ValueError(f"{where} is empty")
    if vocab_size is not None:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{where} has token ids {bad[:5]} outside the vocab [0, {vocab_size})")


def _type(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"numpy array of {value.dtype}"
    return type(value).__name__
