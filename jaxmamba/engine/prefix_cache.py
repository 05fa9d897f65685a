"""A radix tree over token ids whose nodes own KV pages and Mamba state checkpoints.

Edges are blocks of `block_size = lcm(chunk_size, page_size)` tokens, so every node sits at
a length where (a) its pages are full and (b) the SSD chunking has a boundary, i.e. where the
forward can write a state checkpoint. A node owns its block's pages and, if a step wrote one
there, the state slot holding the checkpoint for the prefix ending at it. A request can only
resume from a node that has a state; nodes without one still share their KV pages with the
nodes below them.

A lookup reports two depths: the deepest node with a state (where a request can resume) and
the deepest node at all (how far its KV is cached). When the second is deeper, the prompt
branches off a path other requests took below the last checkpoint on it: the scheduler then
has the request checkpoint there too (a *branch point*), so the next one resumes there.

Eviction is cost-aware (GreedyDual-Size-Frequency): an unreferenced node's priority is
`inflation + uses * saved / cost`, where `saved` is the tokens of recompute its checkpoint
avoids (its depth minus the nearest checkpoint above it; 0 for a KV-only node), `cost` what it
holds (a state slot weighs `slot_cost` pages, far more than its own pages), `uses` how often it
was hit, and `inflation` the priority of the last victim at the time the node was last used
(so recency still counts). The lowest priority goes first; with equal costs and values this
is LRU. Evicting a checkpoint keeps its node (and KV) when other nodes hang below it: a
KV-only node is cheap and still tells the next lookup where prompts branch.

Pure host bookkeeping: the device writes checkpoints (the step's tracked rows); this tree
only decides which slot and pages they live in and when they can be reused. What scheduling
changes (lookups, references, evictions) goes into the allocators' undo log, so a step that
fails puts the tree back as it was.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from jaxmamba.engine.allocator import BlockAllocator


@dataclass(eq=False)
class Node:
    parent: Node | None
    key: tuple[int, ...]
    depth: int  # tokens from the root to the end of this node's block
    pages: list[int] = field(default_factory=list)
    slot: int | None = None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    refs: int = 0
    last_used: int = 0
    uses: int = 1  # insertions and hits
    inflation: float = 0.0  # the cache's inflation when the node was last used


@dataclass
class Match:
    length: int  # tokens covered by the matched state checkpoint (0: no hit)
    slot: int | None  # the checkpoint's state slot
    path: list[Node]  # root-most first, ending at the node with the checkpoint
    pages: list[int]  # KV pages of that prefix, in order
    kv_length: int = 0  # tokens covered by the deepest matching node, with a state or not


# Counters of `PrefixCache.stats` (stable names: exported as metrics).
STAT_NAMES = (
    "lookups",  # admitted requests looked up
    "hits",  # ... that resumed from a checkpoint
    "partial_hits",  # ... whose KV matched deeper than their deepest checkpoint
    "hit_tokens",  # prompt tokens served from checkpoints
    "query_tokens",  # prompt tokens looked up
    "recomputed_tokens",  # tokens between a checkpoint (or 0) and the deepest KV match
    "checkpoints_written",  # checkpoints the tree took (prefill, branch points and decode)
    "branch_checkpoints",  # ... of which at branch points
    "evicted_checkpoints",  # state slots taken back from nodes
    "evicted_nodes",  # nodes removed (their pages freed)
)


class PrefixCache:
    def __init__(
        self,
        block_size: int,
        page_size: int,
        slots: BlockAllocator,
        pages: BlockAllocator,
        *,
        slot_cost: float = 1.0,
    ):
        """`slot_cost`: what a state slot holds, in KV pages (state bytes / page bytes)."""
        if block_size % page_size:
            raise ValueError(f"block_size {block_size} must be a multiple of page_size {page_size}")
        self.block_size = block_size
        self.pages_per_block = block_size // page_size
        self.slots = slots
        self.pages = pages
        self.slot_cost = float(slot_cost)
        self.undo = slots.undo
        self.root = Node(parent=None, key=(), depth=0)
        self._clock = itertools.count(1)
        self.num_nodes = 0
        self.num_checkpoints = 0  # nodes holding a state slot
        self.inflation = 0.0
        self.stats = dict.fromkeys(STAT_NAMES, 0)

    @property
    def hit_tokens(self) -> int:
        return self.stats["hit_tokens"]

    @property
    def query_tokens(self) -> int:
        return self.stats["query_tokens"]

    def count(self, **deltas: int) -> None:
        """Add to the counters (undone with a failed step)."""
        for name, delta in deltas.items():
            self.stats[name] += delta
        self.undo.push(lambda: self._uncount(deltas))

    def _uncount(self, deltas: dict[str, int]) -> None:
        for name, delta in deltas.items():
            self.stats[name] -= delta

    # -- lookup -------------------------------------------------------------------------------
    def _blocks(self, tokens: list[int], limit: int):
        b = self.block_size
        for start in range(0, limit - limit % b, b):
            yield tuple(tokens[start : start + b])

    def match(self, tokens: list[int], max_len: int) -> Match:
        """The deepest checkpointed prefix of `tokens[:max_len]` (and how deep its KV goes).
        Counts nothing: the scheduler counts what it admits (`count`)."""
        node, path, best = self.root, [], Match(0, None, [], [])
        for key in self._blocks(tokens, max_len):
            node = node.children.get(key)
            if node is None:
                break
            path.append(node)
            if node.slot is not None:
                pages = [p for n in path for p in n.pages]
                best = Match(node.depth, node.slot, list(path), pages)
        best.kv_length = path[-1].depth if path else 0
        return best

    def path_to(self, tokens: list[int], length: int) -> list[Node]:
        """The nodes of `tokens[:length]` (a block multiple that is in the tree)."""
        node, path = self.root, []
        for key in self._blocks(tokens, length):
            node = node.children[key]
            path.append(node)
        return path

    def acquire(self, nodes: list[Node]) -> None:
        self._touch(nodes, +1)

    def _touch(self, nodes: list[Node], delta: int, *, hit: bool = False) -> None:
        tick = next(self._clock)
        before = [(node, node.last_used, node.uses, node.inflation) for node in nodes]
        for node in nodes:
            node.refs += delta
            node.last_used = tick
            node.inflation = self.inflation
            node.uses += hit

        def undo():
            for node, last_used, uses, inflation in before:
                node.refs -= delta
                node.last_used, node.uses, node.inflation = last_used, uses, inflation

        self.undo.push(undo)

    def hit(self, nodes: list[Node]) -> None:
        """`acquire` for a request that resumes from the last of `nodes`: counts a use."""
        self._touch(nodes, +1, hit=True)

    def release(self, nodes: list[Node]) -> None:
        if any(node.refs <= 0 for node in nodes):
            raise RuntimeError("prefix-cache node released more often than acquired")
        self._touch(nodes, -1)

    # -- insertion ----------------------------------------------------------------------------
    def insert(
        self, tokens: list[int], length: int, request_pages: list[int], slot: int
    ) -> tuple[list[Node], set[int], bool]:
        """Record that `slot` holds the state after `tokens[:length]` (a block multiple).

        Blocks missing from the tree become nodes that take over the request's pages for them.
        Returns the new nodes (the caller holds a reference on them while it uses their
        pages), the pages now owned by the tree, and whether the tree took the slot (False
        when that prefix already had a checkpoint: the caller frees the slot).
        """
        if length % self.block_size or length <= 0:
            raise ValueError(f"checkpoint length {length} is not a positive block multiple")
        node, created, taken = self.root, [], set()
        for i, key in enumerate(self._blocks(tokens, length)):
            child = node.children.get(key)
            if child is None:
                block_pages = request_pages[
                    i * self.pages_per_block : (i + 1) * self.pages_per_block
                ]
                child = Node(
                    parent=node, key=key, depth=node.depth + self.block_size, pages=block_pages
                )
                node.children[key] = child
                created.append(child)
                taken.update(block_pages)
                self.num_nodes += 1
            node = child
        took_slot = node.slot is None
        if took_slot:
            node.slot = slot
            self.num_checkpoints += 1
        node.last_used = next(self._clock)
        node.inflation = self.inflation
        return created, taken, took_slot

    # -- eviction -----------------------------------------------------------------------------
    def _unreferenced(self):
        stack, out = list(self.root.children.values()), []
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.refs == 0:
                out.append(node)
        return out

    def saved_tokens(self, node: Node) -> int:
        """Tokens of recompute the node's checkpoint avoids (0 without one)."""
        if node.slot is None:
            return 0
        above = node.parent
        while above is not self.root and above.slot is None:
            above = above.parent
        return node.depth - above.depth

    def priority(self, node: Node) -> float:
        cost = len(node.pages) + (self.slot_cost if node.slot is not None else 0.0)
        return node.inflation + node.uses * self.saved_tokens(node) / max(cost, 1e-9)

    def evict(self, need_slots: int = 0, need_pages: int = 0) -> None:
        """Free the lowest-priority unreferenced checkpoints/leaves until the pools have room."""
        while self.slots.num_free < need_slots or self.pages.num_free < need_pages:
            want_pages = self.pages.num_free < need_pages
            candidates = [
                n
                for n in self._unreferenced()
                if (not n.children if want_pages else n.slot is not None)
            ]
            if not candidates:
                return
            victim = min(candidates, key=lambda n: (self.priority(n), n.last_used))
            inflation = self.inflation
            self.inflation = max(inflation, self.priority(victim))
            self.undo.push(lambda v=inflation: setattr(self, "inflation", v))
            if victim.slot is not None:
                self.slots.free([victim.slot])
                self.undo.push(lambda v=victim, slot=victim.slot: self._restore_slot(v, slot))
                victim.slot = None
                self.num_checkpoints -= 1
                self.count(evicted_checkpoints=1)
            self._prune(victim)

    def _restore_slot(self, node: Node, slot: int) -> None:
        node.slot = slot
        self.num_checkpoints += 1

    def _prune(self, node: Node) -> None:
        """Remove stateless, childless, unreferenced nodes from `node` towards the root."""
        while node is not self.root and not node.children and node.slot is None and not node.refs:
            parent = node.parent
            self.pages.free(node.pages)
            del parent.children[node.key]
            self.num_nodes -= 1
            self.count(evicted_nodes=1)
            self.undo.push(lambda p=parent, n=node: self._reattach(p, n))
            node = parent

    def _reattach(self, parent: Node, node: Node) -> None:
        parent.children[node.key] = node
        self.num_nodes += 1

    def clear(self) -> None:
        """Forget every node without freeing its slot or pages: the device state they named is
        gone, and the caller empties the pools whole. The counters stay."""
        self.root = Node(parent=None, key=(), depth=0)
        self.num_nodes = 0
        self.num_checkpoints = 0
        self.inflation = 0.0

    def reset(self) -> None:
        """Drop every unreferenced node (e.g. between benchmark runs)."""
        self.evict(self.slots.capacity, self.pages.capacity)
