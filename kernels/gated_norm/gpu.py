"""Pallas GPU kernel (Triton lowering) for the gated group RMSNorm.

One pass over HBM: grid ``(T / rows, G)``; a program loads its ``[rows, W/G]`` block of y and
of z (read in place from the in_proj output at a static column offset, so XLA passes the whole
array and copies no slice), computes ``y * silu(z)`` in float32, keeps it in registers while it
sums the squares of each row, and writes ``scale * gated * rsqrt(mean + eps)`` in the output
dtype. Each element of y and z is read once and each output written once: 3 × T × W × 2 bytes
for bf16 (T = 2048, W = 10240: 126 MB, ~26 µs at 4.8 TB/s).

Triton tiles are powers of two and a group needn't be one (1280 columns at 9B shapes, 80 in
the tests), so a group is covered by its binary digits: power-of-two pieces, widest first
(1280 = 1024 + 256), none wider than ``GpuBlockSizes.piece``. Every piece starts at a
multiple of its own width inside the group, so no column is masked and the loads stay
aligned. Only rows past T are masked, where T is not a multiple of the program's rows.
Every load of a program is issued before any arithmetic waits on one.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ..common import pallas_call, pow2_at_least, pow2_divisor, silu

_F32 = jnp.float32
# Float32 values of the group a thread holds at most before the warps grow (registers:
# the gated values, plus the raw loads while they are converted).
_MAX_PER_THREAD = 64
_MAX_WARPS = 16


@dataclasses.dataclass(frozen=True)
class GpuBlockSizes:
    """A program's rows and the widest piece a group is loaded in.

    A program takes the most rows (a power of two) with ``rows × W/G <= elements``, halved
    while the grid has fewer than ``min_programs`` programs (decode steps: T of 1..256). The
    warps are ``num_warps``, more where a thread would hold over 64 float32 values.

    Defaults, reasoned for the H200 (132 SMs, 4.8 TB/s; ``python3 scripts/bench_gated_norm.py
    --sweep`` times the alternatives): at 9B shapes a program is 4 rows × 1280 columns on
    4 warps — 20 KB of y and z in flight, 40 float32 values a thread (about 5 programs an SM
    by registers: ~100 KB an SM in flight, above the ~36 KB that 4.8 TB/s × ~1 µs of latency
    needs), a 256-column piece is then one 16-byte load a thread, and 2048 tokens make 4096
    programs. ``min_programs`` is two programs an SM.
    """

    elements: int = 8192  # rows × group width a program at most (one row at least)
    piece: int = 1024  # widest power-of-two load along a group
    min_programs: int = 264
    num_warps: int = 4

    @classmethod
    def get_default(cls) -> GpuBlockSizes:
        return cls()

    def block_rows(self, num_rows: int, num_groups: int, group_width: int) -> int:
        rows = _pow2_floor(max(1, self.elements // group_width))
        while rows > 1 and pl.cdiv(num_rows, rows) * num_groups < self.min_programs:
            rows //= 2
        return rows

    def warps(self, rows: int, group_width: int) -> int:
        needed = pow2_at_least(pl.cdiv(rows * group_width, 32 * _MAX_PER_THREAD))
        return max(self.num_warps, min(_MAX_WARPS, needed))


def _pow2_floor(n: int) -> int:
    """The largest power of two <= ``n`` (n >= 1)."""
    return 1 << (n.bit_length() - 1)


def group_pieces(width: int, widest: int) -> tuple[tuple[int, int], ...]:
    """``(offset, width)`` of the power-of-two pieces covering ``width`` columns, widest first
    and none wider than ``widest`` (a power of two): each starts at a multiple of its width."""
    pieces, offset = [], 0
    while offset < width:
        size = min(widest, _pow2_floor(width - offset))
        pieces.append((offset, size))
        offset += size
    return tuple(pieces)


def _kernel(
    rows: int,
    pieces: tuple[tuple[int, int], ...],
    group_width: int,
    z_offset: int,
    eps: float,
    num_rows: int,
    y_ref,  # [T, W]
    z_ref,  # [T, Wz]
    scale_ref,  # [W]
    out_ref,  # [T, W]
):
    r0 = pl.multiple_of(pl.program_id(0) * rows, rows)
    c0 = pl.program_id(1) * group_width
    row_block = pl.ds(r0, rows)
    mask = None
    if num_rows % rows:
        mask = (r0 + jnp.arange(rows) < num_rows)[:, None]

    def columns(offset, size, base):  # aligned to the piece, the group and the base offset
        align = pow2_divisor(group_width, size)
        align = pow2_divisor(base, align) if base else align
        return pl.ds(pl.multiple_of(base + c0 + offset, align), size)

    def load(ref, cols, size):
        block = ref.at[row_block, cols]
        if mask is None:
            return block[...]
        return pltriton.load(block, mask=jnp.broadcast_to(mask, (rows, size)), other=0)

    ys = [load(y_ref, columns(off, size, 0), size) for off, size in pieces]
    zs = [load(z_ref, columns(off, size, z_offset), size) for off, size in pieces]
    scales = [scale_ref[columns(off, size, 0)] for off, size in pieces]
    gated = [y.astype(_F32) * silu(z.astype(_F32)) for y, z in zip(ys, zs, strict=True)]
    square_sum = jnp.sum(gated[0] * gated[0], axis=1)  # [rows]
    for g in gated[1:]:
        square_sum = square_sum + jnp.sum(g * g, axis=1)
    inv_rms = lax.rsqrt(square_sum * (1.0 / group_width) + eps)[:, None]
    for (off, size), g, s in zip(pieces, gated, scales, strict=True):
        out = (s.astype(_F32)[None, :] * (g * inv_rms)).astype(out_ref.dtype)
        block = out_ref.at[row_block, columns(off, size, 0)]
        if mask is None:
            block[...] = out
        else:
            pltriton.store(block, out, mask=jnp.broadcast_to(mask, (rows, size)))


def gated_group_rmsnorm_gpu(
    y: jax.Array,  # [T, W]
    z_source: jax.Array,  # [T, Wz] z is columns [z_offset, z_offset + W)
    scale: jax.Array,  # [W]
    *,
    num_groups: int,
    eps: float,
    z_offset: int = 0,
    out_dtype=None,
    interpret: bool = False,
    block_sizes: GpuBlockSizes | None = None,
) -> jax.Array:
    bs = block_sizes or GpuBlockSizes.get_default()
    if bs.piece < 1 or bs.piece & (bs.piece - 1):
        raise ValueError(f"piece must be a power of two, got {bs.piece}")
    num_rows, width = y.shape
    out_dtype = jnp.dtype(out_dtype or y.dtype)
    if num_rows == 0:  # an empty grid does not launch
        return jnp.zeros(y.shape, out_dtype)
    group_width = width // num_groups
    rows = bs.block_rows(num_rows, num_groups, group_width)
    kernel = functools.partial(
        _kernel, rows, group_pieces(group_width, bs.piece), group_width, z_offset, float(eps),
        num_rows,
    )  # fmt: skip
    return pallas_call(
        kernel,
        grid=(pl.cdiv(num_rows, rows), num_groups),
        out_shape=jax.ShapeDtypeStruct(y.shape, out_dtype),
        compiler_params=pltriton.CompilerParams(
            num_warps=bs.warps(rows, group_width), num_stages=1
        ),
        interpret=interpret,
        name="gated_group_rmsnorm",
    )(y, z_source, scale)
