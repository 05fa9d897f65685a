"""What a step builds once: the layouts every layer's kernels read are computed once per
forward, not once per layer.

The test reads the step as XLA receives it — the HLO module (StableHLO) of the jitted engine
step lowered for CUDA and for TPU with every op on its kernel — and counts how many times each
layout is computed in it. The layouts are built under named scopes (`attention_query_blocks`,
`ssd_chunk_layout`, `ssd_tracked_requests`, `conv_token_starts`), which every op's location
carries in its name stack; a computation is one distinct scope path in a function, times the
number of times that function is called (jitted kernel wrappers are outlined functions, called
once per layer). The module as lowered is read rather than the one XLA optimizes, because CSE
could merge per-layer copies there and hide them — and a CPU compile of the kernels needs
interpret mode (tens of seconds a step). Lowering needs no GPU or TPU.
"""

from __future__ import annotations

import functools
import re
from collections import Counter

import jax
import numpy as np
import pytest

from jaxmamba.engine.batch import Bucket
from jaxmamba.engine.runner import ModelRunner, jitted_step
from jaxmamba.model.cache import CacheSpec
from jaxmamba.model.families import config_from_preset
from jaxmamba.model.params import init_params

from model_helpers import MAX_PAGES, PAGE_SIZE, builder, row

SCOPES = ("attention_query_blocks", "ssd_chunk_layout", "ssd_tracked_requests", "conv_token_starts")
IMPLS = {"cuda": "auto_gpu", "tpu": "auto_tpu"}


def _expand_locations(text: str):
    defs = dict(re.findall(r"^(#loc\d+) = loc\((.*)\)$", text, re.M))

    @functools.cache
    def expand(name: str) -> str:
        return re.sub(r"#loc\d+", lambda m: expand(m.group(0)), defs[name])

    return expand


def _name_stack(location: str) -> str:
    m = re.match(r'"([^"]*)"', location)  # a NameLoc: the op's name stack comes first
    return m.group(1) if m else ""


def computations_per_scope(module_text: str) -> Counter:
    """How many times each scope of SCOPES is computed when the module's main runs."""
    expand = _expand_locations(module_text)
    funcs: dict[str, list[str]] = {}
    current = None
    for line in module_text.splitlines():
        head = re.match(r"\s*func\.func (?:public |private )?@([\w$.-]+)\(", line)
        if head:
            current = funcs.setdefault(head.group(1), [])
        if current is not None:
            current.append(line)
    if "main" not in funcs:
        raise AssertionError("no main function in the lowered module")

    @functools.cache
    def count(func: str) -> Counter:
        # Inside an outlined function the ops' name stacks are relative to its caller; only its
        # `return` and closing brace carry the caller's location, so they are skipped.
        paths = set()
        found: Counter = Counter()
        for line in funcs[func]:
            body = line.strip()
            loc = re.search(r"loc\((#loc\d+)\)\s*$", body)
            if loc and not body.startswith(("return", "func.return", "}")):
                stack = _name_stack(expand(loc.group(1))).split("/")
                paths |= {
                    (scope, "/".join(stack[: stack.index(scope) + 1]))
                    for scope in SCOPES
                    if scope in stack
                }
            for callee in re.findall(r"\bcall @([\w$.-]+)\(", body):
                found += count(callee)
        found.update(scope for scope, _ in paths)
        return found

    return count("main")


@pytest.fixture(scope="module")
def model_parts():
    cfg = config_from_preset("nemotron-h-tiny")
    assert len(cfg.mamba_layers) >= 2 and len(cfg.attention_layers) >= 2
    return cfg, init_params(cfg, seed=0)


def lowered_step(cfg, params, platform: str, rows, bucket: Bucket) -> str:
    spec = CacheSpec(num_slots=8, num_pages=8 * MAX_PAGES, page_size=PAGE_SIZE)
    runner = ModelRunner(cfg, params, spec, impl=IMPLS[platform])
    inputs = builder(runner).build(rows, bucket)
    args, kwargs = runner.step_args(jax.device_put(inputs), bucket.num_decode)
    traced = jitted_step.trace(*args, **kwargs)
    return traced.lower(lowering_platforms=(platform,)).as_text(debug_info=True)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_mixed_step_builds_every_layout_once(model_parts, platform):
    cfg, params = model_parts
    rng = np.random.default_rng(0)
    prompt = lambda n: rng.integers(0, 256, n).tolist()  # noqa: E731
    rows = [
        row([3], 5, slot=0),
        row([4], 9, slot=1),
        row(prompt(37), 0, slot=2, track_slot=6, track_len=32),
        row(prompt(11), 16, slot=3),
    ]
    text = lowered_step(cfg, params, platform, rows, Bucket(64, 4, 2))
    assert "custom_call" in text  # the kernels are in the module, not the references
    assert computations_per_scope(text) == Counter({scope: 1 for scope in SCOPES})


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_decode_step_builds_query_blocks_once(model_parts, platform):
    cfg, params = model_parts
    rows = [row([5 + i], 7 + 3 * i, slot=i) for i in range(4)]
    text = lowered_step(cfg, params, platform, rows, Bucket(4, 4, 4))
    assert computations_per_scope(text) == Counter({"attention_query_blocks": 1})
