"""A radix tree over token ids whose nodes own KV pages and Mamba state checkpoints.

Edges are blocks of `block_size = lcm(chunk_size, page_size)` tokens, so every node sits at
a length where (a) its pages are full and (b) the SSD chunking has a boundary, i.e. where the
forward can write a state checkpoint. A node owns its block's pages and, if a step wrote one
there, the state slot holding the checkpoint for the prefix ending at it. A request can only
resume from a node that has a state; nodes without one still share their KV pages with the
nodes below them.

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


@dataclass
class Match:
    length: int  # tokens covered by the matched state checkpoint (0: no hit)
    slot: int | None  # the checkpoint's state slot
    path: list[Node]  # root-most first, ending at the node with the checkpoint
    pages: list[int]  # KV pages of that prefix, in order


class PrefixCache:
    def __init__(
        self, block_size: int, page_size: int, slots: BlockAllocator, pages: BlockAllocator
    ):
        if block_size % page_size:
            raise ValueError(f"block_size {block_size} must be a multiple of page_size {page_size}")
        self.block_size = block_size
        self.pages_per_block = block_size // page_size
        self.slots = slots
        self.pages = pages
        self.undo = slots.undo
        self.root = Node(parent=None, key=(), depth=0)
        self._clock = itertools.count(1)
        self.num_nodes = 0
        self.hit_tokens = 0
        self.query_tokens = 0

    # -- lookup -------------------------------------------------------------------------------
    def _blocks(self, tokens: list[int], limit: int):
        b = self.block_size
        for start in range(0, limit - limit % b, b):
            yield tuple(tokens[start : start + b])

    def match(self, tokens: list[int], max_len: int) -> Match:
        """The deepest checkpointed prefix of `tokens[:max_len]`."""
        node, path, best = self.root, [], Match(0, None, [], [])
        for key in self._blocks(tokens, max_len):
            node = node.children.get(key)
            if node is None:
                break
            path.append(node)
            if node.slot is not None:
                pages = [p for n in path for p in n.pages]
                best = Match(node.depth, node.slot, list(path), pages)
        self.query_tokens += max_len
        self.hit_tokens += best.length
        self.undo.push(lambda: self._uncount(max_len, best.length))
        return best

    def _uncount(self, query: int, hit: int) -> None:
        self.query_tokens -= query
        self.hit_tokens -= hit

    def acquire(self, nodes: list[Node]) -> None:
        self._touch(nodes, +1)

    def _touch(self, nodes: list[Node], delta: int) -> None:
        tick = next(self._clock)
        before = [(node, node.last_used) for node in nodes]
        for node in nodes:
            node.refs += delta
            node.last_used = tick

        def undo():
            for node, last_used in before:
                node.refs -= delta
                node.last_used = last_used

        self.undo.push(undo)

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
        node.last_used = next(self._clock)
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

    def evict(self, need_slots: int = 0, need_pages: int = 0) -> None:
        """Free least-recently-used unreferenced checkpoints/leaves until the pools have room."""
        while self.slots.num_free < need_slots or self.pages.num_free < need_pages:
            want_pages = self.pages.num_free < need_pages
            candidates = [
                n
                for n in self._unreferenced()
                if (not n.children if want_pages else n.slot is not None)
            ]
            if not candidates:
                return
            victim = min(candidates, key=lambda n: n.last_used)
            if victim.slot is not None:
                self.slots.free([victim.slot])
                self.undo.push(lambda v=victim, slot=victim.slot: setattr(v, "slot", slot))
                victim.slot = None
            self._prune(victim)

    def _prune(self, node: Node) -> None:
        """Remove stateless, childless, unreferenced nodes from `node` towards the root."""
        while node is not self.root and not node.children and node.slot is None and not node.refs:
            parent = node.parent
            self.pages.free(node.pages)
            del parent.children[node.key]
            self.num_nodes -= 1
            self.undo.push(lambda p=parent, n=node: self._reattach(p, n))
            node = parent

    def _reattach(self, parent: Node, node: Node) -> None:
        parent.children[node.key] = node
        self.num_nodes += 1

    def reset(self) -> None:
        """Drop every unreferenced node (e.g. between benchmark runs)."""
        self.evict(self.slots.capacity, self.pages.capacity)
