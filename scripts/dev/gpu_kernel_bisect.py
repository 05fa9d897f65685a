"""Which compiled kernel makes a tiny family model's logits wrong on the GPU: the Falcon-H1
test checkpoint's packed prefill under `impl="auto"`, then with one op at a time sent to its
plain-jnp reference (and to its GPU kernel in interpret mode), each against HF transformers
(torch, CPU) in float32 and bfloat16. The op whose `ref` (or interpreted kernel) brings the
error back to the `impl="ref"` row is the culprit.

    python3 scripts/dev/gpu_kernel_bisect.py             # on the GPU machine, from the checkout
    python3 scripts/dev/gpu_kernel_bisect.py --quick     # bf16 on the plain checkpoint only
    python3 scripts/dev/gpu_kernel_bisect.py --variants  # bf16: every op ref at once, small-M off
"""

from __future__ import annotations

import copy
import functools
import importlib
import os
import re
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from family_checks import hf_logits  # noqa: E402
from test_family_falcon_h1 import MULTIPLIERS, make_falcon  # noqa: E402

from jaxmamba.engine.batch import Bucket  # noqa: E402
from jaxmamba.engine.runner import ModelRunner  # noqa: E402
from jaxmamba.model.cache import CacheSpec  # noqa: E402
from jaxmamba.model.families import load_config  # noqa: E402
from jaxmamba.model.loader import load_hf_checkpoint  # noqa: E402

from model_helpers import builder, random_prompts, row  # noqa: E402

KERNEL_PACKAGES = ("attention", "conv1d", "gated_norm", "gdn", "mamba_decode", "matmul", "ssd",
                   "state_update", "grouped_matmul")  # fmt: skip
# The ops a prefill-only step of an attention + Mamba2 model runs.
PREFILL_OPS = ("attention_query_blocks", "paged_attention", "causal_conv1d_varlen",
               "gated_group_rmsnorm", "ssd_varlen", "small_m_matmul")  # fmt: skip
FORCED: dict[str, str] = {}  # op name -> impl it runs with, whatever the model asks


def _forcing(select_impl):
    @functools.wraps(select_impl)
    def select(op, impl, **kw):
        return select_impl(op, FORCED.get(op, impl), **kw)

    return select


def patch_dispatch() -> list[str]:
    """Route every kernel package's `select_impl` through `FORCED`; returns the op names seen."""
    for name in KERNEL_PACKAGES:
        mod = importlib.import_module(f"jaxmamba.kernels.{name}")
        if hasattr(mod, "select_impl"):
            mod.select_impl = _forcing(mod.select_impl)
    ops = set()
    for path in (Path(__file__).resolve().parents[2] / "kernels").glob("*/__init__.py"):
        ops.update(re.findall(r'select_impl\(\s*"([a-z0-9_]+)"', path.read_text()))
    return sorted(ops)


def logits_err(path, model, dtype, impl: str, lengths, small_m_impl=None) -> float:
    # `jitted_logits` is one module-level jit keyed on the model's fields, which `FORCED` does
    # not change: without this every forced row would rerun the first `auto` executable.
    jax.clear_caches()
    cfg = load_config(str(path))
    params = load_hf_checkpoint(path, cfg, dtype=dtype)
    spec = CacheSpec(num_slots=8, num_pages=8 * 16, page_size=16)
    runner = ModelRunner(cfg, params, spec, dtype=dtype, impl=impl, small_m_impl=small_m_impl)
    prompts = random_prompts(np.random.default_rng(0), lengths, cfg.vocab_size)
    rows = [row(p, 0, slot) for slot, p in enumerate(prompts)]
    inputs = builder(runner).build(rows, Bucket(sum(lengths) + 5, len(rows), 0))
    logits = np.asarray(runner.forward_logits(inputs, 0), np.float32)
    hf = copy.deepcopy(model).to(torch.bfloat16 if dtype == jnp.bfloat16 else torch.float32)
    worst, start = 0.0, 0
    for p in prompts:
        ref = hf_logits(hf, p)
        scale = max(1.0, float(np.abs(ref).max()))
        worst = max(worst, float(np.abs(logits[start : start + len(p)] - ref).max()) / scale)
        start += len(p)
    return worst


def variants(path, model, lengths) -> None:
    """What differs between `impl="ref"` and `"auto"` beside the ops' dispatch: every op sent
    to its reference at once, the small-M projection kernel off, and the reference run with
    the small-M kernel on."""
    from jaxmamba.kernels.matmul import SMALL_M_ENV

    bf16 = jnp.bfloat16
    rows = [("ref", "-", logits_err(path, model, bf16, "ref", lengths)),
            ("auto", "-", logits_err(path, model, bf16, "auto", lengths))]  # fmt: skip
    FORCED.update({op: "ref" for op in PREFILL_OPS})
    rows.append(("auto", "every op ref", logits_err(path, model, bf16, "auto", lengths)))
    FORCED.clear()
    os.environ[SMALL_M_ENV] = "0"
    rows.append(("auto", "small-M off", logits_err(path, model, bf16, "auto", lengths)))
    del os.environ[SMALL_M_ENV]
    rows.append(("ref", "small-M pallas", logits_err(path, model, bf16, "ref", lengths, "pallas")))
    for impl, what, err in rows:
        print(f"bf16 {impl:5} {what:16} {err:.3g}", flush=True)


def main() -> None:
    print("backend", jax.default_backend(), jax.__version__)
    if "--variants" in sys.argv:
        patch_dispatch()
        path, model = make_falcon(Path(tempfile.mkdtemp()) / "a", num_layers=2, n_groups=2,
                                  seed=0, **MULTIPLIERS)  # fmt: skip
        variants(path, model, [1, 7, 21, 11])
        return
    ops = patch_dispatch()
    tmp = Path(tempfile.mkdtemp())
    models = {
        "falcon-plain": make_falcon(tmp / "a", num_layers=2, n_groups=2, seed=0, **MULTIPLIERS),
        "falcon-normed": make_falcon(
            tmp / "b", num_layers=3, n_groups=4, seed=1, mamba_rms_norm=True,
            mamba_norm_before_gate=False, mamba_proj_bias=True, projectors_bias=True,
            attention_bias=True, **MULTIPLIERS,
        ),
    }  # fmt: skip
    lengths = [1, 7, 21, 11]
    dtypes = (jnp.float32, jnp.bfloat16)
    if "--quick" in sys.argv:  # bf16 on the plain checkpoint only
        models, dtypes = {"falcon-plain": models["falcon-plain"]}, (jnp.bfloat16,)
    rows = []
    for name, (path, model) in models.items():
        for dtype in dtypes:
            dn = jnp.dtype(dtype).name
            for impl in ("ref", "auto"):
                rows.append((name, dn, impl, "-", logits_err(path, model, dtype, impl, lengths)))
            for op in [o for o in ops if o in PREFILL_OPS]:
                for forced in ("ref", "interpret"):
                    FORCED.clear()
                    FORCED[op] = forced
                    try:
                        err = logits_err(path, model, dtype, "auto", lengths)
                    except Exception as e:  # noqa: BLE001 - a table of what ran
                        err = float("nan")
                        print(f"{name} {dn} {op}={forced}: {type(e).__name__}: {e}"[:300])
                    rows.append((name, dn, "auto", f"{op}={forced}", err))
            FORCED.clear()
    print(f"{'model':14} {'dtype':8} {'impl':5} {'forced':28} rel err")
    for r in rows:
        print(f"{r[0]:14} {r[1]:8} {r[2]:5} {r[3]:28} {r[4]:.3g}")


if __name__ == "__main__":
    main()
