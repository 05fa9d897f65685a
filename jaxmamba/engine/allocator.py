"""Host-side allocators for state slots and KV pages. Pure bookkeeping: no device access."""

from __future__ import annotations


class OutOfBlocksError(RuntimeError):
    pass


class BlockAllocator:
    """Hands out integer ids in `[0, capacity)`; every id handed out must come back once."""

    def __init__(self, capacity: int, kind: str):
        if capacity <= 0:
            raise ValueError(f"{kind} capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.kind = kind
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out low ids first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int = 1) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} {self.kind}s, only {len(self._free)} free")
        ids = [self._free.pop() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if i not in self._used:
                raise ValueError(f"{self.kind} {i} freed twice or never allocated")
            self._used.remove(i)
            self._free.append(i)
