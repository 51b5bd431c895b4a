"""Every constant the cost models use, with its source.

Legend for the ``# source:`` notes:

* **published** — a vendor datasheet, a paper, or a project's README / source file (named);
* **measured** — on the project's H200 machines (2026-11, torch 2.11, NCCL 2.28); the measurement files are in
  ``results/h200x2/`` (``calibration/README.md`` describes them);
* **derived** — computed from published numbers (the computation is given);
* **assumption** — no public source pins it down; chosen to be plausible, stated so that a calibration table
  (``sim.costs.calibration``) or an edit here can replace it. The column "calibrated by" in
  ``sim/costs/README.md`` lists which calibration kind overrides which constant.

Units are in the names (``_us`` microseconds, ``_GBps`` 1e9 B/s, ``_s`` seconds). Hardware *specs* (peak FLOP/s,
HBM bandwidth, link rates and latencies, NIC rates) are not here: they come from the topology's ``GpuSpec``,
``LinkSpec``, ``SwitchSpec`` and ``NicSpec``. This module holds only what turns peaks into achieved rates and
what adds fixed costs.
"""

from __future__ import annotations

# ------------------------------------------------------------------------------------------------ memory

#: Achievable fraction of the HBM datasheet bandwidth for a streaming kernel.
#: hopper: measured 4.3 TB/s copy on H200 (read + write; 4.2-4.3 TB/s for large elementwise copies in
#: calibration/measurements/measure_h200x2_v10.json.gz) / 4.8 TB/s datasheet = 0.896.
#: blackwell: assumption — the same fraction (no measurement on the project's machines yet).
HBM_EFFICIENCY: dict[str, float] = {"hopper": 4.3 / 4.8, "blackwell": 0.9}

#: An SM can pull at most this multiple of its fair share (hbm_GBps / sm_count) of HBM bandwidth, so a kernel
#: with few CTAs (a grouped GEMM over 2 experts) cannot stream at the full rate. assumption (Little's law with a
#: few KB of loads in flight per SM; microbenchmarks put single-SM bandwidth at 1.5-3x the fair share).
PER_SM_BW_FACTOR: float = 2.0

# ------------------------------------------------------------------------------------------------ kernels

#: Fixed cost of one kernel inside a CUDA graph: launch gap + prologue (pipeline fill, first loads) + epilogue
#: and tail. assumption (graph-launched kernels show ~1-2 µs gaps; pipeline fill of a TMA GEMM ~1 µs). The
#: default only: a calibration table's ``kernel_fixed_us`` replaces it for its GPU model
#: (``sim.costs.calibration.kernel_fixed_us``; H200-SXM measured 0.87 µs, graph-replayed copies, calibration/h200.yaml).
KERNEL_FIXED_US: float = 2.5

#: Split-K: a plain GEMM with fewer CTA tiles than SMs splits K into up to ``sm_count // tiles`` parts of at
#: least this many elements (the small fp32 partial outputs are reduced through L2; not counted as HBM bytes).
#: assumption (cuBLAS heuristics split down to a few hundred K elements).
SPLIT_K_MIN_K: int = 512

#: Extra fixed cost of a *grouped* GEMM: reading the per-expert offsets / building the tile schedule (a
#: persistent scheduler's first pass). assumption.
GROUPED_GEMM_EXTRA_US: float = 1.0

# ------------------------------------------------------------------------------------------------ GEMM

#: GEMM CTA tile (BLOCK_M, BLOCK_N) by architecture: Hopper wgmma issues M=64 per warpgroup (PTX ISA,
#: ``wgmma.mma_async.m64nNk*``) and CUTLASS / DeepGEMM use 64..128 x 128 tiles; Blackwell ``tcgen05.mma`` runs
#: M=128 per CTA (PTX ISA). published (instruction shapes); tile N = 128: assumption (common default).
GEMM_TILE: dict[str, tuple[int, int]] = {"hopper": (64, 128), "blackwell": (128, 128)}

#: Fraction of the dense peak a large, well-shaped GEMM reaches, by (architecture, format).
#: hopper bf16 0.80: measured ≈790 TFLOP/s of 989 on H200 for a large bf16 GEMM (the attention-projection
#: shapes of calibration/measurements/measure_h200x2_v10.json.gz reach 763 TFLOP/s at m = 16384).
#: hopper fp8_block 0.72: DeepGEMM README, up to 1426 TFLOP/s of 1979 at large M on H800 (published).
#: hopper fp8 (per-tensor) 0.75: assumption, a little above block scaling (no promotion work).
#: blackwell bf16/fp8/mx*: assumption 0.80 / 0.78 (CUTLASS Blackwell GEMMs report ~75-85 % of peak).
#: blackwell fp8_block 0.62: assumption — 128x128 fp32 block scales are not native to tcgen05 (native block
#: scaling is MX: 32-element UE8M0 / NVFP4), so the scales are applied by CUDA-core promotion as on Hopper; the
#: write-up calls it "a sub-optimal block-scaling scheme" and finds MXFP8 faster.
#: blackwell mxfp4/nvfp4 0.70: assumption (FP4 GEMMs are harder to feed; wider gap to peak).
MMA_EFFICIENCY: dict[str, dict[str, float]] = {
    "hopper": {"bf16": 0.80, "fp8": 0.75, "fp8_block": 0.72},
    "blackwell": {"bf16": 0.80, "fp8": 0.78, "fp8_block": 0.62, "mxfp8": 0.78, "mxfp6": 0.78, "mxfp4": 0.70,
                  "nvfp4": 0.70},
}

#: How formats without tensor-core support run on an architecture: (executed as, efficiency multiplier).
#: Hopper has no MX / FP4 tensor cores (NVIDIA Hopper whitepaper; topology GpuSpec rates are None):
#: MXFP8 runs on the FP8 tensor cores with its E8M0 scales applied in the main loop like DeepGEMM's block
#: promotion (x0.95, assumption); MXFP6 / MXFP4 / NVFP4 are weight-only formats there: weights are read in
#: their packed form (the byte saving stays) and dequantised to FP8 in registers before the FP8 MMA (x0.75,
#: assumption — W4A8 kernels such as Machete / Marlin-style dequant lose ~20-30 % of the MMA rate).
HOPPER_EMULATION: dict[str, tuple[str, float]] = {
    "mxfp8": ("fp8", 0.95),
    "mxfp6": ("fp8", 0.75),
    "mxfp4": ("fp8", 0.75),
    "nvfp4": ("fp8", 0.75),
}

#: Activation format actually used for the GEMM input when the weights are in ``fmt`` and the input is
#: quantised on the fly (native W8A8 / W4A4 on Blackwell). On Hopper 4/6-bit weight formats run W?A8
#: (activations in FP8, 1 B). derived from the execution mapping above.
HOPPER_ACTIVATION_FORMAT: dict[str, str] = {"mxfp8": "mxfp8", "mxfp6": "fp8", "mxfp4": "fp8", "nvfp4": "fp8"}

# ------------------------------------------------------------------------------------------------ attention

#: Flash-attention forward efficiency (fraction of the bf16 dense peak) for long causal sequences.
#: hopper 0.62: FlashAttention-3 paper (Shah et al. 2024): 600-660 TFLOP/s causal bf16 fwd, head_dim 128, at
#: 8-16K on H100 (989 peak) — published. blackwell 0.60: assumption (FA4 / cuDNN report ~1.5 PFLOP/s of 2.5).
FLASH_EFFICIENCY: dict[str, float] = {"hopper": 0.62, "blackwell": 0.60}

#: Sequence length at which flash-attention efficiency is half its maximum (eff = max * L / (L + L_half)).
#: assumption (FA3's curves rise from ~1/3 of max at 512 tokens to near max at 8K).
FLASH_HALF_SEQ_TOKENS: float = 1024.0

#: Decode (paged) attention: fraction of the achievable HBM bandwidth a split-KV / paged decode kernel reaches
#: on the KV reads. assumption (FlashInfer / FlashMLA report 70-90 % of peak at long contexts).
DECODE_ATTN_BW_EFFICIENCY: float = 0.80

#: KV page size in tokens for paged attention (vLLM default block size 16). published (vLLM docs).
KV_PAGE_TOKENS: int = 16

#: Gated DeltaNet chunk size (flash-linear-attention's chunked kernels default to 64). published (FLA source).
GDN_CHUNK_TOKENS: int = 64

#: Gated DeltaNet chunked kernels: fraction of the bf16 peak they reach. assumption (FLA Triton kernels run
#: far below flash-attention; ~25-35 % reported).
GDN_EFFICIENCY: float = 0.30

#: Recurrent-state element size (bytes): the model dtype (bf16), vLLM's default mamba/linear-attention state
#: dtype — the same convention as engine.core.sharding's memory budget. published (vLLM ``mamba_ssm_cache_dtype``
#: "auto"); an fp32 state would double the decode state traffic.
GDN_STATE_ELEM_BYTES: float = 2.0

#: Element-wise / norm kernels per decoder layer that read and write the hidden state (input RMSNorm,
#: post-attention RMSNorm, two residual adds; some fused in practice). assumption.
ELEMENTWISE_PASSES_PER_LAYER: int = 4

# ------------------------------------------------------------------------------------------------ collectives

#: NCCL base latency (µs) by protocol (Ring LL / LL128 / Simple). published (NCCL src/graph/tuning.cc).
NCCL_BASE_LAT_US: dict[str, float] = {"LL": 6.6, "LL128": 14.0, "Simple": 8.4}

#: NCCL per-step hardware latency (µs) of a ring step over NVLink / over the network, by protocol.
#: published (NCCL src/graph/tuning.cc). The network values include the NIC; NCCL adds NIC post overhead.
NCCL_RING_STEP_US: dict[str, dict[str, float]] = {
    "nvlink": {"LL": 0.6, "LL128": 1.9, "Simple": 3.4},
    "net": {"LL": 2.7, "LL128": 4.0, "Simple": 14.0},
}

#: NCCL protocol bandwidth factors: LL sends 4 B of flag per 4 B of data (x0.5), LL128 120 of 128 B (NCCL uses
#: 0.92 in tuning.cc), Simple full rate. published (NCCL tuning.cc).
NCCL_PROTO_BW_FACTOR: dict[str, float] = {"LL": 0.5, "LL128": 0.92, "Simple": 1.0}

#: NVLS (NVLink SHARP / multimem) bandwidth efficiency by architecture. published (NCCL ``nvlsEfficiency``:
#: Hopper 0.85, Blackwell 0.74). Applied to the GPU's effective NVLink bandwidth on the physical per-direction
#: NVLS bytes (B + B/N, see engine.core.collectives); on 8xH100 that gives ≈490 GB/s bus bandwidth against
#: the ≈480 measured (nccl-tests#212).
NVLS_EFFICIENCY: dict[str, float] = {"hopper": 0.85, "blackwell": 0.74}

#: Symmetric-memory custom kernels (one-shot / two-shot / multimem all-reduce, all-to-all): cost of one
#: cross-GPU synchronisation on top of the link latency — a release fence, a flag store, and the peer's
#: polling seeing it. assumption; lower on Blackwell as the write-up states ("lower peer-to-peer latency"),
#: no published number.
SIGNAL_US: dict[str, float] = {"hopper": 1.0, "blackwell": 0.7}

#: Serialised cost per peer in a symmetric-memory kernel: the per-peer work (copies, flag stores, flag polls)
#: runs on parallel warps, so only a few dependent instructions and one more L2 / flag access per peer are
#: exposed (~tens of ns). assumption.
PER_PEER_US: float = 0.03

#: One grid-wide barrier inside a persistent kernel (cooperative groups ``grid.sync``). assumption (~1 µs on
#: H100-class GPUs in microbenchmarks).
GRID_SYNC_US: float = 1.0

#: NIC work-request post overhead per message when the GPU posts RDMA itself (IBGDA on ConnectX). The range
#: usually quoted for an RDMA work-request post is 1-2 µs end to end (no vendor number); midpoint.
NIC_POST_US: float = 1.5

#: Extra per-message cost when a CPU proxy thread posts the work (EFA has no GPU-initiated RDMA: the GPU
#: writes a descriptor to host memory, a proxy thread polls it and posts). assumption (a few µs: one PCIe round
#: trip plus proxy polling).
CPU_PROXY_US: float = 4.0

#: Messages a GPU-initiated NIC path can have in flight in parallel (one QP per peer, posted by parallel
#: warps): the per-message post overhead is paid once per this many peers. assumption.
NIC_PARALLEL_POSTS: int = 8

#: SMs the communication kernels (all-to-all dispatch / combine, all-reduces) occupy while they run alongside
#: compute in an overlapped step (``sim.costs.overlap``): compute that runs under communication gets the other
#: ``sm_count - OVERLAP_COMM_SMS`` SMs and is stretched by ``sm_count / (sm_count - OVERLAP_COMM_SMS)``.
#: assumption: 20 SMs, the order of the SM budget DeepEP-style exchange kernels are configured with (a share
#: of 20/132 = 0.15 on H100/H200, 20/152 = 0.13 on GB200); a kernel that waits without holding SMs would cost
#: less.
OVERLAP_COMM_SMS: int = 20

# ------------------------------------------------------------------------------------------------ KV transfer

#: Fraction of a NIC's line rate a bulk RDMA write stream reaches. derived: TransferEngine reaches 400 Gb/s
#: peak on CX-7 and EFA (arXiv 2510.27656) — we take 0.95 of line rate.
KV_NIC_EFFICIENCY: float = 0.95

#: Fraction of a NIC's line rate the EP all-to-all's RDMA traffic reaches across nodes (``sim.costs.moe_comm.
#: ep_comm``): the same bulk-RDMA fraction as a KV stream. derived (as ``KV_NIC_EFFICIENCY``).
EP_NIC_EFFICIENCY: float = KV_NIC_EFFICIENCY

#: Per-chunk (per RDMA write) overhead by NIC kind: descriptor post and completion bookkeeping. ib: the NIC
#: post overhead above; efa: plus the CPU proxy. derived / assumption.
KV_CHUNK_OVERHEAD_US: dict[str, float] = {"ib": NIC_POST_US, "efa": NIC_POST_US + CPU_PROXY_US}

#: Chunks whose per-chunk overhead overlaps: work requests are posted in batches (one doorbell for many RDMA
#: writes) with many in flight, so only 1/KV_CHUNK_PIPELINE of the overhead is exposed per chunk (~20 M
#: chunks/s on IB, ~6 M/s through the EFA proxy). assumption.
KV_CHUNK_PIPELINE: int = 32

# ------------------------------------------------------------------------------------------------ host

#: Per forward step cost when one TP group's host code is split over two nodes (the write-up: "host code split
#: over two nodes (talking over Ethernet)"): broadcasting the step's batch metadata and gathering results over
#: TCP. assumption (a TCP round trip on a datacentre network plus serialisation, ~0.2-0.5 ms).
CROSS_NODE_HOST_SYNC_US: float = 300.0

#: Host-side scheduling + sampling overhead per forward step (CUDA-graph replay, sampler, bookkeeping), paid
#: once per step regardless of parallelism. assumption.
HOST_STEP_US: float = 100.0
