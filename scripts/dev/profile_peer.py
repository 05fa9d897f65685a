"""Where the peer path's steps spend their device time: the 9B steps of
`../shared/anchors/anchor_torch_e2e.py` (prepared into `.anchors` by its `prepare.sh`) under
`torch.profiler`. A decode step is captured in a CUDA graph as the anchor times it and
replayed; a prefill step runs eagerly, as the anchor times it (after the anchor's SSD autotune
call). Prints kernels a step, busy and span, and every kernel's calls and µs a step, grouped
by name (the same table `scripts/trace_summary.py: format_trace_summary` prints for our step).

    python3 scripts/dev/profile_peer.py --peer-dir .anchors --batch 32 256 --prefill 1x2048 \
        --json $OUT/peer_profile.json

The anchor is imported from `--peer-dir` at run time; nothing of it is copied here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: trace_summary
from trace_summary import format_trace_summary, kernel_table  # noqa: E402


def profile_graph(torch, replay, replays: int) -> dict:
    """Kernel events of ``replays`` calls of ``replay`` (a graph replay or an eager step) as
    one table, per call."""
    from torch.profiler import ProfilerActivity, profile

    with tempfile.TemporaryDirectory() as tmp:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                replay()
            torch.cuda.synchronize()
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    return kernel_table(kernels, replays)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--peer-dir", default=".anchors")
    p.add_argument("--batch", type=int, nargs="*", default=[32, 256], help="decode cases")
    p.add_argument("--prefill", nargs="*", default=[], help="prefill cases, BxL (e.g. 1x2048)")
    p.add_argument("--context", type=int, default=520, help="cached tokens a row (the anchor's "
                   "decode case at --decode-context 512, --output-len 16)")  # fmt: skip
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--json")
    args = p.parse_args()
    sys.path.insert(0, os.path.abspath(args.peer_dir))
    import anchor_torch_e2e as peer  # noqa: PLC0415 - from --peer-dir, at run time
    import torch  # noqa: PLC0415

    torch.backends.cuda.matmul.allow_tf32 = False
    c = peer.Cfg()
    prefills = [tuple(int(v) for v in case.split("x")) for case in args.prefill]
    model = peer.Model(c, num_slots=max([*args.batch, *(b for b, _ in prefills)]) + 1)
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": {}}
    for batch in args.batch:
        kv_len = args.context + 1
        gen = torch.Generator(device="cuda").manual_seed(batch)
        kv = [tuple(torch.randn(batch, c.kv_heads, kv_len, c.attn_dim, device="cuda",
                                dtype=torch.bfloat16, generator=gen) for _ in range(2))
              for _ in range(c.n_attn)]  # fmt: skip
        slots = (torch.randperm(model.num_slots - 1, device="cuda", generator=gen)[:batch]
                 + 1).to(torch.int32)  # fmt: skip
        tok = torch.randint(0, c.vocab, (batch,), device="cuda", generator=gen)
        pos_t = torch.tensor([args.context], device="cuda")

        def step(tok=tok, slots=slots, kv=kv, pos_t=pos_t, kv_len=kv_len):
            tok.copy_(model.decode(tok, slots, kv, pos_t, kv_len))

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        summary = profile_graph(torch, graph.replay, args.replays)
        if summary["kernels_per_step"] == 0:  # a profiler that does not see graph kernels
            summary = profile_graph(torch, step, args.replays)
            summary["eager"] = True
        record["cases"][f"d{batch}"] = summary
        title = f"peer decode batch {batch}" + (
            " (eager: the profiler saw no graph kernels)" if summary.get("eager") else ""
        )
        print(format_trace_summary(title, dict(summary, top=summary["top"][:40])), flush=True)
        del graph, kv
        torch.cuda.empty_cache()
    if prefills:
        peer.autotune_warmup(model, *max(prefills, key=lambda case: case[0] * case[1]))
    for batch, length in prefills:
        gen = torch.Generator(device="cuda").manual_seed(batch * length)
        ids = torch.randint(0, c.vocab, (batch * length,), device="cuda", generator=gen)
        meta = peer.PrefillMeta.build([length] * batch, list(range(1, batch + 1)))
        kv = [tuple(torch.empty(batch, c.kv_heads, length, c.attn_dim, device="cuda",
                                dtype=torch.bfloat16) for _ in range(2))
              for _ in range(c.n_attn)]  # fmt: skip

        def prefill(ids=ids, meta=meta, kv=kv):
            model.prefill(ids, meta, kv)

        for _ in range(2):
            prefill()
        torch.cuda.synchronize()
        summary = profile_graph(torch, prefill, args.replays)
        record["cases"][f"p{batch}x{length}"] = summary
        print(format_trace_summary(f"peer prefill {batch}x{length} (eager)",
                                   dict(summary, top=summary["top"][:40])), flush=True)  # fmt: skip
        del kv
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
