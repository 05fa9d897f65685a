"""The scheduler: which requests run in the next step, with which tokens, in which bucket.

Host bookkeeping only. Each step carries every decoding request (one token each, its input
read on device from the previous step's sample) plus prefill chunks of at most
`max_num_batched_tokens` tokens in all, so a step can mix decode rows and prefill chunks.
Admission reserves a state slot and every KV page the request can need, so a running request
never waits for memory; the prefix cache is evicted (cost-aware, see prefix_cache.py) when the
pools run short.

Prefix sharing (docs/prefix_cache.md): a prefill chunk checkpoints at its last block boundary
and, when the request's prompt branches off a prefix that others share, at the branch point.
A branch point is known either from the tree (KV cached deeper than any state on the path) or
from the waiting queue (prompts that arrive together): then the first of them is admitted as
the *leader* and checkpoints there, and the others wait until that checkpoint is in the tree,
so they resume from it instead of computing the shared prefix again. A request that arrives
while a running request has not yet fed the prefix they share (a later chunk of its prompt)
makes that request checkpoint there in the same way, and waits for it.

`n > 1`: sample 0 prefills the prompt; the step that feeds its last chunk also *forks* the
other samples (up to `MAX_FORKS` a step): each gets its own slot, a copy of sample 0's end
state and of the prompt's partial last KV page (made inside the step), shares the prompt's
full pages (reference-counted), and samples its first token from the same logits in a
zero-token row. Until then the samples wait; those past `MAX_FORKS` (or without room) are
admitted afterwards like any request and resume from the prefix cache.

Structured outputs: a request whose grammar is still compiling waits in the queue (vLLM's
`WAITING_FOR_FSM`); a row that samples carries its request's matcher (`RowSpec.matcher`), from
which the step builder writes the row's token bitmask.

Speculative decoding (`EngineConfig.speculative_config`, docs/speculative.md): a step of decode
rows only, none of whose requests has a grammar, at most `disable_by_batch_size` of them, is a
*verify* step: each row carries 1 + k tokens, drafted, verified and accepted on the device. The
host learns how many a row kept only when it reads the step, after it has scheduled the next:
`num_computed` and `num_scheduled_outputs` count one token per step until then (a lower bound;
`Scheduler.accepted` adds the rest), and the device keeps the true lengths
(`lens_from_device`). Decode rows take no checkpoints then (their length is not known when the
step is built); prompt checkpoints are as without speculation.

`transaction()` wraps scheduling a step and dispatching it: every change made inside (queues,
request counters, slots, pages, prefix-cache references and evictions) is undone if it raises.
When the device state itself is lost (a step consumed it and failed), `drop_device_state`
ends the running requests' hold on everything and empties the pools and the prefix cache.
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections import deque
from dataclasses import dataclass, field

from jaxmamba.config import ModelConfig
from jaxmamba.engine.allocator import BlockAllocator, UndoLog
from jaxmamba.engine.batch import Bucket, RowSpec, pow2_buckets, smallest_fitting
from jaxmamba.engine.config import EngineConfig
from jaxmamba.engine.prefix_cache import PrefixCache
from jaxmamba.engine.request import Request
from jaxmamba.step_contract import (
    MAX_DECODE_CHECKPOINTS,
    MAX_FORKS,
    MAX_PREFILL_CHECKPOINTS,
    MAX_PROMPT_LOGPROB_TOKENS,
)


@dataclass
class ScheduledRow:
    request: Request
    spec: RowSpec
    samples: bool  # the row's sample is the request's next output token
    # (slot, length): the step writes the state after `length` tokens into `slot`
    checkpoints: list[tuple[int, int]] = field(default_factory=list)

    @property
    def prompt_checkpoints(self) -> list[tuple[int, int]]:
        """Checkpoints of prompt prefixes: the tree takes them as soon as the step is
        dispatched (`Scheduler.record_dispatched`)."""
        return [c for c in self.checkpoints if c[1] <= self.request.prompt_len]

    @property
    def output_checkpoints(self) -> list[tuple[int, int]]:
        """Checkpoints that cover sampled tokens: recorded once the host has read them."""
        return [c for c in self.checkpoints if c[1] > self.request.prompt_len]


@dataclass
class ScheduledStep:
    rows: list[ScheduledRow]  # decode rows first
    bucket: Bucket
    num_decode_rows: int
    # Some row samples under a grammar (the step carries a token bitmask): the engine reads
    # the step's tokens before it builds the next (the next bitmask needs them).
    constrained: bool = False

    @property
    def num_spec(self) -> int:
        """k of a verify step (its decode rows carry 1 + k tokens), else 0."""
        return self.bucket.num_spec

    @property
    def specs(self) -> list[RowSpec]:
        return [r.spec for r in self.rows]

    def output_row(self, i: int) -> int:
        """Row of the step's output for `rows[i]`: filler decode rows pad the decode block."""
        if i < self.num_decode_rows:
            return i
        return i + self.bucket.num_decode - self.num_decode_rows


# Speculation pauses by measured acceptance (`Scheduler.verified`): after this many verify
# steps in a row that kept no draft, decode steps stop speculating for `SPEC_PAUSE` steps,
# doubling with each further such verify step up to `SPEC_PAUSE_MAX`.
SPEC_MISSES_TO_PAUSE = 4
SPEC_PAUSE = 8
SPEC_PAUSE_MAX = 1024


class Scheduler:
    def __init__(self, model_cfg: ModelConfig, config: EngineConfig):
        self.model_cfg = model_cfg
        config = config.for_chunk_size(model_cfg.chunk_size)
        self.config = config
        if config.max_num_seqs > config.state_slots:
            raise ValueError(
                f"num_state_slots {config.state_slots} < max_num_seqs {config.max_num_seqs}"
            )
        if config.pages < config.max_pages_per_seq:
            raise ValueError(f"num_pages {config.pages} cannot hold one max_model_len sequence")
        self.undo = UndoLog()
        # id -> request, for the requests whose fields the open (or last) transaction saved
        self._saved: dict[int, Request] = {}
        self.slots = BlockAllocator(config.state_slots, "state slot", self.undo)
        self.pages = BlockAllocator(config.pages, "KV page", self.undo)
        self.block_size = math.lcm(model_cfg.chunk_size, config.page_size)
        self.prefix_cache = None
        if config.enable_prefix_caching:
            self.prefix_cache = PrefixCache(
                self.block_size, config.page_size, self.slots, self.pages,
                slot_cost=slot_cost_in_pages(model_cfg, config.page_size),
            )  # fmt: skip
        # Leaders' planned branch checkpoints: id(leader) -> (leader, length, prefix tokens).
        # Waiting requests with that prefix are held until the checkpoint is in the tree.
        self.pending_branches: dict[int, tuple[Request, int, tuple[int, ...]]] = {}
        self.held_admissions = 0  # admissions that were held back for a leader's checkpoint
        self.forked_samples = 0  # n > 1 samples forked off sample 0's prefill (no prompt fed)
        self.decode_buckets = pow2_buckets(config.max_num_seqs)
        # Prefill rows are not bucketed: every prefill/mixed step has `prefill_rows(t, bd)` of
        # them (empty ones cost a few padding chunks), which keeps the bucket count linear.
        self.max_prefill_rows = min(config.max_prefill_seqs, config.max_num_seqs)
        self.token_buckets = pow2_buckets(config.max_num_batched_tokens, start=16)
        self.waiting: deque[Request] = deque()
        self._prompts_ending: set[int] = set()
        self.running: list[Request] = []
        self.speculative = config.speculative_config  # SpeculativeConfig | None
        self._spec_misses = 0  # verify steps read since one last kept a draft
        self._spec_pause = 0  # decode steps left that do not speculate (`verified`)
        self._spec_backoff = 0  # the length of the last pause
        self.spec_paused_steps = 0  # decode steps that did not speculate for a pause

    # -- buckets ------------------------------------------------------------------------------
    def all_buckets(self) -> list[Bucket]:
        """Every bucket a step can use: what `precompile` compiles."""
        buckets = [Bucket(b, b, b) for b in self.decode_buckets]
        k = 0 if self.speculative is None else self.speculative.num_speculative_tokens
        buckets += [Bucket(b * (1 + k), b, b) for b in self.verify_buckets()]
        for t in self.token_buckets:
            for bd in [0, *self.decode_buckets]:
                if bd < t:
                    buckets.append(Bucket(t, bd + self.prefill_rows(t, bd), bd))
        return buckets

    def prefill_rows(self, num_tokens: int, num_decode: int) -> int:
        """The prefill rows of a mixed bucket: `max_prefill_rows`, or fewer where the bucket's
        tokens past its decode block cannot feed that many (each row has at least one token):
        a row's state gathers and writes cost its program memory whether it is used or not."""
        return min(self.max_prefill_rows, num_tokens - num_decode)

    def verify_buckets(self) -> list[int]:
        """The decode buckets (rows) that verify steps use: up to `disable_by_batch_size`
        rows (the smallest bucket holding that many), all without it; none without
        speculation."""
        spec = self.speculative
        if spec is None:
            return []
        if spec.disable_by_batch_size is None:
            return list(self.decode_buckets)
        most = min(spec.disable_by_batch_size, self.decode_buckets[-1])
        limit = smallest_fitting(self.decode_buckets, most, "rows")
        return [b for b in self.decode_buckets if b <= limit]

    def speculates(self, rows: list[ScheduledRow]) -> bool:
        """Whether a step of these decode rows (and no prefill) verifies drafts: speculation is
        on, there are at most `disable_by_batch_size` rows, and no request has a grammar (its
        bitmask needs each token before it). Penalties verify: each position counts the drafts
        before it as outputs (`speculative.position_penalties`)."""
        spec = self.speculative
        if spec is None or not rows:
            return False
        if spec.disable_by_batch_size is not None and len(rows) > spec.disable_by_batch_size:
            return False
        if any(row.request.matcher is not None for row in rows):
            return False
        if self._spec_pause > 0:
            self._spec_pause -= 1
            self.spec_paused_steps += 1
            return False
        return True

    def verified(self, accepted: int) -> None:
        """A verify step was read, and its rows kept `accepted` drafts in all. After
        `SPEC_MISSES_TO_PAUSE` verify steps in a row that kept none, decode steps stop
        speculating for `SPEC_PAUSE` steps, a pause that doubles with every verify step after
        it that keeps none (up to `SPEC_PAUSE_MAX`); a kept draft ends it. A workload the
        drafts never match then runs about one verify step in `SPEC_PAUSE_MAX` once the pauses
        have grown (the verify steps cost more than decode steps at large batch)."""
        if accepted > 0:
            self._spec_misses = self._spec_backoff = 0
            return
        self._spec_misses += 1
        if self._spec_misses >= SPEC_MISSES_TO_PAUSE:
            self._spec_backoff = min(max(2 * self._spec_backoff, SPEC_PAUSE), SPEC_PAUSE_MAX)
            self._spec_pause = self._spec_backoff

    def accepted(self, req: Request, extra: int) -> None:
        """A verify step's row kept `extra` tokens more than the one it was counted for: move
        the request's counters on (after the host read them; outside any transaction)."""
        req.num_computed += extra
        req.num_scheduled_outputs += extra

    def use_buckets(self, decode: list[int] | None = None, tokens: list[int] | None = None) -> None:
        """Replace the power-of-two ladders of decode rows and step tokens (fewer compiled
        steps, more padding). Each list is increasing and ends at its limit: max_num_seqs,
        max_num_batched_tokens."""
        cfg = self.config
        for sizes, limit, what in ((decode, cfg.max_num_seqs, "decode"),
                                   (tokens, cfg.max_num_batched_tokens, "token")):  # fmt: skip
            if sizes is None:
                continue
            if sorted(set(sizes)) != list(sizes) or sizes[-1] != limit or sizes[0] <= 0:
                raise ValueError(f"{what} buckets {sizes} must increase from > 0 to {limit}")
        if decode is not None:
            self.decode_buckets = list(decode)
        if tokens is not None:
            self.token_buckets = list(tokens)

    # -- transactions -------------------------------------------------------------------------
    @contextlib.contextmanager
    def transaction(self):
        """Everything changed inside is put back if the block raises."""
        self.undo.begin()
        self._saved = {}
        try:
            yield
        except BaseException:
            self.undo.rollback()
            raise
        self.undo.commit()

    _REQUEST_FIELDS = ("num_computed", "num_scheduled_outputs", "num_cached_tokens", "slot",
                       "init_slot", "pages", "owned_pages", "node_refs", "cached_len",
                       "branch_len", "was_held")  # fmt: skip

    def _save(self, req: Request) -> None:
        """Register how to restore `req`'s scheduling fields (once per transaction)."""
        if not self.undo.active or id(req) in self._saved:
            return
        self._saved[id(req)] = req
        before = _request_fields(req)  # one tuple: cheaper than a dict per row and step
        self.undo.push(lambda: req.__dict__.update(zip(self._REQUEST_FIELDS, before,
                                                       strict=True)))  # fmt: skip

    def transaction_requests(self) -> list[Request]:
        """The requests the open (or last) transaction began to schedule (admitting, forking or
        feeding them): those a `schedule()` that raised was carrying."""
        return list(self._saved.values())

    def pool_split(self) -> dict[str, int]:
        """How the state-slot pool divides: `max_num_seqs` slots for running requests, the
        rest (`EngineConfig.state_slots - max_num_seqs`) for prefix-cache checkpoints."""
        total, running = self.config.state_slots, self.config.max_num_seqs
        checkpoint = total - running if self.prefix_cache is not None else 0
        return {"state_slots": total, "state_slots_running": running,
                "state_slots_checkpoints": checkpoint}  # fmt: skip

    # -- resources ----------------------------------------------------------------------------
    def _take(self, allocator: BlockAllocator, n: int, *, slots: bool) -> list[int] | None:
        if allocator.num_free < n and self.prefix_cache is not None:
            if slots:
                self.prefix_cache.evict(need_slots=n)
            else:
                self.prefix_cache.evict(need_pages=n)
        if allocator.num_free < n:
            return None
        return allocator.allocate(n)

    def _admit(self, req: Request) -> bool:
        self._save(req)
        cache, page_size = self.prefix_cache, self.config.page_size
        match = None
        # The repetition penalty needs every prompt token fed (a hit's are never fed), and
        # prompt_logprobs every prompt token computed (vLLM V1 skips the cache for them too).
        if cache is not None and _cacheable(req):
            match = cache.match(req.prompt_token_ids, req.prompt_len - 1)
            cache.hit(match.path)  # pin before evicting for this request's own needs
        shared = match.pages if match else []
        total = -(-req.max_total_len(self.config.max_model_len) // page_size)
        slot = self._take(self.slots, 1, slots=True)
        own = self._take(self.pages, total - len(shared), slots=False) if slot else None
        if slot is None or own is None:
            if slot:
                self.slots.free(slot)
            if match:
                cache.release(match.path)
            return False
        req.slot = slot[0]
        req.pages = shared + own
        req.owned_pages = set(own)
        if match and match.length:
            req.node_refs = list(match.path)
            req.num_cached_tokens = req.num_computed = req.cached_len = match.length
            req.init_slot = match.slot
        elif match:
            cache.release(match.path)
        if match:
            self._plan_branch(req, match)
        return True

    def _plan_branch(self, req: Request, match) -> None:
        """Choose where besides its chunk ends `req` checkpoints: the deepest block boundary
        its prompt shares with waiting prompts (it leads them: they wait for it), else the
        deepest one the tree has KV for below its state; and count the lookup."""
        peers = self._peer_branch(req, match.length)
        if peers:
            req.branch_len = peers
            key = id(req)
            self.pending_branches[key] = (req, peers, tuple(req.prompt_token_ids[:peers]))
            self.undo.push(lambda: self.pending_branches.pop(key, None))
        elif match.kv_length > match.length:
            req.branch_len = match.kv_length
        partial = match.kv_length > match.length
        self.prefix_cache.count(
            lookups=1,
            hits=match.length > 0,
            partial_hits=partial,
            hit_tokens=match.length,
            query_tokens=req.prompt_len - 1,
            recomputed_tokens=match.kv_length - match.length if partial else 0,
        )

    def _peer_branch(self, req: Request, resume: int) -> int:
        """The block boundary deeper than `resume` that `req` shares with the most waiting
        prompt tokens (length x prompts sharing it), or 0."""
        if not _cacheable(req):
            return 0
        b, mine = self.block_size, req.prompt_token_ids[: req.prompt_len - 1]
        shared = []
        for other in self.waiting:
            if other is req or not _cacheable(other) or other.leader is not None:
                continue
            theirs = other.prompt_token_ids[: other.prompt_len - 1]
            n = aligned_common_prefix(mine, theirs, b, resume)
            if n > resume:
                shared.append(n)
        if not shared:
            return 0
        return max(set(shared), key=lambda d: (d * sum(s >= d for s in shared), d))

    def _adopt_late_arrivals(self) -> None:
        """A waiting request that shares with a running one a prefix that the running one has
        not fed yet (a later chunk of its prompt): the running one checkpoints there too (its
        branch point) and the waiting one is held for it, unless the tree already has as
        deep a state for it."""
        leaders = [r for r in self.running if r.in_prefill and not r.finished and _cacheable(r)
                   and id(r) not in self.pending_branches]  # fmt: skip
        if not leaders or not self.waiting:
            return
        b = self.block_size
        for req in self.waiting:
            if req.leader is not None or not _cacheable(req) or self._held(req):
                continue
            mine, best, depth = req.prompt_token_ids[: req.prompt_len - 1], None, 0
            for lead in leaders:
                if id(lead) in self.pending_branches:
                    continue
                floor = lead.num_computed - lead.num_computed % b
                theirs = lead.prompt_token_ids[: lead.prompt_len - 1]
                d = aligned_common_prefix(mine, theirs, b, floor)
                planned = lead.branch_len if lead.branch_len > lead.num_computed else 0
                if planned:  # it checkpoints there already (a partial hit): wait for that one
                    d = planned if d >= planned else 0
                if d > lead.num_computed and d > depth:
                    best, depth = lead, d
            if best is None or self.prefix_cache.match(mine, len(mine)).length >= depth:
                continue
            self._save(best)
            best.branch_len = depth
            key = id(best)
            self.pending_branches[key] = (best, depth, tuple(mine[:depth]))
            self.undo.push(lambda key=key: self.pending_branches.pop(key, None))

    def _sibling_held(self, req: Request) -> bool:
        """Sample i > 0 of a request waits while sample 0 prefills: it is forked in the step
        that feeds sample 0's last prompt chunk, or, past that step, resumes from the prefix
        cache like any request."""
        lead = req.leader
        if lead is None or lead.finished:
            return False
        return lead.in_prefill or id(lead) in self._prompts_ending

    def _fork_samples(self, lead: Request, row: ScheduledRow, room: int) -> list[ScheduledRow]:
        """Fork `lead`'s waiting samples off `row`, the row that feeds the rest of its prompt
        (at most `room` rows, and MAX_FORKS a step): their zero-token rows follow it."""
        cfg, page = self.config, self.config.page_size
        full = lead.prompt_len // page  # pages the prompt fills: shared, read-only
        shared = lead.pages[:full]
        partial = lead.prompt_len % page != 0
        total = -(-lead.max_total_len(cfg.max_model_len) // page)
        rows = []
        for sib in [r for r in self.waiting if r.leader is lead]:
            if len(rows) >= room or self._forks_left == 0 or len(self.running) >= cfg.max_num_seqs:
                break
            slot = self._take(self.slots, 1, slots=True)
            own = self._take(self.pages, total - full, slots=False) if slot else None
            if own is None:
                if slot:
                    self.slots.free(slot)
                break
            self._save(sib)
            self.pages.share(shared)
            sib.slot, sib.pages, sib.owned_pages = slot[0], shared + own, set(shared) | set(own)
            sib.num_computed = sib.prompt_len
            spec = self._row(sib, [], from_device=False)
            spec.fork, spec.matcher = True, sib.matcher
            sib.num_scheduled_outputs = 1
            self._start(sib)
            row.spec.forks.append(
                (sib.slot, lead.pages[full], own[0]) if partial else (sib.slot, None, None)
            )
            rows.append(ScheduledRow(sib, spec, samples=True))
            self._forks_left -= 1
            self.forked_samples += 1
            self.undo.push(lambda: setattr(self, "forked_samples", self.forked_samples - 1))
        return rows

    def _start(self, req: Request) -> None:
        """Move `req` from the waiting queue to the running list."""
        i = self.waiting.index(req)
        del self.waiting[i]
        self.running.append(req)
        self.undo.push(lambda: (self.running.remove(req), self.waiting.insert(i, req)))

    def _held(self, req: Request) -> bool:
        """A leader is about to checkpoint a prefix of `req`'s prompt: wait for it."""
        for leader, length, prefix in self.pending_branches.values():
            if leader is not req and req.prompt_len > length:
                if tuple(req.prompt_token_ids[:length]) == prefix:
                    return True
        return False

    def _unhold(self, req: Request) -> None:
        req.was_held = False
        self.held_admissions -= 1

    def _drop_branch(self, req: Request) -> None:
        entry = self.pending_branches.pop(id(req), None)
        if entry is not None:
            self.undo.push(lambda: self.pending_branches.__setitem__(id(req), entry))

    def release(self, req: Request) -> None:
        """Return everything a finished request holds."""
        self._drop_branch(req)
        if self.prefix_cache is not None and req.node_refs:
            self.prefix_cache.release(req.node_refs)
        req.node_refs = []
        self.pages.free(sorted(req.owned_pages))
        req.owned_pages = set()
        req.pages = []
        if req.slot is not None:
            self.slots.free([req.slot])
            req.slot = None
        self.running.remove(req)

    def drop_device_state(self) -> list[Request]:
        """The device's cache and slot state are lost (a failed step consumed them): every
        running request lets go of its slot, pages and prefix-cache nodes, the prefix cache
        forgets its checkpoints, and every slot and page is free again (waiting requests hold
        none). Outside any transaction. Returns the requests that were running."""
        running, self.running = self.running, []
        for req in running:
            req.node_refs, req.owned_pages, req.pages, req.slot = [], set(), [], None
        self.pending_branches.clear()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        self.slots.reset()
        self.pages.reset()
        return running

    def record_checkpoint(self, req: Request, length: int, slot: int) -> None:
        """After a step wrote `slot` = state at `length`: hand it to the prefix cache."""
        cache = self.prefix_cache
        _, taken, took_slot = cache.insert(req.all_token_ids, length, req.pages, slot)
        cache.count(
            checkpoints_written=took_slot, branch_checkpoints=took_slot and length == req.branch_len
        )
        if length >= req.branch_len:
            self._drop_branch(req)
        req.owned_pages -= taken
        path = cache.path_to(req.all_token_ids, length)
        held = set(map(id, req.node_refs))
        new = [n for n in path if id(n) not in held]
        cache.acquire(new)
        req.node_refs.extend(new)
        req.cached_len = max(req.cached_len, length)
        if not took_slot:
            self.slots.free([slot])

    # -- rows ---------------------------------------------------------------------------------
    def _row(self, req: Request, tokens: list[int], *, from_device: bool) -> RowSpec:
        p = req.params
        return RowSpec(
            tokens=tokens,
            prefix_len=req.num_computed,
            state_slot=req.slot,
            pages=req.pages,
            init_slot=req.init_slot,
            token_from_device=from_device,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            seed=req.seed,
            sample_counter=req.num_scheduled_outputs,
            min_p=p.min_p,
            min_tokens=p.min_tokens,
            stop_ids=self._min_tokens_stop_ids(p),
            logit_bias=p.logit_bias,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
            prompt_logprob_targets=self._prompt_logprob_targets(req, tokens, from_device),
        )

    @staticmethod
    def _scores_prompt(req: Request) -> bool:
        """Whether the request's prefill tokens are scored for prompt_logprobs (sample 0)."""
        return req.params.prompt_logprobs is not None and req.index == 0

    def _prompt_logprob_targets(self, req: Request, tokens: list[int], from_device: bool):
        """The prompt token after each of a prefill chunk's tokens (sample 0 of a request
        with prompt_logprobs only; shorter at the prompt's end), else None."""
        if from_device or not self._scores_prompt(req):
            return None
        start = req.num_computed + 1
        return req.prompt_token_ids[start : start + len(tokens)]

    def _min_tokens_stop_ids(self, p) -> tuple[int, ...]:
        if p.min_tokens == 0:
            return ()
        eos = () if p.ignore_eos else self.model_cfg.eos_token_ids
        return tuple(dict.fromkeys((*eos, *p.stop_token_ids)))

    def record_dispatched(self, step: ScheduledStep) -> None:
        """Right after a step is dispatched: hand its prompt checkpoints to the tree. The
        device writes them before any later step reads them (each step consumes the cache the
        previous one returned), and their tokens are prompt tokens the host already has, so a
        request held for one is admitted in the very next step."""
        for row in step.rows:
            for slot, length in row.prompt_checkpoints:
                self.record_checkpoint(row.request, length, slot)

    def drop_checkpoint(self, req: Request, slot: int) -> None:
        """A step wrote a checkpoint for a request that has finished since: free its slot."""
        self.slots.free([slot])
        self._drop_branch(req)

    def _maybe_track(self, row: ScheduledRow, length: int) -> bool:
        req = row.request
        if self.prefix_cache is None or length <= req.cached_len or length <= row.spec.prefix_len:
            return False
        if any(n == length for _, n in row.checkpoints):
            return True
        slot = self._take(self.slots, 1, slots=True)
        if slot is None:
            return False  # no room for a checkpoint this time; only a later cache hit is lost
        row.checkpoints.append((slot[0], length))
        row.spec.tracks = list(row.checkpoints)
        return True

    def _schedule_tokens(self, req: Request, n: int, *, from_device: bool) -> ScheduledRow:
        self._save(req)
        start = req.num_computed
        tokens = [0] if from_device else req.prompt_token_ids[start : start + n]
        row = ScheduledRow(req, self._row(req, tokens, from_device=from_device), samples=False)
        end = start + n
        if from_device:
            if self.speculative is not None:
                pass  # the row's true length is the device's: no decode checkpoint
            elif end % self.config.track_interval == 0 and self._decode_checkpoints_left > 0:
                self._maybe_track(row, end)
                self._decode_checkpoints_left -= len(row.checkpoints)
        else:
            if start < req.branch_len <= end and not self._maybe_track(row, req.branch_len):
                self._drop_branch(req)  # no slot for it: the peers stop waiting
            self._maybe_track(row, end - end % self.block_size)
            assert len(row.checkpoints) <= MAX_PREFILL_CHECKPOINTS
        req.num_computed = end
        req.init_slot = None
        if end >= req.prompt_len:
            row.samples = True
            row.spec.matcher = req.matcher
            req.num_scheduled_outputs += 1
        return row

    def schedule(self) -> ScheduledStep | None:
        cfg = self.config
        limit = cfg.max_model_len
        decode = [
            r for r in self.running if not (r.in_prefill or r.finished or r.done_scheduling(limit))
        ]
        self._decode_checkpoints_left = MAX_DECODE_CHECKPOINTS  # past that, rows skip a checkpoint
        rows = [self._schedule_tokens(r, 1, from_device=True) for r in decode]
        bd = smallest_fitting([0, *self.decode_buckets], len(rows), "decode rows")
        budget = cfg.max_num_batched_tokens - bd
        max_prefill = self.max_prefill_rows
        self._forks_left = MAX_FORKS
        self._prompts_ending: set[int] = set()  # requests whose prompt ends in this step
        prefill: list[ScheduledRow] = []
        scored_left = MAX_PROMPT_LOGPROB_TOKENS  # prompt tokens this step scores

        def feed(req: Request) -> int:
            nonlocal scored_left
            n = min(budget, req.prompt_len - req.num_computed)
            if id(req) in self.pending_branches and req.num_computed < req.branch_len:
                # Others wait for its branch point: the chunk ends there, so the step they
                # wait for is no longer than it must be (the rest comes with theirs).
                n = min(n, req.branch_len - req.num_computed)
            if self._scores_prompt(req):
                n = min(n, scored_left)
                scored_left -= n
            row = self._schedule_tokens(req, n, from_device=False)
            prefill.append(row)
            prompt_ends = row.samples and req.num_scheduled_outputs == 1
            if prompt_ends and req.index == 0 and req.params.n > 1:
                self._prompts_ending.add(id(req))
                prefill.extend(self._fork_samples(req, row, max_prefill - len(prefill)))
            return n

        if self.prefix_cache is not None:
            self._adopt_late_arrivals()
        for req in [r for r in self.running if r.in_prefill and not r.finished]:
            if budget <= 0 or len(prefill) >= max_prefill:
                break
            if self._scores_prompt(req) and scored_left == 0:
                continue
            budget -= feed(req)
        for req in list(self.waiting):
            if budget <= 0 or len(prefill) >= max_prefill or len(self.running) >= cfg.max_num_seqs:
                break
            if req.slot is not None or self._sibling_held(req) or req.waits_for_grammar:
                continue  # forked above, waiting for sample 0, or for its grammar
            if self._scores_prompt(req) and scored_left == 0:
                continue  # admitted once a step has prompt tokens to score left
            if self.pending_branches and self._held(req):
                if not req.was_held:  # not `_save`d: a held request is not in the step
                    req.was_held = True
                    self.held_admissions += 1
                    self.undo.push(lambda req=req: self._unhold(req))
                continue
            if not self._admit(req):
                break
            self._start(req)
            budget -= feed(req)
        if not rows and not prefill:
            return None
        if not prefill:
            b = smallest_fitting(self.decode_buckets, len(rows), "decode rows")
            if self.speculates(rows):
                k = self.speculative.num_speculative_tokens
                for r in rows:
                    r.spec.tokens = [0] * (1 + k)  # the last token and k drafts, on device
                return ScheduledStep(rows, Bucket(b * (1 + k), b, b), len(rows))
            return ScheduledStep(rows, Bucket(b, b, b), len(rows))
        num_tokens = bd + sum(len(r.spec.tokens) for r in prefill)
        t = smallest_fitting(self.token_buckets, num_tokens, "step tokens")
        if bd >= t:  # keep at least one prefill token slot past the decode block
            t = smallest_fitting(self.token_buckets, bd + 1, "step tokens")
        bucket = Bucket(t, bd + self.prefill_rows(t, bd), bd)
        return ScheduledStep(rows + prefill, bucket, len(rows))


_request_fields = operator.attrgetter(*Scheduler._REQUEST_FIELDS)


def _cacheable(req: Request) -> bool:
    """The prefix cache serves it: the repetition penalty needs every prompt token fed, and
    prompt_logprobs every prompt token computed."""
    return req.params.repetition_penalty == 1.0 and req.params.prompt_logprobs is None


def aligned_common_prefix(a: list[int], b: list[int], block: int, floor: int = 0) -> int:
    """The longest common prefix of `a` and `b` in whole blocks; 0 unless deeper than `floor`
    (a block multiple). Compares block slices, so it runs at C speed."""
    n = min(len(a), len(b)) // block * block
    first = floor + block
    if n < first or a[:first] != b[:first]:
        return 0
    length = first
    while length + block <= n and a[length : length + block] == b[length : length + block]:
        length += block
    return length


def slot_cost_in_pages(cfg: ModelConfig, page_size: int) -> float:
    """What one state slot holds against one KV page (fp32 SSM state, 2-byte activations):
    the weight of a checkpoint in the prefix cache's eviction."""
    conv, state = cfg.slot_state_elements()
    page = 2 * page_size * cfg.num_key_value_heads * cfg.head_dim * 2
    return (state * 4 + conv * 2) / max(cfg.num_attention_layers * page, 1)
