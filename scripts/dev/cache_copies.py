"""Which step programs copy a cache array, and what each needs beside its arguments.

A step donates the cache and updates it in place; where XLA cannot (a read of the old array
after an update, a kernel's aliased operand read elsewhere), it copies the array first, and
the program's temporaries grow with the cache. For each bucket given, compiled at the given
cache size (nothing allocated): XLA's memory analysis and every copy whose shape is a cache
array's.

    python scripts/dev/cache_copies.py --model nemotron-nano-9b-v2 --slots 256 --pages 20000 \
        --buckets 128x128x128 16x64x0 512x72x8 8192x64x0 [--hlo-dir DIR]

Buckets are TxBxD: step tokens, rows, decode rows (a pure decode bucket has T = B = D). Run
with `XLA_FLAGS=--xla_dump_to=DIR` and `--temps DIR`: then the largest values in each step's
preallocated temporary buffer (XLA's buffer assignment), to see what a program holds at once.
"""

from __future__ import annotations

import argparse
import re
import time

import jax
import jax.numpy as jnp

from jaxmamba.engine.batch import Bucket, StepBuilder
from jaxmamba.engine.config import EngineConfig
from jaxmamba.engine.runner import FULL, ModelRunner, program_bytes
from jaxmamba.model.dtypes import DTYPES
from jaxmamba.model.families import load_config
from jaxmamba.model.params import param_shapes
from jaxmamba.step_contract import CacheSpec

GiB = 1 << 30


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="nemotron-nano-9b-v2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--pages", type=int, default=20000)
    p.add_argument("--max-model-len", type=int, default=1216)
    p.add_argument("--buckets", nargs="+", default=["1x128x128", "16x64x0", "8192x64x0"])
    p.add_argument("--hlo-dir")
    p.add_argument("--temps", metavar="DUMP_DIR", help="the XLA_FLAGS --xla_dump_to folder")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--impl", default="auto", help="kernels (compile time with and without)")
    args = p.parse_args()
    cfg = load_config(args.model)
    dtype = DTYPES[args.dtype]
    ecfg = EngineConfig(max_model_len=args.max_model_len)
    spec = CacheSpec(args.slots, args.pages, ecfg.page_size, ecfg.ssm_dtype)
    runner = ModelRunner(
        cfg, param_shapes(cfg, dtype), spec, dtype=dtype, impl=args.impl, allocate=False
    )
    builder = StepBuilder(spec, ecfg.max_pages_per_seq, cfg.vocab_size, cfg.chunk_size)
    leaves = jax.tree.leaves(runner.cache)
    cache_gib = sum(a.size * jnp.dtype(a.dtype).itemsize for a in leaves) / GiB
    shapes = {",".join(map(str, a.shape)): a for a in leaves}
    print(f"{args.model} cache {cache_gib:.2f} GiB ({args.slots} slots, {args.pages} pages)")
    for text in args.buckets:
        bucket = Bucket(*map(int, text.split("x")))
        start = time.perf_counter()
        compiled = runner._compile((bucket, FULL), builder.padding(bucket))
        secs = time.perf_counter() - start
        hlo = compiled.as_text()
        copies = re.findall(r"= \w+\[([\d,]+)\]\{[^}]*\} copy\(", hlo)
        big = [s for s in copies if s in shapes]
        big_gib = sum(shapes[s].size * jnp.dtype(shapes[s].dtype).itemsize for s in big) / GiB
        m = compiled.memory_analysis()
        gib = lambda n: f"{n / GiB:.2f}"  # noqa: E731
        print(
            f"{text}: compile {secs:.1f} s; beyond arguments {gib(program_bytes(compiled))} GiB "
            f"(temp {gib(m.temp_size_in_bytes)}, output {gib(m.output_size_in_bytes)}, "
            f"aliased {gib(m.alias_size_in_bytes)}); copies of cache arrays: {len(big)} "
            f"({big_gib:.2f} GiB) {sorted(set(big))[:4]}",
            flush=True,
        )
        if args.hlo_dir:
            with open(f"{args.hlo_dir}/{text}.hlo", "w") as f:
                f.write(hlo)

    if args.temps:
        largest_temporaries(args.temps, args.top)


def largest_temporaries(dump_dir: str, top: int) -> None:
    """The largest values of each step's preallocated temp buffer, from XLA's dumps."""
    import glob

    value = re.compile(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\)")
    for path in sorted(glob.glob(f"{dump_dir}/*jit_step_fn*buffer-assignment.txt")):
        text = open(path).read()
        block = r"^allocation \d+: size (\d+), preallocated-temp:\n(.*?)(?=^allocation|\Z)"
        temp = re.search(block, text, re.M | re.S)
        if temp is None:
            continue
        rows = sorted(((int(n), int(o), name) for name, n, o in value.findall(temp.group(2))),
                      reverse=True)  # fmt: skip
        print(f"{path.rsplit('/', 1)[-1]}: temp {int(temp.group(1)) / GiB:.2f} GiB")
        for size, offset, name in rows[:top]:
            print(f"  {size / GiB:8.3f} GiB at {offset / GiB:8.3f}  {name}")


if __name__ == "__main__":
    main()
