"""`jaxmamba bench`: prefill and decode throughput of one static batch (like SGLang's
`bench_one_batch`), with model-FLOP and memory-bandwidth utilisation against the H200's
measured ceilings (DESIGN §8).

Prefill: one step of `batch × input_len` tokens. Decode: `output_len` steps of `batch`
rows dispatched back to back (each feeds the token the previous step sampled, on device),
timed to the last step's completion — how the engine runs them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba.config import ModelConfig
from jaxmamba.engine.batch import Bucket, RowSpec, StepBuilder
from jaxmamba.engine.runner import FULL, GREEDY, PLAIN, ModelRunner, sampler_flags
from jaxmamba.step_contract import CacheSpec

PEAK_BF16_FLOPS = 800e12  # XLA bf16 matmul on the H200, measured (DESIGN §8)
PEAK_HBM_BYTES = 4.3e12  # D2D copy on the H200, measured (DESIGN §8)


def count_params(params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def _is_routed_expert(path) -> bool:
    return "experts_" in jax.tree_util.keystr(path)  # MoE's experts_up / experts_down


def _split_routed(params, measure) -> tuple[float, float]:
    """(sum of `measure` over the routed experts' weight leaves [X, ...], over the rest)."""
    routed = rest = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if _is_routed_expert(path):
            routed += measure(leaf)
        else:
            rest += measure(leaf)
    return routed, rest


def experts_hit(cfg: ModelConfig, tokens: int) -> float:
    """Expected distinct experts a step of `tokens` tokens routes to in one MoE layer, for
    uniform routing (each token picks `k` of `X` distinct experts):
    `X · (1 - (1 - k/X)^tokens)`. 6 at one token, ~100 at 32, ~128 at 128 (Nemotron 3 Nano)."""
    if not cfg.num_experts:
        return 0.0
    X, k = cfg.num_experts, cfg.num_experts_per_tok
    return X * (1.0 - (1.0 - k / X) ** tokens)


def active_params(cfg: ModelConfig, params) -> float:
    """Parameters one token runs through: everything except the routed experts, plus `k` of
    the `X` routed experts of each MoE layer (the shared expert and the router are in the
    rest). Equal to `count_params` for a model without MoE layers."""
    routed, rest = _split_routed(params, lambda x: float(np.prod(x.shape)))
    if not routed:
        return rest
    return rest + routed * cfg.num_experts_per_tok / cfg.num_experts


def prefill_flops(cfg: ModelConfig, params, batch: int, input_len: int) -> float:
    """Model FLOPs of a prefill: 2·(active weights per token, `active_params`)·tokens +
    attention + SSD. Routed experts count at top-k only: a kernel's padding rows are not
    model FLOPs."""
    tokens = batch * input_len
    embed = cfg.vocab_size * cfg.hidden_size
    dense = active_params(cfg, params) - embed * (1 if cfg.tie_word_embeddings else 2)
    flops = 2.0 * dense * tokens + 2.0 * embed * batch  # lm_head only at each row's last token
    # causal attention: QKᵀ and PV over on average input_len/2 keys
    flops += (
        cfg.num_attention_layers
        * 4.0
        * batch
        * input_len
        * (input_len / 2)
        * (cfg.num_attention_heads * cfg.head_dim)
    )
    # SSD per token and head: intra-chunk CBᵀ (C·N) and ·x (C·P), state in/out (2·P·N)
    per_token = cfg.mamba_num_heads * (
        cfg.chunk_size * (cfg.ssm_state_size + cfg.mamba_head_dim)
        + 2 * cfg.mamba_head_dim * cfg.ssm_state_size
    )
    flops += cfg.num_mamba_layers * 2.0 * tokens * per_token
    # Chunked gated delta rule per token and value head: KKᵀ, QKᵀ and T·βK (C·Dk each), T·βV
    # and the intra-chunk ·V′ (C·Dv each), W·S, Q·S and the state update (Dk·Dv each).
    dk, dv, c = cfg.gdn_key_head_dim, cfg.gdn_value_head_dim, cfg.chunk_size
    per_token = cfg.gdn_num_value_heads * (c * (3 * dk + 2 * dv) + 3 * dk * dv)
    flops += len(cfg.gdn_layers) * 2.0 * tokens * per_token
    return flops


def kv_itemsize(spec: CacheSpec, dtype) -> int:
    """Bytes of one KV value in `spec`'s pages (FP8: 1)."""
    from jaxmamba.model.cache import kv_dtype

    return jnp.dtype(kv_dtype(spec, dtype)).itemsize


def decode_bytes(cfg: ModelConfig, params, batch: int, context: int, dtype,
                 kv_bytes: int | None = None) -> float:  # fmt: skip
    """Bytes one decode step must move: every weight it uses once (of the routed experts, the
    `experts_hit` by `batch` tokens under uniform routing), every row's state read+written, KV
    (`kv_bytes` a value; default the activations')."""
    routed, rest = _split_routed(params, lambda x: float(x.size * x.dtype.itemsize))
    weight_bytes = rest + (routed * experts_hit(cfg, batch) / cfg.num_experts if routed else 0.0)
    act = jnp.dtype(dtype).itemsize
    conv, state = cfg.slot_state_elements()
    kv = 2 * context * cfg.num_key_value_heads * cfg.head_dim * (kv_bytes or act)
    per_row = 2 * (state * 4 + conv * act) + cfg.num_attention_layers * kv
    return weight_bytes + batch * per_row


@dataclass
class BenchResult:
    phase: str
    batch: int
    input_len: int
    seconds: float
    tokens_per_s: float
    utilisation: float  # MFU (prefill) or fraction of HBM roofline (decode)


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def bench_one_batch(
    cfg: ModelConfig,
    params,
    *,
    batch: int,
    input_len: int,
    output_len: int,
    dtype=jnp.bfloat16,
    page_size: int = 16,
    impl: str = "auto",
    small_m_impl: str | None = None,
    ssm_dtype: str = "float32",
    kv_dtype: str = "auto",
    repeats: int = 5,
    phases: tuple[str, ...] = ("prefill", "decode"),
    max_setup_tokens: int = 32768,
    fill_cache: bool = True,
    trace_dir: str | None = None,
    log=print,
    time_full_sampler: bool = False,
    time_plain_sampler: bool = False,
    prefill_steps: int = 1,
) -> list[BenchResult]:
    """Time the phases asked for. A decode-only run fills the cache with prefills of at most
    ``max_setup_tokens`` tokens (whole rows per step, one bucket), so a large batch at a long
    context does not need one giant prefill; with ``fill_cache=False`` it fills the cache with
    random values instead (the same kernels over the same lengths, so the same work, and rows
    that differ, so MoE rows route apart, without the set-up prefills' compiles). The timed
    prefill is one step, timed from the call to its output on the host (``prefill_steps=1``),
    or ``prefill_steps`` back to back, each dispatched while the one before runs, their time
    divided by their number: the device's time a step, as CUDA events around a step time it
    when the host enqueues faster than the device runs. With ``trace_dir``, each timed phase
    runs once more under the JAX profiler, into ``trace_dir/<phase>``. Decode rows are greedy
    without penalties and ask no logprobs, so the step runs the runner's cheapest sampler
    program (the argmax alone, where it has the variants); ``time_full_sampler`` also times
    the same steps with the full sampler (``decode-full``), ``time_plain_sampler`` with the
    sort-free one that draws and ranks (``decode-plain``: rows that ask for logprobs 0, or
    sample). ``ssm_dtype`` is the recurrent states' dtype (`EngineConfig.ssm_dtype`),
    ``kv_dtype`` the KV pages' (`EngineConfig.kv_cache_dtype`: "auto" or "fp8")."""
    for name, value in (("batch", batch), ("input_len", input_len), ("output_len", output_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    unknown = set(phases) - {"prefill", "decode"}
    if unknown or not phases:
        raise ValueError(f"phases must be a non-empty subset of prefill/decode, got {phases}")
    max_len = input_len + output_len + 1
    pages_per_seq = -(-max_len // page_size)
    spec = CacheSpec(num_slots=batch, num_pages=batch * pages_per_seq, page_size=page_size,
                     ssm_dtype=ssm_dtype, kv_dtype=kv_dtype)  # fmt: skip
    runner = ModelRunner(cfg, params, spec, dtype=dtype, impl=impl, small_m_impl=small_m_impl)
    builder = StepBuilder(spec, pages_per_seq, cfg.vocab_size, cfg.chunk_size)
    rng = np.random.default_rng(0)
    pages = lambda r: list(range(r * pages_per_seq, (r + 1) * pages_per_seq))  # noqa: E731
    prefill_rows = [
        RowSpec(rng.integers(0, cfg.vocab_size, input_len).tolist(), 0, r, pages(r))
        for r in range(batch)
    ]
    results = []
    if "prefill" in phases:
        prefill = builder.build(prefill_rows, Bucket(batch * input_len, batch, 0))
        start = time.perf_counter()
        jax.block_until_ready(runner.step(prefill, 0))
        log(f"  compiled+ran prefill {batch}x{input_len} in {time.perf_counter() - start:.1f} s")
        t_prefill = (
            median_time(
                lambda: [runner.step(prefill, 0) for _ in range(prefill_steps)][-1], repeats
            )
            / prefill_steps
        )
        if trace_dir:
            with jax.profiler.trace(f"{trace_dir}/prefill", create_perfetto_trace=True):
                jax.block_until_ready(runner.step(prefill, 0))
        tokens = batch * input_len
        mfu = prefill_flops(cfg, params, batch, input_len) / t_prefill / PEAK_BF16_FLOPS
        results.append(BenchResult("prefill", batch, input_len, t_prefill, tokens / t_prefill, mfu))
    if "decode" not in phases:
        return results

    if fill_cache:
        rows_per_setup = max(1, min(batch, max_setup_tokens // input_len))
        setup_bucket = Bucket(rows_per_setup * input_len, rows_per_setup, 0)
        start = time.perf_counter()
        for first in range(0, batch, rows_per_setup):
            group = prefill_rows[first : first + rows_per_setup]
            runner.step(builder.build(group, setup_bucket), 0)
        jax.block_until_ready(runner.cache)
        log(f"  set-up prefill {batch}x{input_len} in {time.perf_counter() - start:.1f} s")
    else:  # distinct random states per row, so rows route like rows after distinct prompts
        leaves, tree = jax.tree.flatten(runner.cache)
        keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
        runner.cache = jax.tree.unflatten(tree, [
            0.5 * jax.random.normal(key, x.shape, x.dtype)
            if jnp.issubdtype(x.dtype, jnp.floating) else x
            for key, x in zip(keys, leaves, strict=True)
        ])  # fmt: skip

    def decode_inputs(step):
        rows = [RowSpec([0], input_len + step, r, pages(r), token_from_device=True)
                for r in range(batch)]  # fmt: skip
        return builder.build(rows, Bucket(batch, batch, batch))

    decodes = [decode_inputs(s) for s in range(output_len)]
    # Greedy rows that ask no logprobs, as the engine runs them: the argmax-only sampler
    # (JAXMAMBA_SAMPLER_VARIANTS=0 times the full one).
    start = time.perf_counter()
    greedy = sampler_flags(GREEDY)
    jax.block_until_ready(runner.step(decodes[0], batch, **greedy))
    sampler = runner.sampler_variant(decodes[0], batch, **greedy)
    log(f"  compiled+ran decode batch {batch} ({sampler} sampler) in "
        f"{time.perf_counter() - start:.1f} s")  # fmt: skip

    def run_decode(sampler=GREEDY):
        out = None
        for inputs in decodes:
            out = runner.step(inputs, batch, **sampler_flags(sampler))
        return out

    # Re-running the same positions rewrites the same cache entries: the work per step and
    # the bytes moved are those of a real decode at this context.
    t_decode = median_time(run_decode, max(1, repeats // 2)) / output_len
    if trace_dir:
        with jax.profiler.trace(f"{trace_dir}/decode", create_perfetto_trace=True):
            jax.block_until_ready(run_decode())
    context = input_len + output_len // 2
    step_bytes = decode_bytes(cfg, params, batch, context, dtype, kv_itemsize(spec, dtype))
    bw = step_bytes / t_decode / PEAK_HBM_BYTES
    results.append(BenchResult("decode", batch, input_len, t_decode, batch / t_decode, bw))
    others = {"decode-full": FULL} if time_full_sampler else {}
    if time_plain_sampler:
        others["decode-plain"] = PLAIN
    for phase, sampler in others.items():
        jax.block_until_ready(run_decode(sampler))  # compiles that sampler's program
        t = median_time(lambda s=sampler: run_decode(s), max(1, repeats // 2)) / output_len
        results.append(BenchResult(phase, batch, input_len, t, batch / t,
                                   step_bytes / t / PEAK_HBM_BYTES))  # fmt: skip
    return results


def format_results(results: list[BenchResult]) -> str:
    lines = ["| phase | batch | input len | time per step | tokens/s | utilisation |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        what = "MFU" if r.phase.startswith("prefill") else "of HBM roofline"
        lines.append(
            f"| {r.phase} | {r.batch} | {r.input_len} | {r.seconds * 1e3:.2f} ms | "
            f"{r.tokens_per_s:,.0f} | {r.utilisation:.1%} {what} |"
        )
    return "\n".join(lines)
