"""Requests and their sampling parameters: host-side state, no device access."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jaxmamba.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxmamba.structured.matcher import GrammarMatcher

__all__ = ["Request", "SamplingParams"]


@dataclass(eq=False)
class Request:
    """One sequence through the engine: sample `index` of request `request_id` (a request with
    `n` samples is `n` of these, each with its own seed).

    Counters run ahead of what the host has read: `num_computed` and `num_scheduled_outputs`
    count what dispatched steps will have done, so the next step can be scheduled before the
    previous one's tokens are back (overlap). `output_token_ids` holds the tokens read so far.

    Structured outputs: `grammar` is the compile of `params.structured_outputs` under way or
    done; once it is done the engine gives the request its `matcher`, which has accepted every
    token of `output_token_ids`. Until then the request waits in the queue.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    index: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict] = field(default_factory=list)  # one {id: Logprob} per token
    cumulative_logprob: float = 0.0
    num_computed: int = 0  # tokens fed to dispatched steps (their state/KV is in the cache)
    num_scheduled_outputs: int = 0  # tokens that dispatched steps will sample for it
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    slot: int | None = None  # working state slot
    init_slot: int | None = None  # prefix-cache checkpoint read by the first step
    pages: list[int] = field(default_factory=list)  # page table (shared prefix pages first)
    owned_pages: set[int] = field(default_factory=set)  # pages freed when the request ends
    node_refs: list = field(default_factory=list)  # prefix-cache nodes it holds
    cached_len: int = 0  # length of the deepest prefix it has in the cache tree
    branch_len: int = 0  # > 0: its prefill also checkpoints here (where prompts branch)
    was_held: bool = False  # it waited for another request's branch checkpoint
    leader: Request | None = None  # sample 0 of its request (samples i > 0 fork off it)
    grammar: Future | None = None  # its compiled grammar, to come (None: unconstrained)
    matcher: GrammarMatcher | None = None  # its place in the grammar, once compiled
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def waits_for_grammar(self) -> bool:
        """Its grammar is still compiling: it is not admitted yet."""
        return self.grammar is not None and self.matcher is None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def max_total_len(self, max_model_len: int) -> int:
        if self.params.max_tokens is None:
            return max_model_len
        return min(self.prompt_len + self.params.max_tokens, max_model_len)

    def done_scheduling(self, max_model_len: int) -> bool:
        """Every token it may still produce is already in a dispatched step."""
        if self.in_prefill:
            return False
        return self.prompt_len + self.num_scheduled_outputs >= self.max_total_len(max_model_len)

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {"num_cached_tokens": float(self.num_cached_tokens)}
        if self.first_token_time is not None:
            out["ttft_s"] = self.first_token_time - self.arrival_time
        n = len(self.output_token_ids)
        if self.finish_time is not None and self.first_token_time is not None and n > 1:
            out["decode_s_per_token"] = (self.finish_time - self.first_token_time) / (n - 1)
        if self.finish_time is not None:
            out["e2e_s"] = self.finish_time - self.arrival_time
        return out
