"""The user-facing generation API, shaped like vLLM's `LLM`.

from jaxmamba import LLM, SamplingParams
llm = LLM("nemotron-h-tiny", max_num_seqs=8)
out = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
print(out[0].outputs[0].text)
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from jaxmamba.config import ModelConfig, checkpoint_dir
from jaxmamba.engine.config import EngineConfig
from jaxmamba.engine.engine import LLMEngine
from jaxmamba.engine.outputs import CompletionOutput, Logprob, RequestOutput
from jaxmamba.inputs import parse_prompts
from jaxmamba.model.cache import CacheSpec
from jaxmamba.sampling_params import SamplingParams
from jaxmamba.tokenizer import Tokenizer, load_tokenizer

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": jnp.float32,
    "fp32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
}

# A checkpoint's `torch_dtype` → the compute dtype of dtype="auto". The engine has no float16
# path, so float16 checkpoints run in bfloat16 (same width, wider exponent).
_AUTO_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "bfloat16"}


def resolve_dtype(dtype: str, model: str) -> str:
    """The dtype name for `dtype`; "auto" is the checkpoint's `torch_dtype` (float32 when it
    names none), and float32 for random-weight presets."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
        return dtype
    path = checkpoint_dir(model)
    if path is None:
        return "float32"  # random weights: the exact reference dtype
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"  # ModelConfig.load reports the unreadable file
    named = config.get("torch_dtype", config.get("dtype")) if isinstance(config, dict) else None
    if named is None:
        return "float32"
    if named not in _AUTO_DTYPES:
        raise ValueError(
            f"{path / 'config.json'} torch_dtype={named!r} is unsupported: "
            f"expected one of {sorted(_AUTO_DTYPES)}, or pass dtype explicitly"
        )
    if named == "float16":
        logger.info("dtype='auto': the float16 checkpoint %s runs in bfloat16", path)
    return _AUTO_DTYPES[named]


def load_params(model: str, cfg: ModelConfig, dtype, seed: int):
    """An HF checkpoint (a directory or a checkpoint preset) → its weights; a YAML preset or
    file → random weights from `seed`."""
    from jaxmamba.model.params import init_params, param_shapes

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
        dtype: str = "auto",
        max_num_seqs: int = 8,
        max_model_len: int = 2048,
        max_num_batched_tokens: int = 512,
        max_prefill_seqs: int = 8,
        page_size: int = 16,
        enable_prefix_caching: bool = True,
        track_interval: int | None = None,
        num_state_slots: int | None = None,
        num_pages: int | None = None,
        precompile: bool = False,
        seed: int = 0,
        impl: str = "auto",
        params=None,
        compilation_cache: bool = True,
        compilation_cache_dir: str | None = None,
    ):
        from jaxmamba.export.compile_cache import setup_compilation_cache

        setup_compilation_cache(compilation_cache_dir, enabled=compilation_cache)
        from jaxmamba.export.artifact import is_artifact

        if is_artifact(model):  # a `jaxmamba export` directory: runs without the model code
            from jaxmamba.export.serving import init_llm_from_artifact

            engine = dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                          max_num_batched_tokens=max_num_batched_tokens,
                          max_prefill_seqs=max_prefill_seqs, page_size=page_size,
                          enable_prefix_caching=enable_prefix_caching,
                          track_interval=track_interval, num_state_slots=num_state_slots,
                          num_pages=num_pages)  # fmt: skip
            init_llm_from_artifact(
                self, model, seed=seed, params=params, precompile=precompile, engine=engine
            )
            return
        from jaxmamba.engine.runner import ModelRunner

        dtype = resolve_dtype(dtype, model)
        model_cfg = ModelConfig.load(model)
        self.dtype = DTYPES[dtype]
        self.tokenizer = load_tokenizer(model, model_cfg)
        self.model_cfg = _with_tokenizer_eos(model_cfg, self.tokenizer)
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
        ).for_chunk_size(self.model_cfg.chunk_size)
        if params is None:
            params = load_params(model, self.model_cfg, self.dtype, seed)
        spec = CacheSpec(
            num_slots=self.engine_cfg.state_slots,
            num_pages=self.engine_cfg.pages,
            page_size=page_size,
        )
        self.runner = ModelRunner(self.model_cfg, params, spec, dtype=self.dtype, impl=impl)
        self.engine = LLMEngine(
            self.model_cfg, self.runner, self.engine_cfg, tokenizer=self.tokenizer, seed=seed
        )
        if precompile:
            self.engine.precompile()
        self._ids = itertools.count()

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
        parsed = parse_prompts(prompts, prompt_token_ids, self.tokenizer, self.model_cfg.vocab_size)
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

    def get_tokenizer(self) -> Tokenizer | None:
        """The tokenizer prompts are encoded with (None for a model without one)."""
        return self.tokenizer

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate a reply to one conversation (a list of {"role", "content"} dicts) or to
        each of a list of them, rendered with the tokenizer's chat template (or
        `chat_template`) as transformers' `apply_chat_template` renders it."""
        from jaxmamba.chat import render_chat

        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template: use generate")
        if not isinstance(messages, list | tuple) or not messages:
            raise TypeError(f"messages must be a non-empty list of dicts, got {messages!r}")
        conversations = messages if isinstance(messages[0], list | tuple) else [messages]
        texts = [
            render_chat(
                self.tokenizer,
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
            for conversation in conversations
        ]
        # The template writes the specials itself: encode without adding them again.
        prompts = [
            {"prompt_token_ids": self.tokenizer.encode(t, add_special_tokens=False)} for t in texts
        ]
        outputs = self.generate(prompts, sampling_params)
        for out, text in zip(outputs, texts, strict=True):
            out.prompt = text
        return outputs

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix that no running request uses."""
        cache = self.engine.scheduler.prefix_cache
        if cache is not None:
            cache.reset()

    def stats(self) -> dict[str, float]:
        """Engine counters: steps, tokens, device reads, compilations, free slots/pages, hits."""
        return self.engine.counters()


def _with_tokenizer_eos(cfg: ModelConfig, tokenizer: Tokenizer | None) -> ModelConfig:
    """`cfg` whose stop ids include the tokenizer's eos, as vLLM's do."""
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    if eos is None or eos in cfg.eos_token_ids or not 0 <= eos < cfg.vocab_size:
        return cfg
    return dataclasses.replace(cfg, eos_token_ids=(*cfg.eos_token_ids, eos))


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
