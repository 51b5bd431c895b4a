"""The CuTe DSL kernel of kernels/grouped_gemm_wgmma.py (Hopper sm_90a): TMA -> multi-stage smem pipeline -> wgmma.

    out[r, :] = x[r, :] @ w[e(r)].T        x [R, K] rows grouped by expert, w [E, N, K], counts [E] -> out [R, N]

Two variants, one kernel body (``fp8`` selects):
  bf16   x, w bf16; fp32 accumulation in registers; bf16 out. CTA tile 128 x 256 x 64.
  fp8    x, w float8_e4m3fn with block scales (DeepSeek-V3 style): ``x_scale [R, K/128]`` fp32 (1 x 128 blocks of
         x), ``w_scale [E, N/128, K/128]`` fp32 (128 x 128 blocks of w). One CTA k-tile is one 128-wide K block:
         wgmma accumulates the block into a temporary fp32 fragment, which is then promoted into the fp32 main
         accumulator as ``acc += tmp * x_scale[row, kb] * w_scale[e, n_blk, kb]``. CTA tile 128 x 128 x 128.

Structure (one CTA per SM, persistent, 3 warpgroups):
  * warpgroup 0 (producer; one warp issues): TMA loads of the A tile (``x`` rows from the expert's row offset,
    a ``domain_offset`` of the TMA coordinate tensor, rows past R are zero-filled by TMA) and of the B tile
    (``w[e]`` slice) into ``stages`` shared-memory buffers; full/empty mbarriers (``PipelineTmaAsync``).
  * warpgroups 1, 2 (consumers): each owns 64 rows of the 128-row tile; wgmma from shared memory, one wgmma
    batch in flight (bf16); epilogue straight from registers to global memory, rows masked to the expert's
    rows (a tile may run into the next expert's rows: they are computed, never stored).
  * work items: t = 0 .. M_tiles * N_tiles - 1, t -> (m-tile = t // N_tiles, n-tile = t % N_tiles) (n fastest: CTAs
    running together share the A tile and the expert's B in L2); m-tile -> expert through ``tile_offs`` (int32
    [E+1], prefix sums of ceil(count/128)), searched forward (t only grows per CTA). Empty experts own no tiles.
    CTA b takes t = b, b + grid, ... ; producer and consumers walk the same sequence.

v2 variants (compile-time, kernels/grouped_gemm_wgmma.py VARIANTS; v1 = "v1_bf16" / "v1_fp8"):
  * pingpong: each consumer warpgroup computes whole 128 x tile_n tiles, the items of its CTA's sequence with
    its parity (the other warpgroup's stages are skipped in its pipeline state, and the empty barriers expect one
    warpgroup's arrivals). The producer loads items in order, so the warpgroups take turns on the tensor cores and
    one's epilogue runs under the other's mainloop. The mainloops are ordered (named barriers 3/4: a warpgroup
    starts item j only after the other finished item j - 1's mainloop): the skipped stages put a warpgroup
    k_tiles stages ahead, and an mbarrier parity wait cannot tell phases two rounds apart.
  * epi="smem": per 64-column chunk, each warpgroup writes its bf16 fragment into its own padded shared-memory
    buffer, syncs on a named barrier (id 1 + warpgroup) and stores 16-byte vectors, 8 threads per 128-byte row
    segment (indexed by the warpgroup-local thread id), rows masked to the expert.
  * dbuf (fp8): two temporary accumulators; block k+1's wgmma is issued before block k is promoted
    (wait_group 1), the x/w scales of a block are loaded when its wgmma is issued.

Arguments are device addresses (plain ints) and sizes, like kernels/grouped_gemm_cute.py; tensors are built in
the jit function. N, K, fp8 and stages are compile-time; R and E are runtime (one compile per (N, K, variant)).
Requirements (checked by :func:`check_args`): K % 128 == 0, N % tile_n == 0, contiguous, 16-byte aligned, R > 0.
"""

from __future__ import annotations

import functools
import os

import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, Int64, cute, pipeline, utils

from rackbed.kernels.grouped_gemm_wgmma import EPI_N, EPI_PAD, SCALE_BLOCK, variant_config

_DEBUG_LAYOUT = bool(os.environ.get("RACKBED_WGMMA_DEBUG_LAYOUT"))
_ORDER_BAR = 3  # pingpong mainloop-order named barriers 3 (wakes consumer 0) and 4 (consumer 1); 1, 2: smem epilogue


class _GroupedGemm:
    """One compiled variant (a name in kernels.grouped_gemm_wgmma.VARIANTS)."""

    def __init__(self, n: int, k: int, variant):
        cfg = variant_config(variant)
        fp8 = cfg["fp8"]
        self.n, self.k, self.fp8 = n, k, fp8
        self.pingpong, self.epi, self.dbuf = cfg["pingpong"], cfg["epi"], cfg["dbuf"]
        self.epi_rows = cfg["epi_rows"]
        self.diag = cfg["diag"]  # None, or a DIAG_KINDS entry (diagnostic twin: wrong results on purpose)
        self.tile_m, self.tile_n, self.tile_k = cfg["tile_m"], cfg["tile_n"], cfg["tile_k"]
        self.stages = cfg["stages"]
        self.ab_dtype = cutlass.Float8E4M3FN if fp8 else cutlass.BFloat16
        self.k_tiles = k // self.tile_k
        self.n_tiles = n // self.tile_n
        self.cn = cfg["cluster_n"]  # v4: CTAs per cluster along N, A tile multicast (1: no cluster)
        assert not (self.cn > 1 and self.pingpong), "clusters are implemented for the cooperative variants only"
        self.n_groups = self.n_tiles // self.cn  # work item = (m-tile, group of cn adjacent n-tiles)
        self.num_consumer_wg = 2
        self.threads = 128 * (1 + self.num_consumer_wg)
        self.epi_smem_elems = (self.num_consumer_wg * self.epi_rows * (EPI_N + EPI_PAD)
                               if self.epi == "smem" else 0)

    # ------------------------------------------------------------------------------------------------ host side
    @cute.jit
    def launch(self, a_addr: Int64, b_addr: Int64, c_addr: Int64, offs_addr: Int64, toffs_addr: Int64,
               sa_addr: Int64, sb_addr: Int64, n_rows: Int32, n_experts: Int32, n_ctas: Int32,
               stream: cuda.CUstream):
        N, K, E = self.n, self.k, n_experts
        gm = cute.AddressSpace.gmem
        mA = cute.make_tensor(cute.make_ptr(self.ab_dtype, a_addr, gm, assumed_align=16),
                              cute.make_layout((n_rows, K), stride=(K, 1)))
        mB = cute.make_tensor(cute.make_ptr(self.ab_dtype, b_addr, gm, assumed_align=16),
                              cute.make_layout((N, K, E), stride=(K, 1, N * K)))
        mC = cute.make_tensor(cute.make_ptr(cutlass.BFloat16, c_addr, gm, assumed_align=16),
                              cute.make_layout((n_rows, N), stride=(N, 1)))
        mOffs = cute.make_tensor(cute.make_ptr(Int32, offs_addr, gm, assumed_align=4), cute.make_layout(E + 1))
        mToffs = cute.make_tensor(cute.make_ptr(Int32, toffs_addr, gm, assumed_align=4), cute.make_layout(E + 1))
        kb = K // SCALE_BLOCK
        mSA = cute.make_tensor(cute.make_ptr(Float32, sa_addr, gm, assumed_align=4),
                               cute.make_layout((n_rows, kb), stride=(kb, 1)))
        mSB = cute.make_tensor(cute.make_ptr(Float32, sb_addr, gm, assumed_align=4),
                               cute.make_layout((N // SCALE_BLOCK, kb, E), stride=(kb, 1, (N // SCALE_BLOCK) * kb)))

        tile_mnk = (self.tile_m, self.tile_n, self.tile_k)
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, cute.nvgpu.warpgroup.OperandMajorMode.K,
            cute.nvgpu.warpgroup.OperandMajorMode.K, Float32, (1 if self.pingpong else self.num_consumer_wg, 1, 1),
            tiler_mn=(64, self.tile_n))
        a_smem = sm90_utils.make_smem_layout_a(utils.LayoutEnum.ROW_MAJOR, tile_mnk, self.ab_dtype, self.stages)
        b_smem = sm90_utils.make_smem_layout_b(utils.LayoutEnum.ROW_MAJOR, tile_mnk, self.ab_dtype, self.stages)
        a_one = cute.slice_(a_smem, (None, None, 0))
        b_one = cute.slice_(b_smem, (None, None, 0))
        op = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        if cutlass.const_expr(self.cn > 1):
            tma_a, tA = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp(), mA, a_one, (self.tile_m, self.tile_k),
                num_multicast=self.cn)
        else:
            tma_a, tA = cute.nvgpu.cpasync.make_tiled_tma_atom(op, mA, a_one, (self.tile_m, self.tile_k))
        tma_b, tB = cute.nvgpu.cpasync.make_tiled_tma_atom(op, mB, b_one, (self.tile_n, self.tile_k))

        @cute.struct
        class Storage:
            bars: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(a_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(b_smem)], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, max(1, self.epi_smem_elems)], 128]

        self.storage = Storage
        self.kernel(tma_a, tA, tma_b, tB, mC, mOffs, mToffs, mSA, mSB, n_rows, E, tiled_mma, a_smem,
                    b_smem).launch(
            grid=[n_ctas, 1, 1], block=[self.threads, 1, 1], cluster=[self.cn, 1, 1], min_blocks_per_mp=1,
            stream=stream)

    # ------------------------------------------------------------------------------------------------ device side
    @cute.jit
    def locate(self, t: Int32, e: Int32, mOffs: cute.Tensor, mToffs: cute.Tensor, rank: Int32):
        """Work item t -> (expert, first row, valid rows, n-tile); ``e`` is a lower bound for the expert.
        Item t = (m-tile, group of cn adjacent n-tiles); ``rank`` (in the cluster) picks the n-tile of the group."""
        mt = t // self.n_groups
        nt = (t - mt * self.n_groups) * self.cn + rank
        while mToffs[e + 1] <= mt:
            e = e + 1
        row0 = mOffs[e] + (mt - mToffs[e]) * self.tile_m
        rows = cutlass.min(mOffs[e + 1] - row0, self.tile_m)
        return e, row0, rows, nt

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
               mC: cute.Tensor, mOffs: cute.Tensor, mToffs: cute.Tensor, mSA: cute.Tensor, mSB: cute.Tensor,
               n_rows: Int32, n_experts: Int32, tiled_mma: cute.TiledMma, a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        # clusters along grid x: cluster cid = bid // cn walks items cid, cid + n_cl, ...; every CTA of a cluster
        # walks the same items (same m-tile and A rows, its own n-tile), in lockstep through the shared A stages
        rank = Int32(0)
        if cutlass.const_expr(self.cn > 1):
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cid = bid // self.cn
        n_cl = nblk // self.cn
        cta_layout_vmnk = cute.make_layout((1, 1, self.cn, 1))
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)

        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(self.storage)
        a_one = cute.slice_(a_smem, (None, None, 0))
        b_one = cute.slice_(b_smem, (None, None, 0))
        tx_bytes = cute.size_in_bytes(self.ab_dtype, a_one) + cute.size_in_bytes(self.ab_dtype, b_one)
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.bars.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            # one arrive per consumer warp and CTA of the cluster: a stage's A half is multicast into every CTA of
            # the cluster, so its producer may refill the stage only when all of them released it
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     4 if self.pingpong else self.num_consumer_wg * 4 * self.cn),
            tx_count=tx_bytes, cta_layout_vmnk=cta_layout_vmnk, defer_sync=True)
        cluster_mn = cute.make_layout((1, self.cn))
        if cutlass.const_expr(self.cn > 1):
            pipeline.pipeline_init_arrive(cluster_shape_mn=cluster_mn, is_relaxed=True)
        else:
            pipeline.pipeline_init_arrive()
        sA = st.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sB = st.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)

        # B: (TMA, n_tile, k_tile, expert) coordinates, partitioned once
        gB = cute.local_tile(mB, (self.tile_n, self.tile_k), (None, None, None))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2),
                                                      cute.group_modes(gB, 0, 2))
        total = mToffs[n_experts] * self.n_groups
        if cutlass.const_expr(self.cn > 1):
            pipeline.pipeline_init_wait(cluster_shape_mn=cluster_mn)
        else:
            pipeline.pipeline_init_wait()

        wg = cute.arch.make_warp_uniform(tidx // 128)
        if wg == 0:
            cute.arch.setmaxregister_decrease(40)
            if warp_idx == 0:
                prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                mcast = None
                if cutlass.const_expr(self.cn > 1):
                    mcast = cute.make_layout_image_mask(cute.make_layout((1, self.cn, 1)), (0, rank, 0), mode=1)
                e = Int32(0)
                t = cid
                while t < total:
                    e, row0, rows, nt = self.locate(t, e, mOffs, mToffs, rank)
                    gA = cute.local_tile(cute.domain_offset((row0, 0), mA), (self.tile_m, self.tile_k), (0, None))
                    # cluster: this CTA loads its 1/cn slice of the A tile and multicasts it to the whole cluster
                    tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                        tma_a, rank, cute.make_layout(self.cn), cute.group_modes(sA, 0, 2),
                        cute.group_modes(gA, 0, 2))
                    for kt in cutlass.range(self.k_tiles, unroll=1):
                        pipe.producer_acquire(prod)
                        bar = pipe.producer_get_barrier(prod)
                        if cutlass.const_expr(self.cn > 1):
                            cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, prod.index)], tma_bar_ptr=bar,
                                      mcast_mask=mcast)
                        else:
                            cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, prod.index)], tma_bar_ptr=bar)
                        cute.copy(tma_b, tBgB[(None, nt, kt, e)], tBsB[(None, prod.index)], tma_bar_ptr=bar)
                        pipe.producer_commit(prod)
                        prod.advance()
                    t = t + n_cl
                pipe.producer_tail(prod)
        else:
            cute.arch.setmaxregister_increase(232)
            cwg = wg - 1  # consumer warpgroup 0 / 1
            wtid = tidx - 128 * wg  # thread index inside this warpgroup (0..127): the smem epilogue's index
            if cutlass.const_expr(self.pingpong):
                ctid = tidx - 128 * wg
                wg_row0 = 0
            else:
                ctid = tidx - 128
                wg_row0 = cwg * (self.tile_m // 2)
            thr_mma = tiled_mma.get_slice(ctid)
            tCsA = thr_mma.partition_A(sA)
            tCsB = thr_mma.partition_B(sB)
            tCrA = tiled_mma.make_fragment_A(tCsA)
            tCrB = tiled_mma.make_fragment_B(tCsB)
            cC = cute.make_identity_tensor((self.tile_m, self.tile_n))
            tCcC = thr_mma.partition_C(cC)
            acc = cute.make_rmem_tensor(tCcC.shape, Float32)
            if cutlass.const_expr(_DEBUG_LAYOUT):
                print("acc layout", acc.layout, "tCcC", tCcC.layout)
            tmp = cute.make_rmem_tensor(tCcC.shape, Float32)
            tmp2 = tmp
            if cutlass.const_expr(self.dbuf):
                tmp2 = cute.make_rmem_tensor(tCcC.shape, Float32)
            sC = None
            if cutlass.const_expr(self.epi == "smem"):
                sC_all = st.sC.get_tensor(cute.make_layout(
                    (self.epi_rows, EPI_N + EPI_PAD, self.num_consumer_wg),
                    stride=(EPI_N + EPI_PAD, 1, self.epi_rows * (EPI_N + EPI_PAD))))
                sC = sC_all[(None, None, cwg)]
            rd = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            rl = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            # the accumulator rows of this thread inside the tile (wgmma C fragment: row, row + 8; pingpong: and
            # the same two 64 rows further down)
            r_lo = tCcC[0][0]
            e = Int32(0)
            t = cid
            j = Int32(0)
            while t < total:
                e, row0, rows, nt = self.locate(t, e, mOffs, mToffs, rank)
                mine = True
                if cutlass.const_expr(self.pingpong):
                    mine = (j % 2) == cwg
                if mine:
                    if cutlass.const_expr(self.pingpong):  # noqa: SIM102 (compile-time outer if)
                        # mainloop order: wait until the other warpgroup has finished the mainloop of item j - 1.
                        # Without it this warpgroup's first wait (k_tiles stages ahead of the producer, possibly
                        # several ring rounds) can pass on an earlier phase of the same parity: stale data, early
                        # releases, TMA into live stages ('unspecified launch failure' in the v2 sweep).
                        if j > 0:
                            cute.arch.barrier(barrier_id=_ORDER_BAR + cwg, number_of_threads=256)
                    acc.fill(0.0)
                    if cutlass.const_expr(not self.fp8 or self.diag == "no_promote"):
                        # (diag no_promote: fp8 codes accumulated raw into acc, no per-block promotion)
                        rd, rl, tiled_mma = self.mainloop_bf16(pipe, rd, rl, tiled_mma, acc, tCrA, tCrB)
                    elif cutlass.const_expr(self.dbuf):
                        rd, rl, tiled_mma = self.mainloop_fp8_dbuf(pipe, rd, rl, tiled_mma, acc, tmp, tmp2, tCrA, tCrB, mSA, mSB,
                                               row0, r_lo, n_rows, nt, e)
                    else:
                        rd, rl, tiled_mma = self.mainloop_fp8(pipe, rd, rl, tiled_mma, acc, tmp, tCrA, tCrB, mSA, mSB, row0, r_lo,
                                          n_rows, nt, e)
                    if cutlass.const_expr(self.pingpong):  # noqa: SIM102 (compile-time outer if)
                        # the next item (the other warpgroup's) may start its mainloop; this one's epilogue
                        # overlaps it. No arrive without a next item: every arrive has a matching wait.
                        if t + n_cl < total:
                            cute.arch.barrier_arrive(barrier_id=_ORDER_BAR + 1 - cwg, number_of_threads=256,
                                                     aligned=False)
                    if cutlass.const_expr(self.diag == "no_epilogue"):
                        # diagnostic: the epilogue behind a runtime test that is never true (n_rows > 0), so the
                        # compiler keeps acc and every wgmma live, and the tile is never stored
                        if n_rows < 0:
                            self.epilogue(acc, tCcC, sC, mC, row0, rows, nt, wg_row0, wtid, cwg)
                    else:
                        self.epilogue(acc, tCcC, sC, mC, row0, rows, nt, wg_row0, wtid, cwg)
                else:
                    # the other warpgroup's tile: skip its stages (no wait, no release)
                    for _kt in cutlass.range(self.k_tiles, unroll=1):
                        rd.advance()
                        rl.advance()
                t = t + n_cl
                j = j + 1
        if cutlass.const_expr(self.cn > 1):
            # no CTA leaves while a cluster peer may still multicast into its shared memory or arrive on its
            # barriers (the producer's tail waits cover the stages; this covers the rest)
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()

    @cute.jit
    def epilogue(self, acc, tCcC, sC, mC, row0, rows, nt, wg_row0, wtid, cwg):
        if cutlass.const_expr(self.epi == "smem"):
            self.epilogue_smem(acc, tCcC, sC, mC, row0, rows, nt, wg_row0, wtid, cwg)
        else:
            # registers -> global, rows past the expert's end are not written
            gC = cute.local_tile(cute.domain_offset((row0, 0), mC), (self.tile_m, self.tile_n), (0, nt))
            for i in cutlass.range_constexpr(cute.size(acc)):
                m, n = tCcC[i]
                if m < rows:
                    gC[m, n] = acc[i].to(cutlass.BFloat16)

    @cute.jit
    def mainloop_bf16(self, pipe, rd, rl, tiled_mma, acc, tCrA, tCrB):
        n_kb = cute.size(tCrA, mode=[2])
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        # prologue: first k-tile, no release yet (one wgmma batch stays in flight)
        pipe.consumer_wait(rd)
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(n_kb):
            cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, rd.index)], tCrB[(None, None, kb, rd.index)], acc)
        cute.nvgpu.warpgroup.commit_group()
        rd.advance()
        for kt in cutlass.range(1, self.k_tiles, unroll=1):
            pipe.consumer_wait(rd)
            # explicit wgmma.fence per k-block (as CUTLASS's warpgroup_arrive): without it ptxas injects one and,
            # in the cluster variants, serializes every wgmma (C7520 "compiler-inserted WG.AR in divergent path")
            cute.nvgpu.warpgroup.fence()
            for kb in cutlass.range_constexpr(n_kb):
                cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, rd.index)], tCrB[(None, None, kb, rd.index)], acc)
            cute.nvgpu.warpgroup.commit_group()
            cute.nvgpu.warpgroup.wait_group(1)
            pipe.consumer_release(rl)
            rl.advance()
            rd.advance()
        cute.nvgpu.warpgroup.wait_group(0)
        pipe.consumer_release(rl)
        rl.advance()
        return rd, rl, tiled_mma

    @cute.jit
    def scales(self, mSA, mSB, row0, r_lo, n_rows, nt, e, kt):
        """x_scale * w_scale of k-block kt for this thread's rows (r_lo, r_lo + 8)."""
        g_lo = cutlass.min(row0 + r_lo, n_rows - 1)
        g_hi = cutlass.min(row0 + r_lo + 8, n_rows - 1)
        sb = mSB[nt * (self.tile_n // SCALE_BLOCK), kt, e]
        return mSA[g_lo, kt] * sb, mSA[g_hi, kt] * sb

    @cute.jit
    def issue_block(self, pipe, rd, tiled_mma, tmp, tCrA, tCrB):
        """Wait for the stage, issue its wgmma batch into ``tmp`` (overwriting), commit."""
        n_kb = cute.size(tCrA, mode=[2])
        pipe.consumer_wait(rd)
        cute.nvgpu.warpgroup.fence()
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        for kb in cutlass.range_constexpr(n_kb):
            cute.gemm(tiled_mma, tmp, tCrA[(None, None, kb, rd.index)], tCrB[(None, None, kb, rd.index)], tmp)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        cute.nvgpu.warpgroup.commit_group()
        return tiled_mma

    @cute.jit
    def promote(self, acc, tmp, s_lo, s_hi):
        for i in cutlass.range_constexpr(cute.size(acc)):
            # fragment element i sits on row r_lo + 8 * ((i // 2) % 2) (wgmma C layout)
            if cutlass.const_expr((i // 2) % 2 == 0):
                acc[i] = acc[i] + tmp[i] * s_lo
            else:
                acc[i] = acc[i] + tmp[i] * s_hi

    @cute.jit
    def mainloop_fp8(self, pipe, rd, rl, tiled_mma, acc, tmp, tCrA, tCrB, mSA, mSB, row0, r_lo, n_rows, nt, e):
        for kt in cutlass.range(self.k_tiles, unroll=1):
            tiled_mma = self.issue_block(pipe, rd, tiled_mma, tmp, tCrA, tCrB)
            s_lo, s_hi = self.scales(mSA, mSB, row0, r_lo, n_rows, nt, e, kt)
            cute.nvgpu.warpgroup.wait_group(0)
            pipe.consumer_release(rd)
            rd.advance()
            rl.advance()
            self.promote(acc, tmp, s_lo, s_hi)
        return rd, rl, tiled_mma

    @cute.jit
    def mainloop_fp8_dbuf(self, pipe, rd, rl, tiled_mma, acc, ta, tb, tCrA, tCrB, mSA, mSB, row0, r_lo, n_rows,
                          nt, e):
        # block 0 -> ta; then pairs: (issue odd -> tb, promote ta), (issue even -> ta, promote tb); k_tiles even
        tiled_mma = self.issue_block(pipe, rd, tiled_mma, ta, tCrA, tCrB)
        rd.advance()
        p_lo, p_hi = self.scales(mSA, mSB, row0, r_lo, n_rows, nt, e, 0)
        for jj in cutlass.range(self.k_tiles // 2 - 1, unroll=1):
            kt = 2 * jj + 1
            tiled_mma = self.issue_block(pipe, rd, tiled_mma, tb, tCrA, tCrB)
            rd.advance()
            n_lo, n_hi = self.scales(mSA, mSB, row0, r_lo, n_rows, nt, e, kt)
            cute.nvgpu.warpgroup.wait_group(1)
            pipe.consumer_release(rl)
            rl.advance()
            self.promote(acc, ta, p_lo, p_hi)
            tiled_mma = self.issue_block(pipe, rd, tiled_mma, ta, tCrA, tCrB)
            rd.advance()
            p_lo, p_hi = self.scales(mSA, mSB, row0, r_lo, n_rows, nt, e, kt + 1)
            cute.nvgpu.warpgroup.wait_group(1)
            pipe.consumer_release(rl)
            rl.advance()
            self.promote(acc, tb, n_lo, n_hi)
        tiled_mma = self.issue_block(pipe, rd, tiled_mma, tb, tCrA, tCrB)
        rd.advance()
        n_lo, n_hi = self.scales(mSA, mSB, row0, r_lo, n_rows, nt, e, self.k_tiles - 1)
        cute.nvgpu.warpgroup.wait_group(1)
        pipe.consumer_release(rl)
        rl.advance()
        self.promote(acc, ta, p_lo, p_hi)
        cute.nvgpu.warpgroup.wait_group(0)
        pipe.consumer_release(rl)
        rl.advance()
        self.promote(acc, tb, n_lo, n_hi)
        return rd, rl, tiled_mma

    @cute.jit
    def epilogue_smem(self, acc, tCcC, sC, mC, row0, rows, nt, wg_row0, wtid, cwg):
        """Per 64-column chunk: fragment -> padded smem (this warpgroup's buffer) -> 16-byte coalesced stores.
        ``wtid`` is the thread's index inside its warpgroup (0..127; v2 passed the consumer index 0..255, so the
        second warpgroup read rows 16..79 of its 64-row buffer and rows 64..79 of each tile were never stored).
        Index maps checked on CPU: tests/test_grouped_gemm_wgmma.py::test_smem_epilogue_covers_tile."""
        n8 = self.tile_n // 8  # 8-column blocks of the wgmma C fragment
        vec_per_row = EPI_N // 8
        n_vec = self.epi_rows * vec_per_row
        gC = cute.local_tile(cute.domain_offset((row0 + wg_row0, 0), mC), (self.epi_rows, EPI_N), (0, None))
        for c in cutlass.range_constexpr(self.tile_n // EPI_N):
            cute.arch.barrier(barrier_id=1 + cwg, number_of_threads=128)  # previous chunk read out
            for i in cutlass.range_constexpr(cute.size(acc)):
                # flat fragment index i = v + 4 * (n8 block) + 4 * n8 * (m rep): its 8-column block is static
                if cutlass.const_expr(((i // 4) % n8) // (EPI_N // 8) == c):
                    m, n = tCcC[i]
                    sC[m - wg_row0, n - c * EPI_N] = acc[i].to(cutlass.BFloat16)
            cute.arch.barrier(barrier_id=1 + cwg, number_of_threads=128)
            gCc = gC[(None, None, nt * (self.tile_n // EPI_N) + c)]
            for q in cutlass.range_constexpr(n_vec // 128):
                v = wtid + 128 * q
                r = v // vec_per_row
                cv = v - r * vec_per_row
                if wg_row0 + r < rows:
                    src = cute.local_tile(sC, (1, 8), (r, cv))
                    dst = cute.local_tile(gCc, (1, 8), (r, cv))
                    frag = cute.make_rmem_tensor((1, 8), cutlass.BFloat16)
                    cute.autovec_copy(src, frag)
                    cute.autovec_copy(frag, dst)

def compiled(n: int, k: int, variant):
    """Compile once per (N, K, variant name; a bool = the default fp8/bf16 variant); returns
    ``f(a, b, c, offs, tile_offs, sa, sb, R, E, n_ctas, stream)`` (addresses as ints; sa/sb ignored, may be 0,
    for bf16)."""
    return _compiled(n, k, variant_config(variant)["name"])


@functools.lru_cache(maxsize=64)
def _compiled(n: int, k: int, variant: str):
    g = _GroupedGemm(n, k, variant)
    return cute.compile(g.launch, Int64(0), Int64(0), Int64(0), Int64(0), Int64(0), Int64(0), Int64(0),
                        Int32(1), Int32(1), Int32(1), cuda.CUstream(0))
