"""The user-facing generation API, shaped like vLLM's `LLM`.

from jaxmamba import LLM, SamplingParams
llm = LLM("nemotron-h-tiny", max_num_seqs=8)
out = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
print(out[0].outputs[0].text)
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import itertools
import logging
import sys
import typing
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp

from jaxmamba.config import ModelConfig
from jaxmamba.engine.config import EngineConfig, RunConfig
from jaxmamba.engine.engine import LLMEngine
from jaxmamba.engine.outputs import CompletionOutput, Logprob, RequestOutput
from jaxmamba.inputs import parse_prompts
from jaxmamba.model.cache import CacheSpec
from jaxmamba.model.dtypes import DTYPES, resolve_dtype
from jaxmamba.model.families import load_config
from jaxmamba.model.weights import load_params
from jaxmamba.sampling_params import SamplingParams
from jaxmamba.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer,
    with_tokenizer_eos,
)

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]

logger = logging.getLogger(__name__)


def _load_params_for(model: str, cfg: ModelConfig, dtype, seed: int, tensor_parallel_size: int,
                     quantization: str | None = None, *, split: bool = True):  # fmt: skip
    """`load_params` (quantized as `quantization` says); for a sharded model into host memory
    first (the runner splits it onto the mesh, or with `split=False` copies it to every
    device: a draft model), so the whole model never has to fit one device."""
    if tensor_parallel_size == 1:
        return load_params(model, cfg, dtype, seed, quantization)
    import jax

    from jaxmamba.parallel.plan import TensorParallelPlan

    if split:
        TensorParallelPlan(cfg, tensor_parallel_size)  # refuse an impossible split before loading
    try:
        host = jax.local_devices(backend="cpu")[0]  # this process's: several hosts each load
    except RuntimeError:  # no CPU backend (JAX_PLATFORMS names only accelerators)
        return load_params(model, cfg, dtype, seed, quantization)
    with jax.default_device(host):
        return load_params(model, cfg, dtype, seed, quantization)


class LLM:
    """A model and its engine, shaped like vLLM's `LLM`.

    `model`: a preset name, a YAML file, an HF checkpoint directory or an exported artifact.
    Settings are keywords named like the fields of `EngineConfig` and `RunConfig` (each
    field's default and help text are there), over those of `engine_config` when given;
    `params` are weights to use instead of loading them.
    """

    def __init__(
        self,
        model: str,
        *,
        engine_config: EngineConfig | None = None,
        params=None,
        **settings: Any,
    ):
        engine_cfg, run = _settings(engine_config, settings)
        from jaxmamba.export.compile_cache import setup_compilation_cache

        setup_compilation_cache(run.compilation_cache_dir, enabled=run.compilation_cache)
        from jaxmamba.export.artifact import is_artifact

        tensor_parallel_size = engine_cfg.tensor_parallel_size
        sc = engine_cfg.speculative_config
        if sc is not None and sc.method == "mtp" and tensor_parallel_size != 1:
            from jaxmamba.model.mtp import refuse_mtp_under_tp

            raise refuse_mtp_under_tp(tensor_parallel_size)
        if is_artifact(model):  # a `jaxmamba export` directory: runs without the model code
            if tensor_parallel_size != 1:
                raise ValueError(
                    f"tensor_parallel_size={tensor_parallel_size}: exported artifacts hold "
                    f"one-device steps; serve the model itself (not {model}) to run it sharded"
                )
            from jaxmamba.export.serving import serve_artifact

            # An artifact's cache is sized at export: the memory settings do not apply.
            engine = {k: v for k, v in dataclasses.asdict(engine_cfg).items()
                      if k not in ("gpu_memory_utilization", "kv_cache_memory_bytes",
                                   "tensor_parallel_size")}  # fmt: skip
            engine["mamba_ssm_cache_dtype"] = engine_cfg.ssm_dtype
            served = serve_artifact(model, seed=run.seed, params=params,
                                    precompile=run.precompile, engine=engine)  # fmt: skip
            self.artifact, self.runner, self.engine = served.artifact, served.runner, served.engine
            self.model_cfg, self.engine_cfg = served.model_cfg, served.engine_cfg
            self.tokenizer, self.cache_plan, self.dtype = (served.tokenizer, served.cache_plan,
                                                           served.dtype)  # fmt: skip
            self._ids = itertools.count()
            return
        from jaxmamba.engine.runner import ModelRunner

        dtype = resolve_dtype(run.dtype, model)
        model_cfg = load_config(model)
        self.dtype = DTYPES[dtype]
        self.tokenizer = load_tokenizer(model, model_cfg)
        self.model_cfg = with_tokenizer_eos(model_cfg, self.tokenizer)
        self.engine_cfg = engine_cfg.for_chunk_size(self.model_cfg.chunk_size)
        if params is None:
            params = _load_params_for(model, self.model_cfg, self.dtype, run.seed,
                                      tensor_parallel_size, run.quantization)  # fmt: skip
        draft = load_draft(self.engine_cfg, self.model_cfg, self.dtype, run, model)
        self.cache_plan = size_cache(self.model_cfg, self.engine_cfg, params, self.dtype, run.impl,
                                     draft=draft)  # fmt: skip
        self.engine_cfg = dataclasses.replace(
            self.engine_cfg,
            num_state_slots=self.cache_plan.state_slots,
            num_pages=self.cache_plan.pages,
        )
        spec = CacheSpec(
            num_slots=self.engine_cfg.state_slots,
            num_pages=self.engine_cfg.pages,
            page_size=self.engine_cfg.page_size,
            ssm_dtype=self.engine_cfg.ssm_dtype,
            kv_dtype=self.engine_cfg.kv_cache_dtype,
        )
        self.runner = ModelRunner(
            self.model_cfg, params, spec, dtype=self.dtype, impl=run.impl,
            tensor_parallel_size=tensor_parallel_size,
            speculative=speculative_spec(self.engine_cfg, draft),
            draft_params=None if draft is None else draft.params,
        )  # fmt: skip
        if tensor_parallel_size > 1:  # several processes: process 0 sends every step
            from jaxmamba.parallel.multihost import leader

            self.runner = leader(self.runner)
        self.engine = LLMEngine(
            self.model_cfg, self.runner, self.engine_cfg, tokenizer=self.tokenizer, seed=run.seed
        )
        if run.precompile:
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
        `use_tqdm` shows a progress bar (tqdm's if installed, else a plain counter). A request
        whose step failed comes back finished, with `finish_reason="error"` on its unfinished
        samples and `RequestOutput.error` saying why (the engine logs the failure); the others,
        and the `LLM`, go on. A `structured_outputs` constraint the engine cannot enforce (a
        malformed or unsatisfiable schema, a bad regex, a keyword it does not implement) is a
        ValueError naming it, before anything runs."""
        parsed = parse_prompts(prompts, prompt_token_ids, self.tokenizer, self.model_cfg.vocab_size)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(parsed)
        if len(sampling_params) != len(parsed):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(parsed)} prompts")
        engine = self.engine
        for i, ((_, token_ids), sp) in enumerate(zip(parsed, sampling_params, strict=True)):
            try:
                engine.check_prompt(token_ids)
                constraint = sp.structured_outputs
                if constraint is not None:  # compiled once per constraint, and cached
                    engine.compile_grammar(constraint).result()
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

    def get_tokenizer(self) -> HFTokenizer | ByteTokenizer | None:
        """The tokenizer prompts are encoded with (None for a model without one), with
        transformers' methods (`__call__`, `batch_decode`, `apply_chat_template`, ...)."""
        return self.tokenizer

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate a reply to one conversation (a list of {"role", "content"} dicts) or to
        each of a list of them, rendered with the tokenizer's chat template (or
        `chat_template`) as transformers' `apply_chat_template` renders it. `use_tqdm` shows
        a progress bar, as in `generate`."""
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
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
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


def _settings(engine_config: EngineConfig | None, settings: dict) -> tuple[EngineConfig, RunConfig]:
    """`LLM`'s keyword settings split into the two configs; a name that is no field of
    either is a TypeError naming the valid ones."""
    engine_names = {f.name for f in dataclasses.fields(EngineConfig)}
    run_names = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = sorted(set(settings) - engine_names - run_names)
    if unknown:
        close = difflib.get_close_matches(unknown[0], engine_names | run_names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(
            f"LLM() got unexpected keyword argument(s) {unknown}{hint}: it takes model, "
            f"engine_config, params and the settings {sorted(run_names)} (RunConfig) and "
            f"{sorted(engine_names)} (EngineConfig)"
        )
    if engine_config is not None and not isinstance(engine_config, EngineConfig):
        raise TypeError(
            f"engine_config must be an EngineConfig, got {type(engine_config).__name__}"
        )
    engine = {k: v for k, v in settings.items() if k in engine_names}
    engine_cfg = dataclasses.replace(engine_config or EngineConfig(), **engine)
    run = RunConfig(**{k: v for k, v in settings.items() if k in run_names})
    return engine_cfg, run


def _init_signature() -> inspect.Signature:
    """`LLM.__init__`'s signature with every setting as a keyword and its default, for
    `help(LLM)` and editors."""
    P = inspect.Parameter
    params = [
        P("self", P.POSITIONAL_OR_KEYWORD),
        P("model", P.POSITIONAL_OR_KEYWORD, annotation=str),
        P("engine_config", P.KEYWORD_ONLY, default=None, annotation=EngineConfig | None),
        P("params", P.KEYWORD_ONLY, default=None),
    ]
    for cls in (RunConfig, EngineConfig):
        hints = typing.get_type_hints(cls)
        params += [P(f.name, P.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
                   for f in dataclasses.fields(cls)]  # fmt: skip
    return inspect.Signature(params)


LLM.__init__.__signature__ = _init_signature()


def size_cache(model_cfg: ModelConfig, cfg: EngineConfig, params, dtype, impl: str = "auto", *,
               draft: Draft | None = None):  # fmt: skip
    """The cache's slots and pages (`memory.CachePlan`), sized as jaxmamba/engine/memory.py
    says, and logged. GPU/TPU: from the device's memory after the weights (in use) and the
    temporaries of the hungriest program, every program compiled at the planned cache's
    shapes (`_fit_every_program`); CPU: the given or default sizes, checked against the
    host's MemAvailable. A draft model's (`draft`) states and KV pages share the target's
    slots and pages, so each slot and page holds both (under tensor parallelism, the target's
    shard and the whole draft's)."""
    import jax

    from jaxmamba.engine import memory

    itemsize = jnp.dtype(dtype).itemsize
    tp = cfg.tensor_parallel_size
    shard_cfg = model_cfg  # a device's share of every slot and page
    if tp > 1:
        from jaxmamba.parallel.plan import TensorParallelPlan

        shard_cfg = TensorParallelPlan(model_cfg, tp).shard_config()
    per_slot = memory.slot_bytes(shard_cfg, itemsize, jnp.dtype(cfg.ssm_dtype).itemsize)
    per_page = memory.page_bytes(shard_cfg, cfg.page_size, cfg.kv_itemsize(itemsize))
    if draft is not None:
        conv, state = draft.spec.model.cfg.slot_state_elements()
        per_slot += state * jnp.dtype(cfg.ssm_dtype).itemsize + conv * itemsize
        per_page += memory.page_bytes(draft.spec.model.cfg, cfg.page_size,
                                      cfg.kv_itemsize(itemsize))  # fmt: skip
        if cfg.speculative_config.method == "mtp":  # the head's output at the slot's end
            per_slot += model_cfg.hidden_size * itemsize
    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    plan = functools.partial(
        memory.plan_cache,
        per_slot=per_slot,
        per_page=per_page,
        max_num_seqs=cfg.max_num_seqs,
        max_pages_per_seq=cfg.max_pages_per_seq,
        page_size=cfg.page_size,
        pages_per_checkpoint=memory.pages_per_checkpoint(cfg.track_interval, cfg.page_size),
        prefix_caching=cfg.enable_prefix_caching,
        num_state_slots=cfg.num_state_slots,
        num_pages=cfg.num_pages,
        fixed=memory.fixed_bytes(model_cfg, itemsize),
    )
    u = cfg.gpu_memory_utilization
    device = jax.tree.leaves(params)[0].devices().pop() if weights else jax.devices()[0]
    if tp > 1:  # the weights wait in host memory; each device will hold about 1/tp of them
        device = jax.local_devices()[0]
    mem = memory.device_memory(device)
    if tp > 1 and mem is not None and mem.source != "MemAvailable":
        # ... and a draft model's whole weights (`load_draft`: in host memory until then)
        draft_weights = 0 if draft is None else sum(x.nbytes for x in jax.tree.leaves(draft.params))
        mem = dataclasses.replace(mem, in_use=mem.in_use + weights // tp + draft_weights)
    temps = 0
    if cfg.kv_cache_memory_bytes is not None:
        how = f"kv_cache_memory_bytes={cfg.kv_cache_memory_bytes}"
        result = plan(budget=cfg.kv_cache_memory_bytes, budget_what="kv_cache_memory_bytes",
                      hint="raise kv_cache_memory_bytes")  # fmt: skip
    elif mem is None:
        how = "no memory figures for this device: sizes not checked"
        result = plan(budget=None)
    elif mem.source == "MemAvailable":
        budget = memory.cache_budget(limit=mem.limit, in_use=0, utilization=u, temporaries=0)
        how = f"host MemAvailable {memory.fmt_bytes(mem.limit)} x {u}"
        where = f"{u} x the host's MemAvailable"
        defaults = cfg.num_state_slots is None and cfg.num_pages is None
        try:  # the given or default sizes, as they are
            result = plan(
                budget=budget,
                num_state_slots=cfg.state_slots,
                num_pages=cfg.pages,
                budget_what=where,
                hint="pass smaller num_state_slots/num_pages",
            )
        except ValueError as e:
            if not defaults:
                raise
            factor = 2 if cfg.enable_prefix_caching else 1
            rows = cfg.max_num_seqs * factor
            fit = max(budget - (cfg.state_slots + 1) * per_slot, 0) // per_page // rows
            raise ValueError(
                f"max_model_len={cfg.max_model_len} with max_num_seqs={cfg.max_num_seqs} needs "
                f"{memory.fmt_bytes(cfg.pages * per_page)} of KV pages on CPU ({rows} rows at "
                f"max_model_len: the default sizes), more than {where} "
                f"({memory.fmt_bytes(budget)}): at most max_model_len={fit * cfg.page_size} "
                "fits; or pass num_pages, num_state_slots or kv_cache_memory_bytes"
            ) from e
    else:
        what = f"gpu_memory_utilization={u} x {mem.limit / memory.GiB:.2f} GiB"
        budget = memory.cache_budget(limit=mem.limit, in_use=mem.in_use, utilization=u,
                                     temporaries=0)  # fmt: skip
        plan(budget=budget, budget_what=f"{what} - in use")  # too small even before temporaries
        result, temps = _fit_every_program(model_cfg, cfg, params, dtype, impl, plan, budget, what,
                                           draft)  # fmt: skip
        gib = lambda n: f"{n / memory.GiB:.2f} GiB"  # noqa: E731
        how = f"{what} - {gib(mem.in_use)} in use (weights {gib(weights)}) - {gib(temps)} temps"
    result = dataclasses.replace(result, note=f"memory: {how}")
    logger.info("%s", result.describe())
    return result


def _fit_every_program(model_cfg: ModelConfig, cfg: EngineConfig, params, dtype, impl, plan,
                       budget: int, what: str, draft: Draft | None = None):  # fmt: skip
    """`(plan, temporaries)`: the cache planned within `budget` so that every program the
    engine can run fits beside it. The largest steps' temporaries, probed on a small cache,
    are reserved first; then every program (each bucket's step with its sampler variants,
    and the side programs) compiles at the planned cache's shapes, and XLA's memory analysis
    of each is read. Where one needs more than was reserved (a program may copy a cache
    array, which grows with the cache), the cache is planned again with that figure and the
    programs compile again at the new shapes. The compiled programs stay in the jit's cache,
    so the engine's runner does not compile them again. A configuration whose programs do not
    fit beside the smallest cache is refused, naming the setting and the largest value that
    fits (`_programs_too_big`)."""
    from jaxmamba.engine import memory
    from jaxmamba.engine.runner import program_name

    reserved = _largest_step_temporaries(model_cfg, cfg, params, dtype, impl, draft)
    sizes = plan.keywords  # the bytes of a slot, a page and the fixed part (`size_cache`)
    slots = cfg.num_state_slots or cfg.max_num_seqs
    pages = cfg.num_pages or cfg.max_pages_per_seq
    smallest = (slots + 1) * sizes["per_slot"] + (pages + 1) * sizes["per_page"] + sizes["fixed"]
    seen = []  # (cache bytes, every program's need) of each plan compiled
    for _ in range(4):
        try:
            result = plan(budget=budget - reserved,
                          budget_what=f"{what} - in use - step temporaries")  # fmt: skip
        except ValueError as e:
            too_big = _programs_too_big(model_cfg, cfg, params, dtype, impl, smallest, budget,
                                        what, draft)  # fmt: skip
            raise (too_big or e) from None
        needs = _program_needs(model_cfg, cfg, params, dtype, impl, result.state_slots,
                               result.pages, draft)  # fmt: skip
        needs = {p: n or 0 for p, n in needs.items()}
        worst = max(needs, key=needs.get)
        if needs[worst] <= reserved:
            return result, reserved
        logger.info("the %s step needs %s beside its arguments at this cache's shapes, more "
                    "than the %s reserved: planning the cache again", program_name(worst),
                    memory.fmt_bytes(needs[worst]), memory.fmt_bytes(reserved))  # fmt: skip
        seen.append((result.cache_bytes, needs))
        reserved = _reserve_again(seen, budget, smallest)
    too_big = _programs_too_big(model_cfg, cfg, params, dtype, impl, smallest, budget, what,
                                draft)  # fmt: skip
    raise too_big or RuntimeError(
        "the cache plan did not settle: the programs' temporaries grow with the cache "
        f"({memory.fmt_bytes(reserved)} at the last plan)"
    )


def _reserve_again(seen: list[tuple[int, dict]], budget: int, smallest: int) -> int:
    """The bytes to leave beside the cache next, after plans whose programs needed more than
    was left (`seen`: each plan's cache bytes and every program's need). A program that copies
    a cache array needs more the larger the cache: from two plans, each program's need is
    taken as affine in the cache's bytes (`a + k × cache`), and the cache is the largest
    with `cache + need ≤ budget` for all of them. After one plan, its largest need is
    reserved where the smallest cache fits beside it; otherwise the cache is halved toward
    the smallest to measure the slope."""
    cache, needs = seen[-1]
    if len(seen) == 1:
        most = max(needs.values())
        return most if budget - most >= smallest else budget - (cache + smallest) // 2
    (c0, n0), (c1, n1) = seen[-2], seen[-1]
    fit = budget
    for p in n1:
        k = max((n0[p] - n1[p]) / (c0 - c1), 0.0) if c0 != c1 else 0.0
        a = n1[p] - k * c1
        fit = min(fit, int((budget - a) / (1 + k)))
    return budget - max(fit, smallest)


def _program_needs(model_cfg: ModelConfig, cfg: EngineConfig, params, dtype, impl,
                   state_slots: int, pages: int,
                   draft: Draft | None = None) -> dict[tuple, int | None]:  # fmt: skip
    """Every program's device bytes beside its arguments (`StepRunner.compile_programs`),
    compiled for a cache of these sizes, with nothing allocated; a bar shows the progress."""
    from jaxmamba.engine.batch import StepBuilder
    from jaxmamba.engine.engine import compile_progress
    from jaxmamba.engine.runner import ModelRunner
    from jaxmamba.engine.scheduler import Scheduler

    sized = dataclasses.replace(cfg, num_state_slots=state_slots, num_pages=pages)
    spec = CacheSpec(state_slots, pages, cfg.page_size, cfg.ssm_dtype, cfg.kv_cache_dtype)
    runner = ModelRunner(model_cfg, params, spec, dtype=dtype, impl=impl,
                         tensor_parallel_size=cfg.tensor_parallel_size, allocate=False,
                         speculative=speculative_spec(cfg, draft),
                         draft_params=None if draft is None else draft.params)  # fmt: skip
    builder = StepBuilder(spec, cfg.max_pages_per_seq, model_cfg.vocab_size, model_cfg.chunk_size,
                          speculative=cfg.speculative_config is not None)  # fmt: skip
    buckets = Scheduler(model_cfg, sized).all_buckets()
    return runner.compile_programs(buckets, builder.padding, compile_progress("compiling steps"))


def _programs_too_big(model_cfg: ModelConfig, cfg: EngineConfig, params, dtype, impl,
                      smallest: int, budget: int, what: str,
                      draft: Draft | None = None) -> ValueError | None:  # fmt: skip
    """Why the programs do not fit beside the smallest cache within `budget`, naming the
    setting to lower and the largest value of it whose programs fit (from every program
    compiled beside the smallest cache); None when they fit and the cache itself is what is
    too big (the cache plan's own error says so)."""
    from jaxmamba.engine import memory
    from jaxmamba.engine.runner import program_name

    slots = cfg.num_state_slots or cfg.max_num_seqs
    pages = cfg.num_pages or cfg.max_pages_per_seq
    needs = {p: n or 0 for p, n in _program_needs(model_cfg, cfg, params, dtype, impl, slots,
                                                  pages, draft).items()}  # fmt: skip
    room = budget - smallest
    worst = max(needs, key=needs.get)
    if needs[worst] <= room:
        return None
    steps = {p: n for p, n in needs.items() if len(p) == 2}
    decode = {p: n for p, n in steps.items() if p[0].num_decode == p[0].num_rows}
    if worst in decode:  # decode steps grow with their rows: max_num_seqs
        setting, size = "max_num_seqs", lambda p: p[0].num_rows
        pool = decode
    else:  # prefill and mixed steps grow with their tokens: max_num_batched_tokens
        setting, size = "max_num_batched_tokens", lambda p: p[0].num_tokens
        pool = {p: n for p, n in steps.items() if p not in decode}
    sizes = sorted({size(p) for p in pool})
    fits = [s for s in sizes if all(n <= room for p, n in pool.items() if size(p) <= s)]
    largest = f"at most {setting}={fits[-1]} fits" if fits else f"no {setting} fits"
    return ValueError(
        f"{setting}={getattr(cfg, setting)}: the {program_name(worst)} step needs "
        f"{memory.fmt_bytes(needs[worst])} beside its arguments (XLA's memory analysis), and "
        f"with the smallest cache ({memory.fmt_bytes(smallest)}: max_num_seqs="
        f"{cfg.max_num_seqs} state slots, one sequence at max_model_len={cfg.max_model_len}) "
        f"that is more than {what} - in use ({memory.fmt_bytes(budget)}): {largest} (or "
        "raise gpu_memory_utilization)"
    )


def _largest_step_temporaries(model_cfg: ModelConfig, cfg: EngineConfig, params, dtype, impl,
                              draft: Draft | None = None):  # fmt: skip
    """The most temporary bytes of the largest prefill/mixed and the largest decode bucket,
    compiled side by side (XLA's compiles release the GIL). With `num_state_slots` and
    `num_pages` both given, the probes have the engine's own cache shapes, so the persistent
    compilation cache hands their executables to `precompile` instead of compiling twice."""
    from concurrent.futures import ThreadPoolExecutor

    from jaxmamba.engine.batch import StepBuilder
    from jaxmamba.engine.runner import step_temporary_bytes
    from jaxmamba.engine.scheduler import Scheduler

    probe = cfg
    if cfg.num_state_slots is None or cfg.num_pages is None:
        probe = dataclasses.replace(
            cfg, num_state_slots=cfg.max_num_seqs, num_pages=cfg.max_pages_per_seq
        )
    spec = CacheSpec(
        probe.state_slots, probe.pages, cfg.page_size, cfg.ssm_dtype, cfg.kv_cache_dtype
    )
    buckets = Scheduler(model_cfg, probe).all_buckets()
    decode = [b for b in buckets if b.num_decode == b.num_rows]
    prefill = [b for b in buckets if b.num_decode < b.num_rows]
    largest = [max(g, key=lambda b: (b.num_tokens, b.num_rows)) for g in (decode, prefill) if g]
    builder = StepBuilder(spec, cfg.max_pages_per_seq, model_cfg.vocab_size, model_cfg.chunk_size,
                          speculative=cfg.speculative_config is not None)  # fmt: skip

    def temporaries(b):
        return step_temporary_bytes(
            model_cfg, params, spec, builder.padding(b), b.num_decode, dtype=dtype, impl=impl,
            tensor_parallel_size=cfg.tensor_parallel_size, speculative=speculative_spec(cfg, draft),
            draft_params=None if draft is None else draft.params,
        )  # fmt: skip

    with ThreadPoolExecutor(len(largest)) as pool:
        return max(pool.map(temporaries, largest))


class Draft(NamedTuple):
    """A draft model (speculative_config method "draft_model"): the runner's `DraftSpec`
    (its module, at the target's chunk size) and its weights; or the target's MTP layer
    (method "mtp"): its `MtpSpec` and weights."""

    spec: Any  # jaxmamba.model.draft.DraftSpec | jaxmamba.model.mtp.MtpSpec
    params: Any


def load_draft(cfg: EngineConfig, target: ModelConfig, dtype, run: RunConfig,
               model: str | None = None) -> Draft | None:  # fmt: skip
    """The draft model `cfg.speculative_config.model` names (a preset, YAML file or checkpoint
    directory), its weights loaded as the target's are (dtype, quantization; a preset's
    random weights from the run's seed); None unless the method is "draft_model" or "mtp". A
    vocabulary other than the target's is a ValueError naming both sizes. Method "mtp": the
    MTP layer of the target checkpoint `model` (`jaxmamba.model.mtp.load_mtp`); a model
    without one is a ValueError naming it."""
    sc = cfg.speculative_config
    if sc is not None and sc.method == "mtp":
        from jaxmamba.config import checkpoint_dir
        from jaxmamba.model.mtp import load_mtp

        spec, params = load_mtp(model, checkpoint_dir(model), sc.num_speculative_tokens, target,
                                dtype, run.impl)  # fmt: skip
        return Draft(spec, params)
    if sc is None or sc.method != "draft_model":
        return None
    from jaxmamba.model.draft import draft_spec

    spec = draft_spec(sc.num_speculative_tokens, load_config(sc.model), target, dtype, run.impl)
    # Under tensor parallelism into host memory first: the runner places a copy on every device.
    params = _load_params_for(sc.model, spec.model.cfg, dtype, run.seed, cfg.tensor_parallel_size,
                              run.quantization, split=False)  # fmt: skip
    return Draft(spec, params)


def speculative_spec(cfg: EngineConfig, draft: Draft | None = None):
    """The runner's drafting for `cfg.speculative_config`: an `NgramSpec`, the draft model's
    `DraftSpec` (`load_draft`), or None without speculation."""
    sc = cfg.speculative_config
    if sc is None:
        return None
    if sc.method in ("draft_model", "mtp"):
        if draft is None:
            raise ValueError(f"speculative_config.model={sc.model!r}: the draft model is not "
                             "loaded (`load_draft`)")  # fmt: skip
        return draft.spec
    from jaxmamba.model.speculative import NgramSpec

    return NgramSpec(sc.num_speculative_tokens, sc.prompt_lookup_min, sc.prompt_lookup_max)


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
