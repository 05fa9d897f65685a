"""Token bitmasks (host side, numpy): which tokens a row may sample next.

Layout (xgrammar's and llguidance's): a row is `W = ceil(V / 32)` int32 words; bit i of word j
(`(row[j] >> i) & 1`) allows token `32 * j + i`. Bits past V are zero. The device applies a row
to logits as `apply_bitmask_ref` does (disallowed tokens to -inf) before any other sampling
step reads them.
"""

from __future__ import annotations

import numpy as np


def bitmask_words(vocab_size: int) -> int:
    """W: int32 words per row for a vocabulary of `vocab_size` ids."""
    return (vocab_size + 31) // 32


def empty_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """An int32 `[rows, W]` bitmask that allows nothing."""
    return np.zeros((rows, bitmask_words(vocab_size)), np.int32)


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool `[..., V]`: whether each token is allowed, from int32 `[..., W]` words."""
    if bitmask.dtype != np.int32 or bitmask.shape[-1] != bitmask_words(vocab_size):
        raise ValueError(
            f"a bitmask for {vocab_size} ids is int32 [..., {bitmask_words(vocab_size)}], got "
            f"{bitmask.dtype} {list(bitmask.shape)}"
        )
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :vocab_size].astype(bool)


def allowed_ids(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids one row `[W]` allows, ascending."""
    return np.flatnonzero(unpack_bitmask(row, vocab_size))


def word_bits(ids) -> tuple[np.ndarray, np.ndarray]:
    """(words, bits): the distinct words holding `ids` and, per word, its bits of `ids` as an
    int32 pattern, so that `row[words] |= bits` sets them all and `row[words] &= ~bits` clears
    them."""
    patterns: dict[int, int] = {}
    for i in np.asarray(ids, np.int64).ravel().tolist():
        patterns[i // 32] = patterns.get(i // 32, 0) | (1 << (i % 32))
    words = np.array(sorted(patterns), np.int64)
    bits = np.array([patterns[w] for w in words.tolist()], np.uint32).view(np.int32)
    return words, bits


def set_bits(row: np.ndarray, ids, value: bool) -> None:
    """Sets (or clears) the bits of `ids` in one row `[W]`, in place."""
    words, bits = word_bits(ids)
    if value:
        row[words] |= bits
    else:
        row[words] &= ~bits


def token_allowed(row: np.ndarray, token_id: int) -> bool:
    return bool((int(row[token_id // 32]) >> (token_id % 32)) & 1)


def apply_bitmask_ref(
    logits: np.ndarray,  # [B, V] float
    bitmask: np.ndarray,  # [B, W] int32
) -> np.ndarray:
    """`logits` with every token the bitmask disallows at -inf (a new array): the reference
    for the device's masking before sampling."""
    if logits.ndim != 2 or bitmask.ndim != 2 or logits.shape[0] != bitmask.shape[0]:
        raise ValueError(
            f"logits [B, V] and bitmask [B, W] must share B, got {list(logits.shape)} and "
            f"{list(bitmask.shape)}"
        )
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    return np.where(allowed, logits, -np.inf).astype(logits.dtype)
