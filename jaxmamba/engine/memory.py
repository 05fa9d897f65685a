"""Sizing the state cache from memory, as vLLM's `gpu_memory_utilization` does (host side).

The cache gets what is left of `gpu_memory_utilization` × the device's memory after the
weights and the temporaries of the hungriest program the engine can run:

    budget = utilization × limit − in use (the weights, already on device) − temporaries

`temporaries` is XLA's memory analysis of every program (each bucket's step with its sampler
programs, `fork_fn`, `score_fn`), compiled at the planned cache's shapes before the cache is
allocated (`jaxmamba.llm._fit_every_program`): a program may copy a cache array, so what it
needs can grow with the cache, and the plan is made again until every program fits beside
it. A configuration whose programs do not fit beside the smallest cache is refused, naming
the setting and the largest value that fits.

* GPU/TPU: `limit` and `in use` are `device.memory_stats()`'s `bytes_limit` and
  `bytes_in_use`. On GPU `bytes_limit` is JAX's allocator pool, by default 75 % of the GPU
  (`XLA_PYTHON_CLIENT_MEM_FRACTION`), so the utilization is a fraction of that pool.
* CPU (`memory_stats()` is None): the host's memory is shared with everything else on it, so
  nothing is sized from it by default: the default sizes (every row at `max_model_len`, twice
  that with prefix caching) are checked against `utilization × MemAvailable` (/proc/meminfo,
  read after the weights are loaded) and a request that does not fit is an error. Pass
  `kv_cache_memory_bytes` to size the cache from a budget of your own on any device.

The budget is split (`plan_cache`) in this order: a state slot for each of `max_num_seqs`
running rows; KV pages for `max_num_seqs` sequences at `max_model_len` (fewer if they do not
fit: then at least one sequence at `max_model_len` must); with prefix caching, the rest goes
to checkpoint slots, each with the pages of one `track_interval` of tokens (a cached prefix
holds one checkpoint per interval, and its KV spans that interval), and what is left over
to more pages. Explicit `num_state_slots`/`num_pages` are taken as they are and checked.

A state slot holds every recurrent layer's state (in `mamba_ssm_cache_dtype`) and conv
window plus the sampler's per-slot state (the last token, the prompt-token mask and the
output counts of `[V]` each); a page holds K and V of `page_size` tokens in every attention
layer. One more of each is the pad sink.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jaxmamba.config import ModelConfig
from jaxmamba.step_contract import MAX_PROMPT_LOGPROB_TOKENS

GiB = 1 << 30
MiB = 1 << 20


def fmt_bytes(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.2f} MiB"


def slot_bytes(cfg: ModelConfig, act_itemsize: int, ssm_itemsize: int) -> int:
    """Bytes of one state slot: the recurrent state (SSM `[H, P, N]` or delta-rule
    `[HV, Dk, Dv]`, of `ssm_itemsize` bytes: `mamba_ssm_cache_dtype`) and conv window (of the
    activation dtype) of every recurrent layer, and the sampler's last token (i32), prompt
    mask (bool[V]) and output counts (i32[V])."""
    conv, state = cfg.slot_state_elements()
    sampler = 4 + cfg.vocab_size * (1 + 4)
    return state * ssm_itemsize + conv * act_itemsize + sampler


def fixed_bytes(cfg: ModelConfig, act_itemsize: int) -> int:
    """Bytes the runner holds whatever the sizes: the hidden states a prefill step keeps for
    prompt_logprobs (`SlotState.prompt_hidden`, whole on every device under TP)."""
    return MAX_PROMPT_LOGPROB_TOKENS * cfg.hidden_size * act_itemsize


def page_bytes(cfg: ModelConfig, page_size: int, act_itemsize: int) -> int:
    """Bytes of one KV page: K and V `[page_size, Hkv, Dh]` in every attention layer."""
    per_layer = 2 * page_size * cfg.num_key_value_heads * cfg.head_dim * act_itemsize
    return cfg.num_attention_layers * per_layer


def cache_budget(*, limit: int, in_use: int, utilization: float, temporaries: int) -> int:
    """Bytes left for the cache: `utilization × limit − in_use − temporaries` (may be < 0)."""
    return int(utilization * limit) - in_use - temporaries


def host_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """The host's MemAvailable in bytes, None where /proc/meminfo has none."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass(frozen=True)
class DeviceMemory:
    """What the budget is computed from; `source` says where `limit` came from."""

    limit: int
    in_use: int
    source: str  # "memory_stats" | "MemAvailable" | "kv_cache_memory_bytes"


def device_memory(device) -> DeviceMemory | None:
    """`bytes_limit`/`bytes_in_use` of a GPU/TPU device; the host's MemAvailable (nothing in
    use counted: the weights are already out of it) on CPU; None when neither is known."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return DeviceMemory(int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0)),
                            "memory_stats")  # fmt: skip
    available = host_available_bytes()
    if available is None:
        return None
    return DeviceMemory(available, 0, "MemAvailable")


@dataclass(frozen=True)
class CachePlan:
    """How many state slots and KV pages the cache has, and why."""

    state_slots: int  # all of them: max_num_seqs running rows + checkpoint slots
    pages: int
    max_num_seqs: int
    max_pages_per_seq: int
    page_size: int
    per_slot: int
    per_page: int
    budget: int | None  # bytes for the cache (None: not sized from memory)
    note: str = ""  # where the budget came from
    fixed: int = 0  # bytes beside the slots and pages (`fixed_bytes`)

    @property
    def checkpoint_slots(self) -> int:
        return self.state_slots - self.max_num_seqs

    @property
    def max_concurrency(self) -> int:
        """Sequences at max_model_len the pages hold at once (may exceed max_num_seqs)."""
        return self.pages // self.max_pages_per_seq

    @property
    def cache_bytes(self) -> int:
        """Including the pad slot and page, and the fixed bytes."""
        slots_and_pages = (self.state_slots + 1) * self.per_slot + (self.pages + 1) * self.per_page
        return slots_and_pages + self.fixed

    def describe(self) -> str:
        max_len = self.max_pages_per_seq * self.page_size
        budget = "" if self.budget is None else f" of a {fmt_bytes(self.budget)} budget"
        note = f"{self.note}; " if self.note else ""
        return note + (
            f"cache: {self.state_slots} state slots ({self.max_num_seqs} running + "
            f"{self.checkpoint_slots} prefix-cache checkpoints) of {self.per_slot / MiB:.2f} MiB, "
            f"{self.pages} KV pages of {self.per_page / MiB:.3f} MiB "
            f"({self.page_size} tokens); {fmt_bytes(self.cache_bytes)}{budget}; "
            f"max concurrency at max_model_len={max_len}: {self.max_concurrency} sequences "
            f"(max_num_seqs={self.max_num_seqs})"
        )


def default_sizes(
    max_num_seqs: int, max_pages_per_seq: int, prefix_caching: bool
) -> tuple[int, int]:
    """Sizes not taken from memory: every row at max_model_len, twice that with caching."""
    factor = 2 if prefix_caching else 1
    return max_num_seqs * factor, max_num_seqs * max_pages_per_seq * factor


def plan_cache(
    *,
    budget: int | None,
    per_slot: int,
    per_page: int,
    max_num_seqs: int,
    max_pages_per_seq: int,
    page_size: int,
    pages_per_checkpoint: int,
    prefix_caching: bool,
    num_state_slots: int | None = None,
    num_pages: int | None = None,
    budget_what: str = "the cache budget",
    hint: str = "raise gpu_memory_utilization or free device memory",
    fixed: int = 0,
) -> CachePlan:
    """Slots and pages within `budget` bytes (see the module docstring for the split).

    `budget=None`: no sizing from memory; missing sizes take `default_sizes`. Otherwise every
    size is checked, and a request for more than fits is a ValueError that says how much
    does."""
    plan = lambda s, p: CachePlan(  # noqa: E731
        s, p, max_num_seqs, max_pages_per_seq, page_size, per_slot, per_page, budget,
        fixed=fixed,
    )  # fmt: skip
    max_len = max_pages_per_seq * page_size
    if num_state_slots is not None and num_state_slots < max_num_seqs:
        raise ValueError(f"num_state_slots={num_state_slots} < max_num_seqs={max_num_seqs}")
    if num_pages is not None and num_pages < max_pages_per_seq:
        raise ValueError(
            f"num_pages={num_pages} cannot hold one max_model_len={max_len} sequence "
            f"({max_pages_per_seq} pages of {page_size} tokens)"
        )
    if budget is None:
        slots, pages = default_sizes(max_num_seqs, max_pages_per_seq, prefix_caching)
        return plan(num_state_slots or slots, num_pages or pages)

    free = budget - fixed - per_slot - per_page  # the fixed bytes, the pad slot and page
    gib = fmt_bytes
    where = f"{budget_what} of {gib(budget)}"
    # The minimum: every running row's slot and one sequence at max_model_len.
    slots_min = max_num_seqs if num_state_slots is None else num_state_slots
    pages_min = max_pages_per_seq if num_pages is None else num_pages
    need = slots_min * per_slot + pages_min * per_page
    if need > free:
        fit_slots = max((free - pages_min * per_page) // per_slot, 0)  # beside pages_min
        fit_pages = max((free - slots_min * per_slot) // max(per_page, 1), 0)  # beside slots_min
        if num_state_slots is not None and num_pages is not None:
            detail = (
                f"num_state_slots={num_state_slots} and num_pages={num_pages} need {gib(need)}, "
                f"more than {where}: with {num_state_slots} slots at most {fit_pages} pages "
                f"fit, with {num_pages} pages at most {fit_slots} slots"
            )
        elif num_state_slots is not None:
            detail = (
                f"num_state_slots={num_state_slots} and one max_model_len={max_len} sequence "
                f"need {gib(need)}, more than {where}: at most {fit_slots} state slots fit"
            )
        elif num_pages is not None:
            detail = (
                f"num_pages={num_pages} and max_num_seqs={max_num_seqs} state slots need "
                f"{gib(need)}, more than {where}: at most {fit_pages} pages fit"
            )
        else:
            detail = (
                f"max_num_seqs={max_num_seqs} state slots ({gib(slots_min * per_slot)}) and one "
                f"sequence at max_model_len={max_len} ({max_pages_per_seq} KV pages, "
                f"{gib(pages_min * per_page)}) need {gib(need)}, more than {where}: with "
                f"{max_num_seqs} slots at most max_model_len={fit_pages * page_size} fits; at "
                f"max_model_len={max_len} at most max_num_seqs={fit_slots}"
            )
        raise ValueError(f"{detail} (or {hint})")
    if num_state_slots is not None and num_pages is not None:
        return plan(num_state_slots, num_pages)
    full_pages = max_num_seqs * max_pages_per_seq  # every running row at max_model_len
    if per_page == 0:  # no attention layer: a page is only a block-table entry, free
        slots = num_state_slots or (free // per_slot if prefix_caching else max_num_seqs)
        # Every running row at max_model_len, and each checkpoint's pages.
        pages = full_pages + (slots - max_num_seqs) * pages_per_checkpoint
        return plan(slots, num_pages or pages)
    if num_state_slots is not None:
        pages = (free - num_state_slots * per_slot) // per_page
        return plan(num_state_slots, pages if prefix_caching else min(pages, full_pages))
    if num_pages is not None:
        slots = (free - num_pages * per_page) // per_slot
        return plan(slots if prefix_caching else max_num_seqs, num_pages)
    pages = min(full_pages, (free - max_num_seqs * per_slot) // per_page)
    rest = free - max_num_seqs * per_slot - pages * per_page
    if not prefix_caching or pages < full_pages:
        return plan(max_num_seqs, pages)
    unit = per_slot + pages_per_checkpoint * per_page
    checkpoints = rest // unit
    extra_pages = checkpoints * pages_per_checkpoint + (rest - checkpoints * unit) // per_page
    return plan(max_num_seqs + checkpoints, pages + extra_pages)


def pages_per_checkpoint(track_interval: int, page_size: int) -> int:
    return math.ceil(track_interval / page_size)
