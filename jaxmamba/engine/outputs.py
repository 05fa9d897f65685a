"""What the engine returns, with vLLM's names: `RequestOutput` holding one `CompletionOutput`
per sample (`SamplingParams.n` of them), each token's logprobs as `Logprob`s.

`LLMEngine.step()` returns deltas (the tokens and text new since the previous step);
`RequestOutput.add` folds a delta into the output so far, which is how `LLM.generate` builds
its final outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token; None when outside the returned top-k
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str | None  # None when the model has no tokenizer
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: CompletionOutput) -> None:
        if self.text is not None and delta.text is not None:
            self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if self.logprobs is not None and delta.logprobs is not None:
            self.logprobs.extend(delta.logprobs)
        self.cumulative_logprob = delta.cumulative_logprob
        self.finish_reason = delta.finish_reason
        self.stop_reason = delta.stop_reason


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: None for the first prompt token, then per prompt token
    # {token_id: Logprob} of that token and the top-k (in the first output of a stream)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Why the request failed (a step that carried it raised; its unfinished samples end with
    # finish_reason "error"); None otherwise.
    error: str | None = None

    def add(self, delta: RequestOutput) -> None:
        """Fold the next step's delta for this request into this output."""
        by_index = {c.index: c for c in self.outputs}
        for c in delta.outputs:
            if c.index in by_index:
                by_index[c.index].add(c)
            else:
                by_index[c.index] = CompletionOutput(
                    c.index, c.text, list(c.token_ids), c.cumulative_logprob,
                    None if c.logprobs is None else list(c.logprobs),
                    c.finish_reason, c.stop_reason,
                )  # fmt: skip
        self.outputs = [by_index[i] for i in sorted(by_index)]
        self.finished = delta.finished
        self.num_cached_tokens = delta.num_cached_tokens
        self.metrics = delta.metrics
        self.error = delta.error
