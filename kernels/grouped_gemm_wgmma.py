"""Prefill MoE grouped GEMM on Hopper (wgmma + TMA, CuTe DSL): host side, argument checks, references.

    from rackbed.kernels.grouped_gemm_wgmma import grouped_mm
    y = grouped_mm(x, w, counts)                                    # bf16:  y[r] = x[r] @ w[e(r)].T
    y = grouped_mm(xq, wq, counts, x_scale=sx, w_scale=sw)          # FP8 e4m3, block scales, fp32 accumulation

Shapes: ``x [R, K]`` rows grouped by expert (expert e owns rows offs[e]..offs[e+1], offs = prefix sums of
``counts [E]``, which stays on the device: no host sync, CUDA-graph safe), ``w [E, N, K]``, out ``[R, N]`` bf16.
FP8 (DeepSeek-V3 block format, = kernels.mx / engine.core.formats "fp8_block"): ``x`` float8_e4m3fn with
``x_scale [R, K/128]`` fp32 (one per row per 128-wide K block), ``w`` float8_e4m3fn with ``w_scale [E, N/128,
K/128]`` fp32 (one per 128 x 128 block); value = code * scale. The kernel accumulates each 128-K block on the
tensor cores in fp32, multiplies by x_scale * w_scale and adds into an fp32 register accumulator.

The device code is kernels/grouped_gemm_wgmma_cute.py (docstring there: pipeline, warp roles, scheduler).
Everything in this module except :func:`grouped_mm` runs without CUDA / CuTe DSL (tests/test_grouped_gemm_wgmma.py).
"""

from __future__ import annotations

import math
import os

TILE_M = 128
SCALE_BLOCK = 128  # fp8 block-scale granularity along K (and along N for the weights)
SMEM_BYTES = 227 * 1024  # sm_90 dynamic shared memory per block


# Compile-time variants of the kernel (kernels/grouped_gemm_wgmma_cute.py), swept by kernels/bench/moe_prefill.py.
#   tile_n     CTA tile N (tile M is always 128, tile K is 128 bytes: 64 bf16 / 128 fp8)
#   pingpong   False: the 2 consumer warpgroups share each 128-row tile (64 rows each, "cooperative");
#              True: each consumer warpgroup owns whole 128 x tile_n tiles, alternating, so one warpgroup's
#              epilogue overlaps the other's MMAs (bf16 only: fp8 would need 2 x 128 accumulator registers)
#   epi        "direct": registers -> global element by element (v1); "smem": per 64-column chunk, registers ->
#              padded shared memory -> 16-byte coalesced global stores, rows masked to the expert
#   dbuf       fp8 only: two temporary block accumulators; block k+1's wgmma is in flight while block k is
#              promoted (wgmma.wait_group 1), and the scales are loaded one block ahead
#   stages     TMA pipeline depth (None: as many as fit in shared memory)
#   cluster_n  v4: CTAs per cluster along N (1: no cluster). The CTAs of a cluster compute the same m-tile (same
#              expert, same x rows) and adjacent n-tiles; each loads 1/cluster_n of the A tile and multicasts it to
#              all (TMA multicast), so L2->SM traffic per CTA and k-tile drops from (128 + tile_n) x tile_k to
#              (128 / cluster_n + tile_n) x tile_k elements. Why: v3 ran at ~6 TB/s of L2->SM loads in every variant
#              (128x256 and 128x128 tiles alike), i.e. load-bandwidth bound, not MMA-issue bound.
#   max_ctas   v4: cap on the persistent grid (None: one CTA per SM); cluster variants need a grid of whole clusters
#              that are all co-resident (a cluster that does not fit runs after the others: a doubled tail)
VARIANTS: dict[str, dict] = {
    "v1_bf16": {"fp8": False, "tile_n": 256, "pingpong": False, "epi": "direct", "dbuf": False, "stages": 4},
    "bf16_coop_smem": {"fp8": False, "tile_n": 256, "pingpong": False, "epi": "smem", "dbuf": False, "stages": 4},
    "bf16_pp128": {"fp8": False, "tile_n": 128, "pingpong": True, "epi": "direct", "dbuf": False, "stages": None},
    "bf16_pp128_smem": {"fp8": False, "tile_n": 128, "pingpong": True, "epi": "smem", "dbuf": False,
                        "stages": None},
    "bf16_coop128_smem": {"fp8": False, "tile_n": 128, "pingpong": False, "epi": "smem", "dbuf": False,
                          "stages": None},
    "v1_fp8": {"fp8": True, "tile_n": 128, "pingpong": False, "epi": "direct", "dbuf": False, "stages": 6},
    "fp8_smem": {"fp8": True, "tile_n": 128, "pingpong": False, "epi": "smem", "dbuf": False, "stages": None},
    "fp8_dbuf": {"fp8": True, "tile_n": 128, "pingpong": False, "epi": "direct", "dbuf": True, "stages": None},
    "fp8_dbuf_smem": {"fp8": True, "tile_n": 128, "pingpong": False, "epi": "smem", "dbuf": True, "stages": None},
    # v4: 2-CTA clusters along N with the A tile multicast (see cluster_n above)
    "bf16_mc2_smem": {"fp8": False, "tile_n": 256, "pingpong": False, "epi": "smem", "dbuf": False, "stages": 4,
                      "cluster_n": 2},
    "bf16_mc2_smem_g128": {"fp8": False, "tile_n": 256, "pingpong": False, "epi": "smem", "dbuf": False,
                           "stages": 4, "cluster_n": 2, "max_ctas": 128},
    "bf16_mc4_smem": {"fp8": False, "tile_n": 256, "pingpong": False, "epi": "smem", "dbuf": False, "stages": 4,
                      "cluster_n": 4, "max_ctas": 128},
    "fp8_mc2_smem": {"fp8": True, "tile_n": 128, "pingpong": False, "epi": "smem", "dbuf": False, "stages": None,
                     "cluster_n": 2},
    "fp8_mc2_smem_g128": {"fp8": True, "tile_n": 128, "pingpong": False, "epi": "smem", "dbuf": False,
                          "stages": None, "cluster_n": 2, "max_ctas": 128},
    "fp8_mc4_smem": {"fp8": True, "tile_n": 128, "pingpong": False, "epi": "smem", "dbuf": False,
                     "stages": None, "cluster_n": 4, "max_ctas": 128},
}
# The variant grouped_mm uses when none is named (env RACKBED_WGMMA_VARIANT_BF16 / _FP8 override); set from the
# sweep in results/h200x2/moe/ (docs/KERNELS.md, prefill grouped GEMM).
DEFAULT_VARIANT = {"bf16": "bf16_coop_smem", "fp8": "fp8_dbuf_smem"}  # v4 sweep: best bf16; best fp8 without N % 256
# Diagnostic variants (gap analysis): a real variant with one cost removed, so that the time it costs can be
# measured beside it in the same run (kernels/bench/moe_prefill.py --diagnose). They compute WRONG results on
# purpose: kept out of VARIANTS (so out of --sweep and the best-variant pick), refused by default_variant (env
# override) and by grouped_mm unless ``diagnostic=True``.
#   diag="no_epilogue"  mainloop identical; the tile's epilogue (smem staging + global stores) sits behind a runtime
#                       test that is always false (n_rows < 0), so the accumulator stays live and no wgmma is dropped
#   diag="no_promote"   fp8: no per-128-K-block promotion (no temporary accumulator, no scale loads, no FMAs, no
#                       wait_group 0/1 per block): wgmma accumulates the raw codes straight into acc, one batch in
#                       flight, like the bf16 mainloop
DIAG_KINDS = ("no_epilogue", "no_promote")
DIAG_VARIANTS: dict[str, dict] = {
    "bf16_coop_smem__no_epilogue": {**VARIANTS["bf16_coop_smem"], "diag": "no_epilogue", "base": "bf16_coop_smem"},
    "fp8_dbuf_smem__no_epilogue": {**VARIANTS["fp8_dbuf_smem"], "diag": "no_epilogue", "base": "fp8_dbuf_smem"},
    "fp8_dbuf_smem__no_promote": {**VARIANTS["fp8_dbuf_smem"], "diag": "no_promote", "base": "fp8_dbuf_smem"},
}


def is_diagnostic(variant) -> bool:
    return isinstance(variant, str) and variant in DIAG_VARIANTS


EPI_N = 64  # columns per shared-memory epilogue chunk
EPI_PAD = 8  # bf16 elements of padding per staged row (144-byte rows: conflict-free fragment writes)


def default_variant(fp8: bool) -> str:
    key = "fp8" if fp8 else "bf16"
    v = os.environ.get(f"RACKBED_WGMMA_VARIANT_{key.upper()}") or DEFAULT_VARIANT[key]
    if v not in VARIANTS:  # diagnostic variants (wrong results on purpose) are never a default
        raise ValueError(f"RACKBED_WGMMA_VARIANT_{key.upper()}={v!r} is not a production wgmma variant "
                         f"(known: {', '.join(VARIANTS)})")
    return v


def variant_config(variant: str | bool) -> dict:
    """Static tiling of a variant (a name in VARIANTS, or a bool = the default fp8/bf16 variant): CTA tile
    (m, n, k), pipeline stages (from the shared-memory budget), epilogue staging bytes, threads."""
    if isinstance(variant, bool):
        variant = default_variant(variant)
    if variant not in VARIANTS and variant not in DIAG_VARIANTS:
        raise ValueError(f"unknown wgmma variant {variant!r}; known: {', '.join(VARIANTS)}")
    v = {"cluster_n": 1, "max_ctas": None, "diag": None, "base": variant,
         **(VARIANTS[variant] if variant in VARIANTS else DIAG_VARIANTS[variant])}
    fp8, tile_n = v["fp8"], v["tile_n"]
    tile_k = 128 if fp8 else 64  # 128 bytes of K per row either way (128-byte swizzle)
    elem = 1 if fp8 else 2
    stage_bytes = (TILE_M + tile_n) * tile_k * elem
    epi_rows = TILE_M if v["pingpong"] else TILE_M // 2  # rows one consumer warpgroup stores
    epi_bytes = 2 * epi_rows * (EPI_N + EPI_PAD) * 2 if v["epi"] == "smem" else 0
    fit = (SMEM_BYTES - 4096 - epi_bytes) // stage_bytes
    stages = min(8, fit) if v["stages"] is None else min(v["stages"], fit)
    v.update({"name": variant, "tile_m": TILE_M, "tile_k": tile_k, "stages": stages, "threads": 384,
              "stage_bytes": stage_bytes, "epi_bytes": epi_bytes, "epi_rows": epi_rows})
    return v


def tile_config(fp8) -> dict:
    """Backward-compatible name of :func:`variant_config` (``fp8`` a bool or a variant name)."""
    return variant_config(fp8)


def check_args(x, w, counts, x_scale=None, w_scale=None) -> tuple[int, int, int, int, bool]:
    """Validate shapes/dtypes; return (R, E, N, K, fp8). ValueError (one line) on a mismatch."""
    import torch

    fp8 = x_scale is not None or w_scale is not None
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(f"grouped_mm: x must be [R, K] and w [E, N, K], got {tuple(x.shape)}, {tuple(w.shape)}")
    R, K = x.shape
    E, N, Kw = w.shape
    if Kw != K:
        raise ValueError(f"grouped_mm: K mismatch: x has {K}, w has {Kw}")
    if counts.dim() != 1 or counts.shape[0] != E:
        raise ValueError(f"grouped_mm: counts must be [E={E}], got {tuple(counts.shape)}")
    if fp8:
        if x_scale is None or w_scale is None:
            raise ValueError("grouped_mm: fp8 needs both x_scale and w_scale")
        if x.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn:
            raise ValueError(f"grouped_mm: fp8 operands must be float8_e4m3fn, got {x.dtype}, {w.dtype}")
        kb, nb = -(-K // SCALE_BLOCK), -(-N // SCALE_BLOCK)
        if tuple(x_scale.shape) != (R, kb) or x_scale.dtype != torch.float32:
            raise ValueError(f"grouped_mm: x_scale must be fp32 [R={R}, K/128={kb}], got {x_scale.dtype} "
                             f"{tuple(x_scale.shape)}")
        if tuple(w_scale.shape) != (E, nb, kb) or w_scale.dtype != torch.float32:
            raise ValueError(f"grouped_mm: w_scale must be fp32 [E={E}, N/128={nb}, K/128={kb}], got "
                             f"{w_scale.dtype} {tuple(w_scale.shape)}")
    elif x.dtype != w.dtype:
        raise ValueError(f"grouped_mm: x and w dtypes differ ({x.dtype}, {w.dtype})")
    return R, E, N, K, fp8


def shape_unsupported(n_rows: int, n: int, k: int, fp8, variant: str | None = None) -> str | None:
    """Why the kernel's tiling cannot take an [R, K] x [N, K] grouped GEMM (None when it can)."""
    cfg = variant_config(variant or fp8)
    if k % cfg["tile_k"] or k % SCALE_BLOCK:
        return f"K={k} must be a multiple of 128"
    if cfg["dbuf"] and k % (2 * SCALE_BLOCK):
        return f"K={k} must be a multiple of 256 for variant {cfg['name']}"
    if n % (cfg["tile_n"] * cfg["cluster_n"]):
        return f"N={n} must be a multiple of {cfg['tile_n'] * cfg['cluster_n']} for variant {cfg['name']}"
    if n_rows == 0:
        return "no rows"
    if n_rows * max(n, k) >= 2 ** 31:
        return "too many rows for 32-bit indexing"
    return None


def kernel_unsupported(x, w, counts, x_scale=None, w_scale=None, variant: str | None = None) -> str | None:
    """Why the wgmma kernel cannot take these tensors (None when it can); raises ValueError on bad shapes."""
    import torch

    R, E, N, K, fp8 = check_args(x, w, counts, x_scale, w_scale)
    if not x.is_cuda:
        return "not on CUDA"
    if not fp8 and x.dtype != torch.bfloat16:
        return f"dtype {x.dtype}: bf16 or float8_e4m3fn + scales only"
    if variant is not None and variant_config(variant)["fp8"] != fp8:
        return f"variant {variant} is {'fp8' if variant_config(variant)['fp8'] else 'bf16'}, operands are not"
    why = shape_unsupported(R, N, K, fp8, variant)
    if why:
        return why
    if E * N * K >= 2 ** 31:
        return "weights too large for 32-bit indexing"
    for name, t in (("x", x), ("w", w), ("x_scale", x_scale), ("w_scale", w_scale)):
        if t is not None and (not t.is_contiguous() or t.data_ptr() % 16):
            return f"{name} must be contiguous and 16-byte aligned"
    return None


def tile_offsets(counts, tile_m: int = TILE_M, out=None):
    """int32 [2, E+1] on counts' device, no host sync: row 0 = row offsets (0, c0, c0+c1, ...), row 1 = m-tile
    offsets (prefix sums of ceil(count / tile_m))."""
    import torch

    E = counts.shape[0]
    if out is None:
        out = torch.empty(2, E + 1, dtype=torch.int32, device=counts.device)
    out[:, :1].zero_()
    torch.cumsum(counts, 0, dtype=torch.int32, out=out[0, 1:])
    torch.cumsum(torch.div(counts + (tile_m - 1), tile_m, rounding_mode="floor"), 0, dtype=torch.int32,
                 out=out[1, 1:])
    return out


def grid_size(n_rows: int, n_experts: int, n: int, fp8, n_sms: int) -> int:
    """Persistent grid: one CTA per SM, fewer when there are fewer work items (upper bound from host sizes);
    cluster variants: a multiple of cluster_n, at most max_ctas."""
    cfg = variant_config(fp8)
    max_tiles = (math.ceil(n_rows / cfg["tile_m"]) + n_experts) * (n // cfg["tile_n"])
    g = max(1, min(n_sms, cfg["max_ctas"] or n_sms, max_tiles))
    return cluster_grid(g, cfg)


def cluster_grid(n_ctas: int, cfg: dict) -> int:
    """``n_ctas`` rounded down to whole clusters (at least one cluster)."""
    cn = cfg["cluster_n"]
    return max(cn, n_ctas - n_ctas % cn)


def schedule(counts_list, n: int, fp8, n_ctas: int, consumer: int | None = None
             ) -> list[list[tuple[int, int, int, int]]]:
    """Python mirror of the kernel's work loop: per CTA, the (expert, first row, valid rows, n-tile) it computes
    (``fp8`` a bool or a variant name; pingpong variants: ``consumer`` 0/1 keeps only that warpgroup's items,
    every other one of the CTA's sequence)."""
    cfg = variant_config(fp8)
    tm, cn = cfg["tile_m"], cfg["cluster_n"]
    n_groups = n // cfg["tile_n"] // cn  # work items are (m-tile, group of cluster_n adjacent n-tiles)
    if cn > 1:
        n_ctas = cluster_grid(n_ctas, cfg)
    n_cl = n_ctas // cn
    offs, toffs = [0], [0]
    for c in counts_list:
        offs.append(offs[-1] + c)
        toffs.append(toffs[-1] + -(-c // tm))
    total = toffs[-1] * n_groups
    out = []
    for b in range(n_ctas):
        cid, rank = divmod(b, cn)  # cluster index, rank in the cluster (cluster along grid x)
        e, items, t = 0, [], cid
        while t < total:
            mt, ng = divmod(t, n_groups)
            while toffs[e + 1] <= mt:
                e += 1
            row0 = offs[e] + (mt - toffs[e]) * tm
            if consumer is None or not cfg["pingpong"] or (t - cid) // n_cl % 2 == consumer:
                items.append((e, row0, min(offs[e + 1] - row0, tm), ng * cn + rank))
            t += n_cl
        out.append(items)
    return out


def wgmma_c_coords(tile_n: int, n_wg: int, tile_m: int = TILE_M):
    """(thread, fragment index) -> (row, col) of the wgmma fp32 accumulator of a ``tile_m x tile_n`` CTA tile split
    over ``n_wg`` warpgroups along M (PTX m64nNk16 D layout, tiled; equals CuTe's ``partition_C`` of the kernel's
    tiled MMA, checked against a CuTe dump when the kernel changed). int array [128 * n_wg, frag, 2]."""
    import numpy as np

    mreps, n8 = tile_m // (64 * n_wg), tile_n // 8
    t = np.arange(128 * n_wg)[:, None]
    i = np.arange(4 * n8 * mreps)[None, :]
    wg, lane, warp = t // 128, t % 32, (t % 128) // 32
    a, b, nb, mr = i % 2, (i // 2) % 2, (i // 4) % n8, i // (4 * n8)
    row = 64 * (wg + n_wg * mr) + 16 * warp + lane // 4 + 8 * b
    col = 8 * nb + 2 * (lane % 4) + a
    return np.stack(np.broadcast_arrays(row, col), -1)


def smem_epilogue_plan(variant: str, rows: int):
    """Python mirror of the kernel's shared-memory epilogue (``epilogue_smem``) for one tile with ``rows`` valid
    rows: per consumer warpgroup and 64-column chunk, which fragment element each thread writes to which staging
    cell, and which cells each thread copies to which global (row, col). Returns an int array [tile_m, tile_n]:
    how many times each tile cell is stored with the value computed for it (a stale or foreign staged value
    counts 1000)."""
    import numpy as np

    cfg = variant_config(variant)
    tile_n, tm, epi_rows = cfg["tile_n"], cfg["tile_m"], cfg["epi_rows"]
    tv = wgmma_c_coords(tile_n, 1 if cfg["pingpong"] else 2)
    n8, vec_per_row = tile_n // 8, EPI_N // 8
    stored = np.zeros((tm, tile_n), int)
    for cwg in range(1 if cfg["pingpong"] else 2):  # pingpong: one warpgroup owns the whole tile
        threads = range(128) if cfg["pingpong"] else range(128 * cwg, 128 * cwg + 128)
        wg_row0 = 0 if cfg["pingpong"] else cwg * (tm // 2)
        for c in range(tile_n // EPI_N):
            staged = np.full((epi_rows, EPI_N + EPI_PAD, 2), -1)
            for ctid in threads:
                for i in range(tv.shape[1]):
                    if ((i // 4) % n8) // vec_per_row == c:
                        m, n = tv[ctid, i]
                        staged[m - wg_row0, n - c * EPI_N] = (m, n)
            for ctid in threads:
                wtid = ctid % 128  # the warpgroup-local thread index the kernel uses
                for q in range(epi_rows * vec_per_row // 128):
                    v = wtid + 128 * q
                    r, cv = divmod(v, vec_per_row)
                    if wg_row0 + r < rows:
                        for j in range(8):
                            m, n = wg_row0 + r, c * EPI_N + 8 * cv + j
                            ok = r < epi_rows and tuple(staged[r, 8 * cv + j]) == (m, n)
                            stored[m, n] += 1 if ok else 1000
    return stored


def grouped_mm_reference(x, w, counts, x_scale=None, w_scale=None, dtype=None, experts=None):
    """Per-expert fp32 (or ``dtype``) GEMM on dequantized operands -> [R, N]; rows of experts not in ``experts``
    (default: all) are left 0 (cheap partial references for big shapes)."""
    import torch

    dt = dtype or torch.float32
    R, E, N, K, fp8 = check_args(x, w, counts, x_scale, w_scale)
    out = torch.zeros(R, N, dtype=dt, device=x.device)
    start = 0
    for e, c in enumerate(counts.tolist()):
        if c and (experts is None or e in experts):
            xe = x[start:start + c].to(dt)
            we = w[e].to(dt)
            if fp8:
                xe = xe * x_scale[start:start + c].to(dt).repeat_interleave(SCALE_BLOCK, 1)[:, :K]
                se = w_scale[e].to(dt).repeat_interleave(SCALE_BLOCK, 0).repeat_interleave(SCALE_BLOCK, 1)
                we = we * se[:N, :K]
            out[start:start + c] = xe @ we.T
        start += c
    return out


def quantize_fp8_block(t, role: str):
    """Fast fp32 torch quantizer to the "fp8_block" format (same rule as kernels.mx: scale = fp32(amax / 448) per
    1x128 (activation, [R, K]) or 128x128 (weight, [..., N, K]) block, codes = satfinite(RNE(x / scale)); the fp32
    division makes ~0.1% of codes differ from kernels.mx's float64 ones by one step near rounding ties, which the
    kernel check does not depend on: its reference dequantizes the same codes). Returns (codes float8_e4m3fn, scales fp32). K (and N for weights) % 128 == 0."""
    import torch

    x = t.float()
    B = SCALE_BLOCK
    if role == "activation":
        R, K = x.shape
        xb = x.reshape(R, K // B, B)
        s = (xb.abs().amax(-1) / 448.0)
        q = torch.where(s[..., None] > 0, xb / torch.where(s > 0, s, 1)[..., None], torch.zeros_like(xb))
        return q.clamp(-448, 448).to(torch.float8_e4m3fn).reshape(R, K), s
    *lead, N, K = x.shape
    xb = x.reshape(*lead, N // B, B, K // B, B)
    s = xb.abs().amax(dim=(-3, -1)) / 448.0  # [..., N/B, K/B]
    sx = s[..., :, None, :, None]
    q = torch.where(sx > 0, xb / torch.where(sx > 0, sx, 1), torch.zeros_like(xb))
    return q.clamp(-448, 448).to(torch.float8_e4m3fn).reshape(*lead, N, K), s


def from_mx(q):
    """rackbed.kernels.mx TorchQuantized ("fp8_block") -> (codes float8_e4m3fn, fp32 scales) for :func:`grouped_mm`."""
    import torch

    codes = q.codes.to(torch.uint8).view(torch.float8_e4m3fn)
    return codes.contiguous(), q.scales.to(torch.float32).contiguous()


def grouped_mm(x, w, counts, *, x_scale=None, w_scale=None, out=None, offsets=None, n_ctas=None, variant=None,
               diagnostic: bool = False):
    """Launch the wgmma kernel (CUDA, CuTe DSL). ``out [R, N]`` bf16 and ``offsets`` (from :func:`tile_offsets`)
    may be caller-allocated; ``variant`` a name in VARIANTS (default :func:`default_variant`). A DIAG_VARIANTS name
    (wrong results on purpose, for timing only) needs ``diagnostic=True``. Raises ValueError when the kernel cannot
    take the arguments."""
    import torch

    R, E, N, K, fp8 = check_args(x, w, counts, x_scale, w_scale)
    variant = variant or default_variant(fp8)
    if is_diagnostic(variant) and not diagnostic:
        raise ValueError(f"grouped_mm(wgmma): {variant} is a diagnostic variant (wrong results on purpose); "
                         f"pass diagnostic=True to time it")
    why = kernel_unsupported(x, w, counts, x_scale, w_scale, variant)
    if why:
        raise ValueError(f"grouped_mm(wgmma): {why}")
    from rackbed.kernels import grouped_gemm_wgmma_cute as gc

    if out is None:
        out = torch.empty(R, N, dtype=torch.bfloat16, device=x.device)
    if offsets is None:
        offsets = tile_offsets(counts)
    if n_ctas is None:
        n_ctas = grid_size(R, E, N, variant, torch.cuda.get_device_properties(x.device).multi_processor_count)
    n_ctas = cluster_grid(n_ctas, variant_config(variant))  # whole clusters (no-op without clusters)
    fn = gc.compiled(N, K, variant)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    sa = x_scale.data_ptr() if fp8 else 0
    sb = w_scale.data_ptr() if fp8 else 0
    fn(x.data_ptr(), w.data_ptr(), out.data_ptr(), offsets[0].data_ptr(), offsets[1].data_ptr(), sa, sb, R, E,
       n_ctas, gc.cuda.CUstream(stream))
    return out
