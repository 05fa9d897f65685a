"""The user-facing generation API, shaped like vLLM's `LLM`.

from jaxmamba import LLM, SamplingParams
llm = LLM("nemotron-h-tiny", max_num_seqs=8)
out = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
print(out[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence

import jax.numpy as jnp

from jaxmamba.config import ModelConfig, checkpoint_dir
from jaxmamba.engine.engine import LLMEngine
from jaxmamba.engine.outputs import CompletionOutput, Logprob, RequestOutput
from jaxmamba.engine.runner import ModelRunner
from jaxmamba.engine.scheduler import EngineConfig
from jaxmamba.model.cache import CacheSpec
from jaxmamba.model.params import init_params, param_shapes
from jaxmamba.sampling_params import SamplingParams
from jaxmamba.tokenizer import load_tokenizer

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]

DTYPES = {
    "float32": jnp.float32,
    "fp32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
}


def load_params(model: str, cfg: ModelConfig, dtype, seed: int):
    """An HF checkpoint (a directory or a checkpoint preset) → its weights; a YAML preset or
    file → random weights from `seed`."""
    path = checkpoint_dir(model)
    if path is not None:
        from jaxmamba.model.loader import load_hf_checkpoint

        return load_hf_checkpoint(path, cfg, dtype=dtype, expected=param_shapes(cfg, dtype))
    return init_params(cfg, dtype, seed)


class LLM:
    def __init__(
        self,
        model: str,
        *,
        dtype: str = "float32",
        max_num_seqs: int = 8,
        max_model_len: int = 2048,
        max_num_batched_tokens: int = 512,
        max_prefill_seqs: int = 8,
        page_size: int = 16,
        enable_prefix_caching: bool = True,
        track_interval: int = 256,
        num_state_slots: int | None = None,
        num_pages: int | None = None,
        precompile: bool = False,
        seed: int = 0,
        impl: str = "auto",
        params=None,
    ):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.model_cfg = ModelConfig.load(model)
        self.dtype = DTYPES[dtype]
        self.engine_cfg = EngineConfig(
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            max_prefill_seqs=max_prefill_seqs,
            page_size=page_size,
            enable_prefix_caching=enable_prefix_caching,
            track_interval=track_interval,
            num_state_slots=num_state_slots,
            num_pages=num_pages,
        )
        if params is None:
            params = load_params(model, self.model_cfg, self.dtype, seed)
        spec = CacheSpec(
            num_slots=self.engine_cfg.state_slots,
            num_pages=self.engine_cfg.pages,
            page_size=page_size,
        )
        self.runner = ModelRunner(self.model_cfg, params, spec, dtype=self.dtype, impl=impl)
        self.tokenizer = load_tokenizer(model, self.model_cfg)
        self.engine = LLMEngine(
            self.model_cfg, self.runner, self.engine_cfg, tokenizer=self.tokenizer, seed=seed
        )
        if precompile:
            self.engine.precompile()
        self._ids = itertools.count()

    def _prompt_ids(self, prompts, prompt_token_ids) -> tuple[list[str | None], list[list[int]]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            if isinstance(prompts, str):
                prompts = [prompts]
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt_token_ids instead")
            return list(prompts), [self.tokenizer.encode(p) for p in prompts]
        if prompt_token_ids and isinstance(prompt_token_ids[0], int):
            prompt_token_ids = [prompt_token_ids]
        ids = [[int(t) for t in p] for p in prompt_token_ids]
        return [None] * len(ids), ids

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | Sequence[int] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate a completion for every prompt; outputs come back in prompt order.
        `use_tqdm` shows a progress bar (tqdm's if installed, else a plain counter)."""
        texts, token_id_lists = self._prompt_ids(prompts, prompt_token_ids)
        parsed = list(zip(texts, token_id_lists, strict=True))
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(parsed)
        if len(sampling_params) != len(parsed):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(parsed)} prompts")
        engine = self.engine
        for i, (_, token_ids) in enumerate(parsed):
            try:
                engine.check_prompt(token_ids)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from e
        ids = [str(next(self._ids)) for _ in parsed]
        outputs: dict[str, RequestOutput] = {}
        progress = None
        try:
            for rid, (text, token_ids), sp in zip(ids, parsed, sampling_params, strict=True):
                engine.add_request(rid, {"prompt": text, "prompt_token_ids": token_ids}, sp)
            progress = _progress(len(ids)) if use_tqdm else None
            while engine.has_unfinished_requests():
                for delta in engine.step():
                    if delta.request_id in outputs:
                        outputs[delta.request_id].add(delta)
                    else:
                        outputs[delta.request_id] = delta
                    if delta.finished and progress is not None:
                        progress.update(1)
        except BaseException:
            for rid in ids:
                engine.abort_request(rid)
            if not engine.get_num_unfinished_requests():
                engine.abort_all()  # also waits for the step in flight and frees its slots
            raise
        finally:
            if progress is not None:
                progress.close()
        return [outputs[rid] for rid in ids]

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix that no running request uses."""
        cache = self.engine.scheduler.prefix_cache
        if cache is not None:
            cache.reset()

    def stats(self) -> dict[str, float]:
        """Engine counters: steps, tokens, device reads, compilations, free slots/pages, hits."""
        return self.engine.counters()


class _Counter:
    """The progress display when tqdm is not installed."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        self._show()

    def update(self, n: int) -> None:
        self.done += n
        self._show()

    def close(self) -> None:
        sys.stderr.write("\n")

    def _show(self) -> None:
        sys.stderr.write(f"\rprocessed prompts: {self.done}/{self.total}")
        sys.stderr.flush()


def _progress(total: int):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _Counter(total)
    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
