"""Host-side allocators for state slots and KV pages, and the undo log that makes a step's
bookkeeping transactional. Pure bookkeeping: no device access."""

from __future__ import annotations

from collections.abc import Callable


class OutOfBlocksError(RuntimeError):
    pass


class UndoLog:
    """While a transaction is open, every change registers how to put it back; a failed
    transaction undoes them newest first, so everything is exactly as before it began."""

    def __init__(self):
        self._undo: list[Callable[[], None]] | None = None

    @property
    def active(self) -> bool:
        return self._undo is not None

    def push(self, undo: Callable[[], None]) -> None:
        if self._undo is not None:
            self._undo.append(undo)

    def begin(self) -> None:
        if self._undo is not None:
            raise RuntimeError("a transaction is already open")
        self._undo = []

    def commit(self) -> None:
        self._undo = None

    def rollback(self) -> None:
        undo, self._undo = self._undo or [], None
        for fn in reversed(undo):
            fn()


class BlockAllocator:
    """Hands out integer ids in `[0, capacity)`, reference-counted: `allocate` hands an id out
    with one reference, `share` adds one (n > 1 samples read their prompt's KV pages), `free`
    drops one, and the id is free again when none is left."""

    def __init__(self, capacity: int, kind: str, undo: UndoLog | None = None):
        if capacity <= 0:
            raise ValueError(f"{kind} capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.kind = kind
        self.undo = undo if undo is not None else UndoLog()
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out low ids first
        self._refs: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refs(self, i: int) -> int:
        return self._refs.get(i, 0)

    def allocate(self, n: int = 1) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} {self.kind}s, only {len(self._free)} free")
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self._refs[i] = 1
        self.undo.push(lambda: self._unallocate(ids))
        return ids

    def share(self, ids: list[int]) -> None:
        """One more reference to each of `ids` (allocated ones)."""
        ids = list(ids)
        self._check_allocated(ids)
        for i in ids:
            self._refs[i] += 1
        self.undo.push(lambda: self._unshare(ids))

    def free(self, ids: list[int]) -> None:
        """Drop one reference to each of `ids`; those left with none are free again."""
        ids = list(ids)
        self._check_allocated(ids)
        released = []
        for i in ids:
            self._refs[i] -= 1
            if self._refs[i] == 0:
                del self._refs[i]
                self._free.append(i)
                released.append(i)
        self.undo.push(lambda: self._unfree(ids, released))

    def reset(self) -> None:
        """Every id free again, outside any transaction: what they named is gone (the device
        state was lost)."""
        self._free = list(range(self.capacity - 1, -1, -1))
        self._refs = {}

    def _check_allocated(self, ids: list[int]) -> None:
        for i in ids:
            if self._refs.get(i, 0) <= 0:
                raise ValueError(f"{self.kind} {i} freed twice or never allocated")

    def _unallocate(self, ids: list[int]) -> None:
        for i in reversed(ids):
            del self._refs[i]
            self._free.append(i)

    def _unshare(self, ids: list[int]) -> None:
        for i in ids:
            self._refs[i] -= 1

    def _unfree(self, ids: list[int], released: list[int]) -> None:
        for i in reversed(released):
            if self._free.pop() != i:
                raise RuntimeError(f"{self.kind} undo out of order")
        for i in ids:
            self._refs[i] = self._refs.get(i, 0) + 1
