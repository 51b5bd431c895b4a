"""The peer-memory all-reduce schedule: buffer layout, size selection, launch shape, and a CPU emulation.

Pure Python (no torch, no CUDA): CI tests it, and the CuTe DSL kernel (``kernels/allreduce_cute.py``) uses the
same ``Layout`` and ``block_range`` so that what the emulation proves is what the device runs.

Protocol (N ranks, per call; block b of every rank handles the same vector range of every region):
  epoch   every block keeps a counter in its own rank's buffer; each call advances all ``max_blocks`` counters
          by one (block 0 bumps those not launched), so every block of every rank sees the same epoch e = call
          index + 1. Flags are only ever raised to the current epoch: no reset between calls, and a CUDA graph
          replay reads the counter from memory instead of a baked-in argument.
  one_shot  block b pushes its range of the input to slot[rank] of every rank (the parity half e % 2), raises
          flag[0][b][rank] on every rank, waits for flag[0][b][j] >= e for all j, then sums slot[0..N-1] in
          global rank order (so all ranks get bitwise-identical results). Two parity halves make the next call
          safe: before a rank's call e+1 starts, its call e waited for flags of call e from every peer, so
          every peer has finished call e-1, the last reader of the half that call e+1 writes.
  two_shot  phase 1: block b pushes its range of input chunk c to rs slot[rank] of rank c, raises flag[0];
          waits for flag[0] from all; sums rs slot[0..N-1] of its own chunk, writes the sum to its output and
          pushes it to the gather region of every other rank, raises flag[1]; waits for flag[1] from all
          others; copies the other chunks from its gather region to its output. A rank's call e+1 writes into
          a peer only after that peer raised a flag of call e+1, i.e. after the peer's call e finished reading.

Bytes moved per rank (B = tensor bytes): one_shot sends (N-1)*B over NVLink and receives as much; two_shot
sends and receives 2*(N-1)/N*B. With N = 2 both move B each way; that is the floor for any all-reduce.

Units: ``_bytes`` are bytes; vectors are ``vec`` elements (16 bytes when aligned).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Sequence

from rackbed.topology.errors import UserError

ALGOS = ("one_shot", "two_shot", "two_shot_pull")
DTYPES = {"bf16": 2, "fp32": 4}  # name -> bytes per element
MAX_RANKS = 8
THREADS = 512

# Size at or below which one-shot is chosen, per rank count. With N = 2 both schedules move the same NVLink
# bytes and one-shot saves a flag round trip and the gather copy; with more ranks one-shot moves (N-1)*B
# against 2(N-1)/N*B, so it only wins while latency dominates. Set from the 2xH200 measurement in
# results/h200x2/ (see kernels/README.md); the N > 2 values are the usual small-message crossovers, untested.
ONE_SHOT_MAX_BYTES = {2: 16 << 20, 4: 256 << 10, 8: 128 << 10}
TWO_SHOT_ALGO = "two_shot"  # the two-shot variant algo="auto" takes (see kernels/README.md)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclasses.dataclass(frozen=True)
class Layout:
    """Byte offsets inside one rank's peer allocation (identical on every rank).

    table   int64[n_ranks] peer base addresses (global rank order), int64 rank, int64 own base
    err     int32: set to 1 by a block whose wait timed out
    counters int32[max_blocks]: per-block epoch counters (only the owning rank writes them)
    flags   int32[2 phases][max_blocks][MAX_RANKS]: flag[p][b][src], raised by rank src
    rs      n_ranks slots of rs_slot_bytes (two-shot reduce-scatter inputs)
    ag      ag_bytes (two-shot gather region, indexed like the tensor)
    os      2 parities x n_ranks slots of os_slot_bytes (one-shot inputs)
    """

    n_ranks: int
    max_bytes: int
    max_blocks: int
    table_off: int
    err_off: int
    counters_off: int
    flags_off: int
    rs_off: int
    rs_slot_bytes: int
    ag_off: int
    ag_bytes: int
    os_off: int
    os_slot_bytes: int
    total_bytes: int

    def flag_off(self, phase, block, src):
        """Byte offset of flag[phase][block][src]; works on ints and on CuTe DSL integers alike."""
        return self.flags_off + ((phase * self.max_blocks + block) * MAX_RANKS + src) * 4


def make_layout(n_ranks: int, max_bytes: int, max_blocks: int = 132) -> Layout:
    """The layout for tensors of up to ``max_bytes`` bytes over ``n_ranks`` ranks."""
    if not 2 <= n_ranks <= MAX_RANKS:
        raise UserError(f"allreduce: n_ranks={n_ranks} must be in 2..{MAX_RANKS}")
    if max_bytes <= 0:
        raise UserError(f"allreduce: max_bytes={max_bytes} must be > 0")
    if not 1 <= max_blocks <= 1024:
        raise UserError(f"allreduce: max_blocks={max_blocks} must be in 1..1024")
    padded = _round_up(max_bytes, 256) + 256  # n_vec * vec_bytes <= max_bytes + 15
    rs_slot = _round_up(max_bytes // n_ranks + 64, 256)  # ceil(n_vec / N) * 16 <= B/N + 32
    table_off, err_off, counters_off = 0, 8 * (MAX_RANKS + 2), 256
    flags_off = _round_up(counters_off + 4 * max_blocks, 256)
    rs_off = _round_up(flags_off + 2 * max_blocks * MAX_RANKS * 4, 4096)
    ag_off = rs_off + n_ranks * rs_slot
    os_off = _round_up(ag_off + padded, 4096)
    total = os_off + 2 * n_ranks * padded
    return Layout(n_ranks, max_bytes, max_blocks, table_off, err_off, counters_off, flags_off, rs_off, rs_slot,
                  ag_off, padded, os_off, padded, total)


def select_algo(n_bytes: int, n_ranks: int, one_shot_max_bytes: int | None = None,
                two_shot_algo: str = "two_shot") -> str:
    """``"one_shot"`` up to the crossover size for ``n_ranks``, ``two_shot_algo`` above it."""
    if n_bytes < 0:
        raise UserError(f"allreduce: n_bytes={n_bytes} must be >= 0")
    limit = one_shot_max_bytes if one_shot_max_bytes is not None else ONE_SHOT_MAX_BYTES.get(n_ranks, 128 << 10)
    return "one_shot" if n_bytes <= limit else two_shot_algo


def vector_width(n_elems: int, elem_bytes: int, *addrs: int) -> int:
    """Elements per vector: the largest power of two <= 16/elem_bytes dividing n and every address's alignment."""
    v = 16 // elem_bytes
    while v > 1 and (n_elems % v or any(a % (v * elem_bytes) for a in addrs)):
        v //= 2
    return v


@dataclasses.dataclass(frozen=True)
class LaunchShape:
    algo: str
    vec: int
    n_vec: int
    grid: int
    threads: int


def launch_shape(n_elems: int, dtype: str, n_ranks: int, algo: str, max_blocks: int, *addrs: int) -> LaunchShape:
    """Vector width, vector count and grid size of one call (same on every rank for the same n_elems)."""
    if dtype not in DTYPES:
        raise UserError(f"allreduce: dtype={dtype!r} must be one of {sorted(DTYPES)}")
    if algo not in ALGOS:
        raise UserError(f"allreduce: algo={algo!r} must be one of {ALGOS}")
    vec = vector_width(n_elems, DTYPES[dtype], *addrs)
    n_vec = n_elems // vec
    per_region = n_vec if algo == "one_shot" else -(-n_vec // n_ranks)
    grid = max(1, min(max_blocks, -(-per_region // THREADS)))
    return LaunchShape(algo, vec, n_vec, grid, THREADS)


def block_range(count: int, block: int, n_blocks: int) -> tuple[int, int]:
    """Contiguous share [lo, hi) of ``count`` items for ``block`` of ``n_blocks`` (ceil split; tail blocks empty)."""
    per = -(-count // n_blocks)
    lo = min(block * per, count)
    return lo, min(lo + per, count)


def chunk_range(n_vec: int, n_ranks: int, chunk: int) -> tuple[int, int]:
    """Vector range [lo, hi) of rank ``chunk``'s share in two-shot: chunks of ceil(n_vec/N), the last shorter."""
    cv = -(-n_vec // n_ranks)
    lo = min(chunk * cv, n_vec)
    return lo, min(lo + cv, n_vec)


def traffic_bytes(algo: str, n_bytes: int, n_ranks: int) -> dict[str, float]:
    """Bytes one rank sends over NVLink (= receives) and moves through its own HBM, per call.

    HBM (B = n_bytes): one_shot reads its input twice, takes N-1 peer copies in and reads them, writes B;
    two_shot reads its input, takes (N-1)/N*B in, reads its chunk's N terms (B), writes B/N to out and to the
    gather regions ((N-1)/N*B arrive), copies (N-1)/N*B gather -> out (read + write).
    """
    n = n_ranks
    if algo == "one_shot":
        return {"nvlink_send_bytes": (n - 1) * n_bytes, "hbm_bytes": n_bytes * (2 + 2 * (n - 1) + 1)}
    if algo in ("two_shot", "two_shot_pull"):
        f = (n - 1) / n
        return {"nvlink_send_bytes": 2 * f * n_bytes, "hbm_bytes": n_bytes * (1 + f + 1 + 1 / n + f + 2 * f)}
    raise UserError(f"allreduce: algo={algo!r} must be one of {ALGOS}")


def bound_us(n_bytes: int, n_ranks: int, p2p_GBps_per_dir: float) -> float:
    """Floor for any all-reduce on a full NVLink mesh: each rank must send 2(N-1)/N * B (= B for N = 2)
    while every link direction carries at most ``p2p_GBps_per_dir`` (measured with both directions busy)."""
    return 2 * (n_ranks - 1) / n_ranks * n_bytes / (p2p_GBps_per_dir * 1e9) * 1e6


# ---------------------------------------------------------------------------------------------- emulation


class _Rank:
    """One rank's peer allocation, modelled as named regions of vectors (one Python number per vector)."""

    def __init__(self, lay: Layout, n_vec_max: int):
        n = lay.n_ranks
        cv = -(-n_vec_max // n)
        self.counters = [0] * lay.max_blocks
        self.flags = [[[0] * n for _ in range(lay.max_blocks)] for _ in range(2)]
        self.rs = [[None] * cv for _ in range(n)]
        self.ag = [None] * n_vec_max
        self.os = [[[None] * n_vec_max for _ in range(n)] for _ in range(2)]


def _block_program(ranks, r, b, nblk, algo, inp, out, n_vec):
    """One block of one rank as a generator: yields at every wait; runs the protocol of the module docstring."""
    lay_n = len(ranks)
    me = ranks[r]
    e = me.counters[b] + 1
    if b == 0:
        for bb in range(nblk, len(me.counters)):
            me.counters[bb] += 1
    if algo == "one_shot":
        par = e % 2
        lo, hi = block_range(n_vec, b, nblk)
        for v in range(lo, hi):
            for j in range(lay_n):
                if j != r:
                    ranks[j].os[par][r][v] = inp[v]
            yield
        for j in range(lay_n):
            if j != r:
                ranks[j].flags[0][b][r] = e
        for j in range(lay_n):
            while j != r and me.flags[0][b][j] < e:
                yield
        for v in range(lo, hi):
            out[v] = sum(inp[v] if j == r else me.os[par][j][v] for j in range(lay_n))
            yield
    else:
        pull = algo == "two_shot_pull"
        for c in range(lay_n):
            if c == r:
                continue
            c_lo, c_hi = chunk_range(n_vec, lay_n, c)
            lo, hi = block_range(c_hi - c_lo, b, nblk)
            for v in range(lo, hi):
                ranks[c].rs[r][v] = inp[c_lo + v]
                yield
        for j in range(lay_n):
            if j != r:
                ranks[j].flags[0][b][r] = e
        for j in range(lay_n):
            while j != r and me.flags[0][b][j] < e:
                yield
        m_lo, m_hi = chunk_range(n_vec, lay_n, r)
        lo, hi = block_range(m_hi - m_lo, b, nblk)
        for v in range(lo, hi):
            y = sum(inp[m_lo + v] if j == r else me.rs[j][v] for j in range(lay_n))
            out[m_lo + v] = y
            for j in range(lay_n):
                if (j == r) == pull:  # pull: my own gather region; push: every other rank's
                    ranks[j].ag[m_lo + v] = y
            yield  # let others run between the stores of one block: exposes write-after-read races
        for j in range(lay_n):
            if j != r:
                ranks[j].flags[1][b][r] = e
        for j in range(lay_n):
            while j != r and me.flags[1][b][j] < e:
                yield
        for c in range(lay_n):
            if c != r:
                c_lo, c_hi = chunk_range(n_vec, lay_n, c)
                lo, hi = block_range(c_hi - c_lo, b, nblk)
                src = ranks[c] if pull else me
                for v in range(lo, hi):
                    out[c_lo + v] = src.ag[c_lo + v]
                    yield
    me.counters[b] = e


def emulate(calls: Sequence[tuple[str, int, int]], n_ranks: int, max_blocks: int, seed: int,
            values: Callable[[int, int, int], int] | None = None) -> list[list[list[int]]]:
    """Run a sequence of all-reduce calls ``(algo, n_vec, grid)`` on ``n_ranks`` emulated ranks.

    Each rank runs its calls in order (a rank's call k+1 starts when all its blocks of call k have finished,
    as kernels on one stream do); blocks of all ranks interleave at random (``seed``) at every spin and between
    stores. Inputs are ``values(call, rank, v)`` (distinct integers by default). Returns outputs[call][rank].
    Integer sums make the check exact; a protocol race shows up as a wrong or missing (None) element.
    """
    rng = random.Random(seed)
    values = values or (lambda k, r, v: (k * 7919 + r * 104729 + v * 31) % 1000003)
    n_vec_max = max(nv for _, nv, _ in calls)
    lay = make_layout(n_ranks, 16 * n_vec_max, max_blocks)
    ranks = [_Rank(lay, n_vec_max) for _ in range(n_ranks)]
    outs = [[[None] * nv for _ in range(n_ranks)] for _, nv, _ in calls]
    nxt = [0] * n_ranks  # next call index per rank
    live: dict[int, list] = {}  # rank -> running block generators
    while any(k < len(calls) for k in nxt) or live:
        for r in range(n_ranks):
            if r not in live and nxt[r] < len(calls):
                k = nxt[r]
                algo, n_vec, grid = calls[k]
                inp = [values(k, r, v) for v in range(n_vec)]
                live[r] = [_block_program(ranks, r, b, grid, algo, inp, outs[k][r], n_vec) for b in range(grid)]
                nxt[r] += 1
        r = rng.choice(sorted(live))
        gens = live[r]
        g = rng.choice(gens)
        try:
            next(g)
        except StopIteration:
            gens.remove(g)
            if not gens:
                del live[r]
    return outs


def expected(calls: Sequence[tuple[str, int, int]], n_ranks: int,
             values: Callable[[int, int, int], int] | None = None) -> list[list[int]]:
    """The reference sums for ``emulate``'s default inputs: expected[call][v]."""
    values = values or (lambda k, r, v: (k * 7919 + r * 104729 + v * 31) % 1000003)
    return [[sum(values(k, r, v) for r in range(n_ranks)) for v in range(nv)] for k, (_, nv, _) in enumerate(calls)]


def predicted_us(algo: str, n_bytes: int, n_ranks: int, *, p2p_GBps: float = 385.0, hbm_GBps: float = 4300.0,
                 flag_us: float = 2.5, launch_us: float = 3.0) -> float:
    """A first-order time model (launch + flag round trips + the NVLink / HBM floor; docs/KERNELS.md) for
    predictions before a device run; not used for selection."""
    t = traffic_bytes(algo, n_bytes, n_ranks)
    rounds = 1 if algo == "one_shot" else 2  # flag round trips
    return launch_us + rounds * flag_us + max(t["nvlink_send_bytes"] / (p2p_GBps * 1e3),
                                              t["hbm_bytes"] / (hbm_GBps * 1e3))


def sizes_from_args(sizes: Sequence[str] | None, lo: int = 8 << 10, hi: int = 128 << 20) -> list[int]:
    """Parse sizes like ``8K 1M 128MiB 4096`` (bytes); default: powers of two from 8 KiB to 128 MiB."""
    if not sizes:
        return [1 << p for p in range(int(math.log2(lo)), int(math.log2(hi)) + 1)]
    units = {"": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
             "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}
    out = []
    for s in sizes:
        t = s.strip().lower()
        num = t.rstrip("kmgib")
        unit = t[len(num):]
        if not num.isdigit() or unit not in units:
            raise UserError(f"bench: --sizes entry {s!r} is not a size like 8K, 1M, 128MiB or 4096")
        out.append(int(num) * units[unit])
        if out[-1] <= 0:
            raise UserError(f"bench: --sizes entry {s!r} must be > 0 bytes")
    return out
