"""`StepBuilder.build` (vectorized) against a plain row-by-row construction of the same
`StepInputs`, on random steps: decode and prefill rows, filler decode rows, forks,
checkpoints, prompt logprobs, every sampling field; and its checks name the bad row."""

from __future__ import annotations

import numpy as np
import pytest

from jaxmamba.engine.batch import Bucket, RowSpec, StepBuilder
from jaxmamba.step_contract import (
    MAX_DECODE_CHECKPOINTS,
    MAX_FORKS,
    MAX_LOGIT_BIAS,
    MAX_PREFILL_CHECKPOINTS,
    MAX_STOP_IDS,
    CacheSpec,
    StepInputs,
)

SPEC = CacheSpec(num_slots=48, num_pages=400, page_size=4)
MAX_PAGES, VOCAB, CHUNK = 10, 97, 4
BUILDER = StepBuilder(SPEC, MAX_PAGES, VOCAB, CHUNK)


def reference(rows: list[RowSpec], bucket: Bucket, num_decode_rows: int) -> dict:
    """The arrays, one row at a time, from StepInputs' documented layout."""
    T, B, nd = bucket.num_tokens, bucket.num_rows, bucket.num_decode
    ps, pp = SPEC.pad_slot, SPEC.pad_page
    if 0 < nd < B:  # filler decode rows: one token on the pad slot
        rows = rows[:num_decode_rows] + [None] * (nd - num_decode_rows) + rows[num_decode_rows:]
    a = dict(
        input_ids=np.zeros(T, np.int32), tokens_from_device=np.zeros(B, bool),
        query_start_loc=np.zeros(B + 1, np.int32), prefix_lens=np.zeros(B, np.int32),
        state_slots=np.full(B, ps, np.int32), init_slots=np.full(B, ps, np.int32),
        has_initial_state=np.zeros(B, bool),
        track_slots=np.full((B, MAX_PREFILL_CHECKPOINTS), ps, np.int32),
        track_lens=np.zeros((B, MAX_PREFILL_CHECKPOINTS), np.int32),
        page_table=np.full((B, MAX_PAGES), pp, np.int32), temperature=np.zeros(B, np.float32),
        top_p=np.ones(B, np.float32), top_k=np.zeros(B, np.int32), seeds=np.zeros(B, np.uint32),
        sample_counters=np.zeros(B, np.int32), min_p=np.zeros(B, np.float32),
        min_tokens=np.zeros(B, np.int32), stop_ids=np.full((B, MAX_STOP_IDS), -1, np.int32),
        logit_bias_ids=np.full((B, MAX_LOGIT_BIAS), -1, np.int32),
        logit_bias_values=np.zeros((B, MAX_LOGIT_BIAS), np.float32),
        presence_penalty=np.zeros(B, np.float32), frequency_penalty=np.zeros(B, np.float32),
        repetition_penalty=np.ones(B, np.float32), penalty_reset=np.zeros(B, bool),
        prompt_logprob_targets=np.full(T, -1, np.int32),
        fork_src_slots=np.full(MAX_FORKS, ps, np.int32),
        fork_dst_slots=np.full(MAX_FORKS, ps, np.int32),
        fork_src_pages=np.full(MAX_FORKS, pp, np.int32),
        fork_dst_pages=np.full(MAX_FORKS, pp, np.int32),
        token_bitmask=None,  # sent only with a constrained row (tests/test_structured_engine.py)
        lens_from_device=None,  # sent only by a speculating engine (tests/test_speculative.py)
    )  # fmt: skip
    pos, f = 0, 0
    for r, row in enumerate(rows):
        if row is None:
            pos += 1
            a["query_start_loc"][r + 1] = pos
            continue
        for j, t in enumerate(row.tokens):
            a["input_ids"][pos + j] = t
            if row.prompt_logprob_targets and j < len(row.prompt_logprob_targets):
                a["prompt_logprob_targets"][pos + j] = row.prompt_logprob_targets[j]
        pos += len(row.tokens)
        a["query_start_loc"][r + 1] = pos
        a["tokens_from_device"][r] = row.token_from_device
        a["prefix_lens"][r] = row.prefix_len
        a["state_slots"][r] = row.state_slot
        if row.fork:
            init = ps
        else:
            init = row.state_slot if row.init_slot is None else row.init_slot
        a["init_slots"][r] = init
        a["has_initial_state"][r] = row.prefix_len > 0 and not row.fork
        a["penalty_reset"][r] = row.prefix_len == 0 or init != row.state_slot
        for k, (slot, length) in enumerate(row.checkpoints):
            a["track_slots"][r, k], a["track_lens"][r, k] = slot, length
        for k, page in enumerate(row.pages):
            a["page_table"][r, k] = page
        for name, field in [("temperature", "temperature"), ("top_p", "top_p"),
                            ("top_k", "top_k"), ("sample_counters", "sample_counter"),
                            ("min_p", "min_p"), ("presence_penalty", "presence_penalty"),
                            ("frequency_penalty", "frequency_penalty"),
                            ("repetition_penalty", "repetition_penalty")]:  # fmt: skip
            a[name][r] = getattr(row, field)
        a["seeds"][r] = row.seed % 2**32
        if row.min_tokens > 0:
            a["min_tokens"][r] = row.min_tokens
            for k, t in enumerate(row.stop_ids):
                a["stop_ids"][r, k] = t
        for k, (t, v) in enumerate((row.logit_bias or {}).items()):
            a["logit_bias_ids"][r, k], a["logit_bias_values"][r, k] = t, v
        for slot, src, dst in row.forks:
            a["fork_src_slots"][f], a["fork_dst_slots"][f] = row.state_slot, slot
            if src is not None:
                a["fork_src_pages"][f], a["fork_dst_pages"][f] = src, dst
            f += 1
    a["query_start_loc"][len(rows) + 1 :] = pos
    return a


def sampling(rng) -> dict:
    kw = dict(
        temperature=float(rng.choice([0.0, 0.7, 1.3])), top_p=float(rng.choice([1.0, 0.9])),
        top_k=int(rng.choice([0, 5])), seed=int(rng.integers(0, 2**40)),
        sample_counter=int(rng.integers(0, 50)), min_p=float(rng.choice([0.0, 0.05])),
        presence_penalty=float(rng.choice([0.0, 0.5])),
        frequency_penalty=float(rng.choice([0.0, -0.3])),
        repetition_penalty=float(rng.choice([1.0, 1.2])),
    )  # fmt: skip
    if rng.random() < 0.3:
        kw["min_tokens"] = int(rng.integers(1, 9))
        kw["stop_ids"] = tuple(rng.choice(VOCAB, int(rng.integers(0, 4)), replace=False).tolist())
    elif rng.random() < 0.2:
        kw["stop_ids"] = (3, 4)  # ignored without min_tokens
    if rng.random() < 0.3:
        ids = rng.choice(VOCAB, int(rng.integers(1, 5)), replace=False).tolist()
        kw["logit_bias"] = {t: float(rng.normal()) for t in ids}
    return kw


def pages(rng, length: int) -> list[int]:
    need = -(-length // SPEC.page_size)
    n = int(rng.integers(need, MAX_PAGES + 1))
    return rng.choice(SPEC.num_pages, n, replace=False).tolist()


def random_step(rng) -> tuple[list[RowSpec], Bucket, int]:
    slots = iter(rng.permutation(SPEC.num_slots).tolist())
    if rng.random() < 0.4:  # pure decode
        b = int(rng.choice([1, 4, 8]))
        num_decode, nd, num_prefill = int(rng.integers(1, b + 1)), b, 0
        bucket = Bucket(b, b, b)
    else:
        nd = int(rng.choice([0, 2, 4]))
        num_decode = int(rng.integers(0, nd + 1))
        num_prefill = int(rng.integers(1, 6))
        bucket = None
    rows, decode_checkpoints = [], 0
    for _ in range(num_decode):
        prefix = int(rng.integers(1, MAX_PAGES * SPEC.page_size))
        spec = RowSpec([int(rng.integers(VOCAB))], prefix, next(slots), pages(rng, prefix + 1),
                       token_from_device=bool(rng.random() < 0.7), **sampling(rng))  # fmt: skip
        if rng.random() < 0.3 and decode_checkpoints < MAX_DECODE_CHECKPOINTS:
            spec.track_slot, spec.track_len = next(slots), prefix + 1
            decode_checkpoints += 1
        if rng.random() < 0.2:
            spec.init_slot = next(slots)
        rows.append(spec)
    forks_left, prefill_rows = MAX_FORKS, 0
    while prefill_rows < num_prefill:
        n = int(rng.integers(1, 9))
        prefix = int(rng.choice([0, 0, int(rng.integers(0, 20))]))
        end = prefix + n
        spec = RowSpec(rng.integers(0, VOCAB, n).tolist(), prefix, next(slots),
                       pages(rng, end), **sampling(rng))  # fmt: skip
        if prefix and rng.random() < 0.3:
            spec.init_slot = next(slots)
        if rng.random() < 0.3:
            spec.prompt_logprob_targets = rng.integers(
                0, VOCAB, int(rng.integers(1, n + 1))
            ).tolist()
        aligned = [c for c in range(prefix + 1, end) if c % CHUNK == 0]
        if rng.random() < 0.4:
            spec.track_slot, spec.track_len = next(slots), end
            if aligned and rng.random() < 0.5:
                spec.tracks = [(next(slots), int(rng.choice(aligned)))]
        rows.append(spec)
        prefill_rows += 1
        k = min(int(rng.integers(0, 3)), forks_left, num_prefill - prefill_rows)
        for _ in range(k if rng.random() < 0.4 else 0):
            slot = next(slots)
            partial = end % SPEC.page_size != 0 and rng.random() < 0.7
            src, dst = rng.integers(SPEC.num_pages, size=2).tolist() if partial else (None, None)
            spec.forks.append((slot, src, dst))
            rows.append(RowSpec([], end, slot, pages(rng, end), fork=True, **sampling(rng)))
            forks_left -= 1
            prefill_rows += 1
    if bucket is None:
        tokens = nd + sum(len(r.tokens) for r in rows[num_decode:])
        bucket = Bucket(
            tokens + int(rng.integers(1, 6)), nd + num_prefill + int(rng.integers(0, 3)), nd
        )
    return rows, bucket, num_decode


def test_build_matches_a_row_by_row_construction_on_random_steps():
    rng = np.random.default_rng(0)
    kinds = set()
    for _ in range(300):
        rows, bucket, num_decode = random_step(rng)
        got = BUILDER.build(rows, bucket, num_decode)
        want = reference(rows, bucket, num_decode)
        assert set(want) == set(StepInputs._fields)
        for name in StepInputs._fields:
            g, w = getattr(got, name), want[name]
            if w is None:
                assert g is None, name
                continue
            assert g.dtype == w.dtype and g.shape == w.shape, name
            np.testing.assert_array_equal(g, w, err_msg=name)
        kinds.add((bucket.num_decode == bucket.num_rows, any(r.fork for r in rows),
                   num_decode < bucket.num_decode < bucket.num_rows))  # fmt: skip
    assert len(kinds) >= 4  # pure decode, forks, filler decode rows all met


@pytest.mark.parametrize("bucket", [Bucket(16, 6, 2), Bucket(16, 6, 0), Bucket(4, 4, 4)])
def test_padding_is_every_row_on_the_pad_slot(bucket):
    got = BUILDER.padding(bucket)
    want = reference([], bucket, 0)
    for name in StepInputs._fields:
        if want[name] is None:
            assert getattr(got, name) is None, name
            continue
        np.testing.assert_array_equal(getattr(got, name), want[name], err_msg=name)


BREAKS = {
    "a token outside the vocab": lambda r: setattr(r, "tokens", [*r.tokens[:-1], VOCAB]),
    "a negative token": lambda r: setattr(r, "tokens", [-1, *r.tokens[1:]]),
    "too few pages": lambda r: setattr(r, "pages", r.pages[: -(-r.seq_len // 4) - 1]),
    "too long": lambda r: setattr(r, "prefix_len", MAX_PAGES * 4),
    "a stop id outside the vocab": lambda r: (setattr(r, "min_tokens", 2),
                                               setattr(r, "stop_ids", (VOCAB + 3,))),
    "too many logit_bias entries": lambda r: setattr(
        r, "logit_bias", {t: 1.0 for t in range(MAX_LOGIT_BIAS + 1)}),
    "a checkpoint on its own slot": lambda r: (setattr(r, "track_slot", r.state_slot),
                                                setattr(r, "track_len", r.seq_len)),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(BREAKS))
def test_a_bad_row_raises_naming_that_row(kind):
    rng = np.random.default_rng(len(kind))
    for _ in range(20):
        rows, bucket, num_decode = random_step(rng)
        r = int(rng.integers(len(rows)))
        if rows[r].fork:
            continue
        BREAKS[kind](rows[r])
        if rows[r].track_slot == rows[r].state_slot:
            rows[r].tracks = []
        with pytest.raises(ValueError) as err:
            BUILDER.build(rows, bucket, num_decode)
        filler = (
            bucket.num_decode - num_decode
            if r >= num_decode and bucket.num_decode < bucket.num_rows
            else 0
        )
        assert f"row {r + filler}" in str(err.value), (kind, str(err.value))


def test_decode_rows_must_carry_one_token_and_only_they_read_the_device():
    rows = [RowSpec([1, 2], 3, 0, [0, 1]), RowSpec([5], 0, 1, [2])]
    with pytest.raises(ValueError, match="decode row 0 must carry exactly 1 token"):
        BUILDER.build(rows, Bucket(8, 3, 1))
    rows = [RowSpec([1], 3, 0, [0]), RowSpec([5, 6], 0, 1, [2], token_from_device=True)]
    with pytest.raises(ValueError, match="row 1 takes its token from the device"):
        BUILDER.build(rows, Bucket(8, 3, 1))
    with pytest.raises(ValueError, match="row 1 has no tokens"):
        BUILDER.build([RowSpec([1], 3, 0, [0]), RowSpec([], 0, 1, [2])], Bucket(8, 3, 1))


@pytest.mark.parametrize("bucket", [Bucket(16, 4, 0), Bucket(4, 4, 4)])
def test_packed_inputs_are_one_buffer_that_unpacks_to_every_field_bit_for_bit(bucket):
    """The runner hands a step one int32 buffer (one host→device copy); inside the step it
    unpacks to the builder's fields with their shapes, dtypes and bits (NaN payloads, large
    uint32 seeds, negative ids, bools), and fields a bucket leaves out stay None."""
    import jax

    from jaxmamba.model.metadata import PackedStepInputs

    rng = np.random.default_rng(3)
    inputs = BUILDER.padding(bucket)
    noisy = {}
    for name, value in zip(inputs._fields, inputs, strict=True):
        if value is None:
            continue
        a = np.asarray(value)
        if a.dtype == np.float32:
            a = rng.standard_normal(a.shape).astype(np.float32)
            a.flat[0] = np.float32("nan")
        elif a.dtype == np.uint32:
            a = rng.integers(2**31, 2**32, a.shape, dtype=np.uint32)
        elif a.dtype == np.int32:
            a = rng.integers(-(2**31), 2**31 - 1, a.shape, dtype=np.int32)
        else:
            a = rng.random(a.shape) < 0.5
        noisy[name] = a
    inputs = inputs._replace(**noisy)
    packed = PackedStepInputs.pack(inputs)
    assert len(jax.tree.leaves(packed)) == 1 and packed.buffer.dtype == np.int32
    unpacked = jax.jit(lambda p: p.unpack())(packed)
    for name, value in zip(inputs._fields, inputs, strict=True):
        got = getattr(unpacked, name)
        if value is None:
            assert got is None, name
            continue
        got = np.asarray(got)
        assert got.dtype == np.asarray(value).dtype and got.shape == np.shape(value), name
        np.testing.assert_array_equal(got.view(np.uint8), np.asarray(value).view(np.uint8),
                                      err_msg=name)  # fmt: skip
