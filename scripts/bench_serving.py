"""Serving benchmark: a load generator for any OpenAI-compatible server (in the spirit of
`vllm bench serve` and `sglang.bench_serving`), and a driver that puts `jaxmamba serve`
beside the offline engine on the same requests.

Client (any server; streaming; prompts as token ids for /v1/completions, text for chat):

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --model M \
        --dataset random --random-input-len 1024 --random-output-len 256 \
        --random-range-ratio 0.5 --num-prompts 128 --max-concurrency 64

    --request-rate R   Poisson arrivals at R requests/s (default inf: all at once, capped by
                       --max-concurrency); --dataset shared-prefix --prefix-len P
                       --num-prefix-groups G: each prompt = its group's prefix + a random suffix.

Side by side (one process holds the model on random weights: the server runs in it on
uvicorn, the client runs as a subprocess per concurrency level). Every bucket is compiled
first, so neither timed run compiles (the engine's compile counter, read from /metrics before
and after each run, says so); per level the requests go through the server, then the same
requests through the engine's add_request/step loop offline, at the same concurrency:

    python scripts/bench_serving.py --serve-model nemotron-nano-9b-v2 --dtype bfloat16 \
        --concurrency 64 16 1 256 --num-prompts-per-level 128 32 4 256 ...

`--serve-model` also takes an exported artifact (`jaxmamba export --no-weights`).
Reports request and token throughput, TTFT, TPOT, ITL and end-to-end latency (mean, median,
p99), and with --result-json writes every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np


# -- requests -------------------------------------------------------------------------------------
@dataclass
class BenchRequest:
    prompt: list[int] | str
    prompt_len: int
    output_len: int


def sample_requests(args) -> list[BenchRequest]:
    """Random prompts: lengths uniform in [L(1-r), L(1+r)], token ids uniform in the vocab
    (text of random words for the chat endpoint). The same args give the same requests."""
    rng = np.random.default_rng(args.seed)
    n, r = args.num_prompts, args.random_range_ratio
    in_lens = rng.integers(int(args.random_input_len * (1 - r)),
                           int(args.random_input_len * (1 + r)) + 1, n)  # fmt: skip
    ro = args.output_range_ratio
    out_lens = rng.integers(max(int(args.random_output_len * (1 - ro)), 1),
                            int(args.random_output_len * (1 + ro)) + 1, n)  # fmt: skip
    prefixes = []
    if args.dataset == "shared-prefix":
        prefixes = [rng.integers(args.token_low, args.vocab_size, args.prefix_len).tolist()
                    for _ in range(args.num_prefix_groups)]  # fmt: skip
    requests = []
    for i in range(n):
        ids = rng.integers(args.token_low, args.vocab_size, int(in_lens[i])).tolist()
        if prefixes:
            ids = prefixes[i % len(prefixes)] + ids
        prompt: list[int] | str = ids
        if args.backend == "openai-chat":
            prompt = " ".join(f"w{t}" for t in ids)
        requests.append(BenchRequest(prompt, len(ids), int(out_lens[i])))
    return requests


# -- the client -----------------------------------------------------------------------------------
@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


class _Progress:
    def __init__(self, total: int, disable: bool):
        self.bar = None
        if disable:
            return
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="requests", dynamic_ncols=True)
        except ImportError:
            self.total, self.done = total, 0

    def update(self):
        if self.bar is not None:
            self.bar.update(1)
        elif hasattr(self, "total"):
            self.done += 1
            sys.stderr.write(f"\rrequests: {self.done}/{self.total}")
            if self.done == self.total:
                sys.stderr.write("\n")

    def close(self):
        if self.bar is not None:
            self.bar.close()


async def _one(session, url: str, headers, payload, req: BenchRequest, chat: bool) -> RequestResult:
    res = RequestResult(prompt_len=req.prompt_len)
    start = time.perf_counter()
    last = start
    usage_tokens = None
    chunks = 0
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for raw in resp.content:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = obj["error"].get("message", str(obj))
                    return res
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
                choices = obj.get("choices") or []
                if not choices:
                    continue
                delta = choices[0].get("delta", {}) if chat else choices[0]
                if chat and "role" in delta and not delta.get("content"):
                    continue  # the role-only opening chunk carries no token
                now = time.perf_counter()
                if chunks == 0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
                chunks += 1
        res.e2e = time.perf_counter() - start
        res.output_tokens = usage_tokens if usage_tokens is not None else chunks
        res.ok = True
    except Exception as err:  # a failed request is counted, not fatal
        res.error = f"{type(err).__name__}: {err}"
    return res


async def run_client(args, requests: list[BenchRequest]) -> tuple[list[RequestResult], float]:
    import aiohttp

    chat = args.backend == "openai-chat"
    url = args.base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = np.random.default_rng(args.seed + 1)
    progress = _Progress(len(requests), args.no_progress)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.timeout_s)
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0)

    def payload(req: BenchRequest):
        body = {"model": args.model, "max_tokens": req.output_len, "stream": True,
                "temperature": args.temperature,
                "stream_options": {"include_usage": True}}  # fmt: skip
        if args.ignore_eos:
            body["ignore_eos"] = True
        if chat:
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        return body

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def limited(req):
            if semaphore is None:
                out = await _one(session, url, headers, payload(req), req, chat)
            else:
                async with semaphore:
                    out = await _one(session, url, headers, payload(req), req, chat)
            progress.update()
            return out

        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(limited(req)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    progress.close()
    return list(results), duration


# -- figures --------------------------------------------------------------------------------------
def summarize(results: list[RequestResult], duration: float) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    ttft = np.array([r.ttft for r in ok]) * 1e3 if ok else np.zeros(1)
    e2e = np.array([r.e2e for r in ok]) * 1e3 if ok else np.zeros(1)
    tpot = np.array([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok
                     if r.output_tokens > 1]) * 1e3  # fmt: skip
    itl = np.array([x for r in ok for x in r.itl]) * 1e3
    s = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    for name, a in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl), ("e2e_ms", e2e)):
        a = a if a.size else np.zeros(1)
        s[f"mean_{name}"] = float(a.mean())
        s[f"median_{name}"] = float(np.median(a))
        s[f"p99_{name}"] = float(np.percentile(a, 99))
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        s["errors"] = errors[:5]
    return s


def print_summary(s: dict, title: str) -> None:
    print(f"{'=' * 16} {title} {'=' * 16}")
    print(f"completed / failed:           {s['completed']} / {s['failed']}")
    print(f"duration (s):                 {s['duration_s']:.2f}")
    print(f"input / output tokens:        {s['input_tokens']} / {s['output_tokens']}")
    print(f"request throughput (req/s):   {s['request_throughput']:.2f}")
    print(f"output throughput (tok/s):    {s['output_throughput']:.1f}")
    print(f"total throughput (tok/s):     {s['total_token_throughput']:.1f}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        print(f"{name.upper():5} ms mean/median/p99:  {s[f'mean_{name}_ms']:.1f} / "
              f"{s[f'median_{name}_ms']:.1f} / {s[f'p99_{name}_ms']:.1f}")  # fmt: skip
    for e in s.get("errors", []):
        print(f"error: {e}")


# -- the side-by-side driver ----------------------------------------------------------------------
def offline_run(engine, requests: list[BenchRequest], concurrency: int, temperature: float):
    """The same requests straight through the engine's add_request/step loop (LLM.generate's
    loop), at most `concurrency` in flight. Also returns the seconds spent inside
    `engine.step`."""
    from jaxmamba import SamplingParams

    pending = list(enumerate(requests))[::-1]
    live: dict[str, dict] = {}
    results = [RequestResult(prompt_len=r.prompt_len) for r in requests]
    start = time.perf_counter()
    step_s = 0.0

    def admit():
        while pending and len(live) < concurrency:
            i, req = pending.pop()
            sp = SamplingParams(max_tokens=req.output_len, temperature=temperature,
                                ignore_eos=True)  # fmt: skip
            engine.add_request(str(i), {"prompt_token_ids": req.prompt}, sp)
            live[str(i)] = {"t0": time.perf_counter(), "last": None}

    admit()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outputs = engine.step()
        step_s += time.perf_counter() - t
        for out in outputs:
            st = live.get(out.request_id)
            if st is None:
                continue
            res = results[int(out.request_id)]
            now = time.perf_counter()
            n = sum(len(c.token_ids) for c in out.outputs)
            if n:
                if st["last"] is None:
                    res.ttft = now - st["t0"]
                else:
                    res.itl.append(now - st["last"])
                st["last"] = now
                res.output_tokens += n
            if out.finished:
                res.e2e, res.ok = now - st["t0"], True
                del live[out.request_id]
        admit()
    return results, time.perf_counter() - start, step_s


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build_llm(args, max_len: int):
    """The served LLM on random weights (`bench_cold_start.random_params`), from a model or
    an exported artifact; the live engine's cache sizes are given, so its memory probes
    compile steps that precompile reuses."""
    from bench_cold_start import random_params

    from jaxmamba import LLM
    from jaxmamba.engine.config import EngineConfig
    from jaxmamba.export.artifact import is_artifact, read_artifact
    from jaxmamba.export.compile_cache import setup_compilation_cache

    # Before the weights' jits compile, so that they are cached too.
    setup_compilation_cache(args.compilation_cache_dir)
    cache = {"compilation_cache_dir": args.compilation_cache_dir} if args.compilation_cache_dir \
        else {}  # fmt: skip
    if is_artifact(args.serve_model):
        source = read_artifact(args.serve_model).manifest["source"]
        return LLM(args.serve_model, params=random_params(source, args.dtype), **cache)
    seqs = max(args.concurrency)
    pages = EngineConfig(max_model_len=max_len).max_pages_per_seq
    return LLM(args.serve_model, dtype=args.dtype, max_num_seqs=seqs, max_model_len=max_len,
               max_num_batched_tokens=args.max_num_batched_tokens,
               enable_prefix_caching=args.dataset == "shared-prefix",
               params=random_params(args.serve_model, args.dtype),
               **({} if args.dataset == "shared-prefix" else
                  {"num_state_slots": seqs, "num_pages": seqs * pages}), **cache)  # fmt: skip


def side_by_side(args) -> int:
    import threading

    import jax
    import uvicorn

    from jaxmamba.serve.api_server import OpenAIServer, ServerConfig

    cache_events = {"hits": 0, "misses": 0}
    jax.monitoring.register_event_listener(
        lambda name, **kw: cache_events.__setitem__(k, cache_events[k] + 1)
        if (k := name.rsplit("cache_", 1)[-1]) in cache_events and "compilation_cache" in name
        else None
    )  # fmt: skip
    budget_end = time.monotonic() + args.budget_s
    levels = list(zip(args.concurrency, args.num_prompts_per_level, strict=True))
    max_len = int(args.random_input_len * (1 + args.random_range_ratio)) + args.prefix_len
    max_len += int(args.random_output_len * (1 + args.output_range_ratio)) + 16
    t0 = time.perf_counter()
    llm = _build_llm(args, max_len)
    t_build = time.perf_counter() - t0
    startup = {"build_s": t_build}
    print(f"built the LLM in {t_build:.1f} s", flush=True)
    if args.precompile:
        t = time.perf_counter()
        buckets = llm.engine.scheduler.all_buckets()

        def progress(i, n, _bucket):
            if i == n or i % max(1, n // 8) == 0:
                print(f"precompiled {i}/{n} buckets ({time.perf_counter() - t:.0f} s)",
                      flush=True)  # fmt: skip

        # What `engine.precompile` does, with the number of compile threads given.
        llm.runner.precompile(buckets, llm.engine.builder.padding, progress,
                              workers=args.compile_workers)  # fmt: skip
        startup["buckets"] = len(buckets)
        startup["precompile_s"] = time.perf_counter() - t
        startup["compile_workers"] = args.compile_workers
    startup.update(cache_events, compilations=llm.runner.num_compiles)
    print(f"start-up: {json.dumps(startup)} (max_model_len {llm.engine_cfg.max_model_len})",
          flush=True)  # fmt: skip
    args.vocab_size = min(args.vocab_size, llm.model_cfg.vocab_size)
    server = OpenAIServer(llm, ServerConfig(served_model_names=(args.model,),
                                            max_queued_requests=4096))  # fmt: skip
    port = _free_port()
    uv = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=port,
                                       log_level="warning", lifespan="on"))  # fmt: skip
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    base = [sys.executable, os.path.abspath(__file__), "--base-url", url,
            "--model", args.model, "--dataset", args.dataset, "--random-input-len",
            str(args.random_input_len), "--random-output-len", str(args.random_output_len),
            "--random-range-ratio", str(args.random_range_ratio), "--output-range-ratio",
            str(args.output_range_ratio), "--vocab-size", str(args.vocab_size),
            "--prefix-len", str(args.prefix_len), "--num-prefix-groups",
            str(args.num_prefix_groups), "--temperature", str(args.temperature),
            "--ignore-eos", "--no-progress"]  # fmt: skip
    out_dir = args.out_dir or "."
    os.makedirs(out_dir, exist_ok=True)
    rows = []

    def gauges() -> dict[str, float]:
        """The engine's gauges as a client sees them, from the server's /metrics."""
        import urllib.request

        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
            text = resp.read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("jaxmamba_engine_"):
                name, value = line.rsplit(" ", 1)
                out[name[len("jaxmamba_engine_") :]] = float(value)
        return out

    def client(c, n, seed, tag):
        path = os.path.join(out_dir, f"serve_c{c}_{tag}.json")
        cmd = base + ["--max-concurrency", str(c), "--num-prompts", str(n), "--seed", str(seed),
                      "--result-json", path]  # fmt: skip
        before = gauges()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        after = gauges()
        with open(path) as f:
            s = json.load(f)
        s["compiles_before"], s["compiles_after"] = before["compilations"], after["compilations"]
        s["compiles_in_timed"] = after["compilations"] - before["compilations"]
        s["engine_step_s"] = after["loop_step_seconds"] - before["loop_step_seconds"]
        return s

    def offline(c, n, seed):
        reqs = sample_requests(argparse.Namespace(**{**vars(args), "num_prompts": n,
                                                     "seed": seed}))  # fmt: skip
        # On the engine's own thread (the server is idle): only that thread touches it.
        c0, results, duration, step_s, c1 = server.loop.call_blocking(lambda engine: (
            engine.runner.num_compiles, *offline_run(engine, reqs, c, args.temperature),
            engine.runner.num_compiles))  # fmt: skip
        s = summarize(results, duration)
        s["compiles_before"], s["compiles_after"], s["compiles_in_timed"] = c0, c1, c1 - c0
        s["engine_step_s"] = step_s
        return s

    def report():
        with open(os.path.join(out_dir, "side_by_side.json"), "w") as f:
            table = [{"mode": m, "concurrency": c, **s} for m, c, s in rows]
            json.dump({"startup": startup, "rows": table}, f, indent=1)
        print(
            "\n| concurrency | requests | mode | output tok/s | TTFT p50 / p99 (ms) | "
            "ITL p50 / p99 (ms) | engine.step busy | compiles before → after |"
        )
        print("|---|---|---|---|---|---|---|---|")
        by = {(m, c): s for m, c, s in rows}
        for c, n in done:
            for m in ("server", "offline"):
                s = by.get((m, c))
                if s is None:
                    continue
                ratio = ""
                if m == "server" and ("offline", c) in by:
                    share = s["output_throughput"] / by[("offline", c)]["output_throughput"]
                    ratio = f" ({share:.1%} of offline)"
                print(
                    f"| {c} | {n} | {m} | {s['output_throughput']:.0f}{ratio} | "
                    f"{s['median_ttft_ms']:.0f} / {s['p99_ttft_ms']:.0f} | "
                    f"{s['median_itl_ms']:.1f} / {s['p99_itl_ms']:.1f} | "
                    f"{s['engine_step_s'] / s['duration_s']:.0%} | "
                    f"{s['compiles_before']:.0f} → {s['compiles_after']:.0f} |"
                )

    done = []
    for c, n in levels:
        if time.monotonic() > budget_end:
            print(f"budget spent: skipping concurrency {c}", flush=True)
            continue
        if args.warmup_passes:
            # Without precompile: the level's requests, offline and through the server,
            # untimed, compile the step shapes the timed runs meet (the server's staggered
            # arrivals make prefill/decode mixes the offline pass does not).
            offline(c, n, args.seed + c)
            client(c, n, args.seed + 2000 + c, "warmup")
        s = client(c, n, args.seed + c, "timed")
        print_summary(s, f"server, concurrency {c}")
        rows.append(("server", c, s))
        s = offline(c, n, args.seed + c)
        print_summary(s, f"offline engine, concurrency {c}")
        rows.append(("offline", c, s))
        done.append((c, n))
        report()
        sys.stdout.flush()
    uv.should_exit = True
    thread.join(60)
    if args.save_executables:
        from jaxmamba.export.writer import add_executables

        t = time.perf_counter()
        shutil.rmtree(args.save_executables, ignore_errors=True)
        add_executables(args.serve_model, args.save_executables, llm.runner)
        fresh = sum(f for _, f in llm.runner.compiled.values())
        print(f"stored {len(llm.runner.compiled)} executables ({fresh} compiled afresh here) "
              f"in {args.save_executables} in {time.perf_counter() - t:.1f} s",
              flush=True)  # fmt: skip
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--backend", choices=["openai", "openai-chat"], default="openai")
    p.add_argument("--model", default="default", help="the model name sent in requests")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--dataset", choices=["random", "shared-prefix"], default="random")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="input lengths uniform in [L(1-r), L(1+r)]")  # fmt: skip
    p.add_argument("--output-range-ratio", type=float, default=0.0)
    p.add_argument("--prefix-len", type=int, default=0, help="shared-prefix: the prefix length")
    p.add_argument("--num-prefix-groups", type=int, default=1)
    p.add_argument("--vocab-size", type=int, default=32000, help="token ids are drawn below this")
    p.add_argument("--token-low", type=int, default=16, help="and at or above this")
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="every request runs to max_tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--result-json")
    p.add_argument("--no-progress", action="store_true")
    g = p.add_argument_group("side by side (--serve-model)")
    g.add_argument("--serve-model", help="serve this model or artifact in-process, beside offline")
    g.add_argument("--dtype", default="bfloat16")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--concurrency", type=int, nargs="+", default=[64, 16, 1, 256])
    g.add_argument("--num-prompts-per-level", type=int, nargs="+", default=[128, 32, 4, 256])
    g.add_argument("--budget-s", type=float, default=420, help="no new level after this")
    g.add_argument(
        "--no-precompile",
        dest="precompile",
        action="store_false",
        help="compile lazily (then use --warmup-passes)",
    )
    g.add_argument(
        "--warmup-passes",
        action="store_true",
        help="before each level's timed runs, its requests offline and through the server",
    )
    g.add_argument(
        "--compile-workers",
        type=int,
        help="precompile's threads (default: the runner's, one per core up to 8)",
    )
    g.add_argument("--compilation-cache-dir", help="JAX's persistent cache (default: LLM's)")
    g.add_argument("--out-dir")
    g.add_argument("--save-executables", metavar="DIR",
                   help="(artifact) afterwards, a copy storing what it compiled")  # fmt: skip
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.serve_model:
        return side_by_side(args)
    requests = sample_requests(args)
    results, duration = asyncio.run(run_client(args, requests))
    s = summarize(results, duration)
    s["config"] = {k: v for k, v in vars(args).items() if k != "api_key"}
    print_summary(s, f"{args.backend} @ {args.base_url}, concurrency {args.max_concurrency}")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(s, f, indent=1, default=str)
    return 0 if s["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
