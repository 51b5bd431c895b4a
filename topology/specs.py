"""Hardware specs: GPUs, CPUs, links, switches, NICs — and the node / rack / cluster shapes built from them.

Every model is a frozen pydantic v2 model with ``extra="forbid"``; numbers carry their unit in the field name
(``_bytes``, ``_GBps`` = 1e9 B/s per direction, ``_Gbps`` = 1e9 bit/s line rate, ``_us``, ``_tflops`` =
1e12 FLOP/s dense, i.e. without 2:4 sparsity). A value of ``None`` in :class:`FormatRates` means the format has no
tensor-core support on that GPU ("unsupported": Hopper has no MX or FP4 units).

The catalogue below (``GPUS``, ``CPUS``, ``NICS``, ``SWITCHES``, ``LINKS``) holds the parts the presets use; a
topology file may name any of them instead of spelling the spec out. Sources are given beside each entry;
"assumption" marks a number that no public source pins down, chosen to be plausible and easy to replace by
calibration.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, ConfigDict, Field, model_validator

from rackbed.topology.errors import NoBoolNumbers, UserError

PositiveFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
PositiveInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]

GB = 10**9
MiB = 2**20


class _Spec(NoBoolNumbers):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ----------------------------------------------------------------------------------------------- leaf specs


class FormatRates(_Spec):
    """Dense tensor-core throughput per number format, TFLOP/s (1e12 FLOP/s); ``None`` = unsupported.

    Format names follow ``engine.core.formats``: ``fp8`` is per-tensor-scaled E4M3, ``fp8_block`` is 1x128 /
    128x128 block-scaled FP8 (run on the FP8 tensor cores, scales applied in the epilogue / by promotion).
    """

    bf16: PositiveFloat
    fp8: PositiveFloat | None = None
    fp8_block: PositiveFloat | None = None
    mxfp8: PositiveFloat | None = None
    mxfp6: PositiveFloat | None = None
    mxfp4: PositiveFloat | None = None
    nvfp4: PositiveFloat | None = None

    def get(self, fmt: str) -> float | None:
        """TFLOP/s for format ``fmt`` (None if unsupported); unknown names raise a UserError."""
        if fmt not in type(self).model_fields:
            raise UserError(f"unknown number format {fmt!r} (known: {', '.join(type(self).model_fields)})")
        return getattr(self, fmt)


class GpuPower(_Spec):
    """Electrical draw of one GPU, watts, at three anchor points (``sim.energy`` interpolates between them):

    idle_w:           powered on, holding its weights and KV, running nothing (between steps, spare GPUs);
    memory_bound_w:   running memory-bound kernels (decode GEMVs, attention over the KV cache, collectives);
    compute_bound_w:  running compute-bound kernels at the power limit (large prefill GEMMs) — the board's TDP,
                      and the draw a rack must be able to supply for the GPU.
    """

    idle_w: PositiveFloat
    memory_bound_w: PositiveFloat
    compute_bound_w: PositiveFloat

    @model_validator(mode="after")
    def _ordered(self) -> GpuPower:
        if not self.idle_w <= self.memory_bound_w <= self.compute_bound_w:
            raise ValueError(f"power: need idle_w <= memory_bound_w <= compute_bound_w, got {self.idle_w}, "
                             f"{self.memory_bound_w}, {self.compute_bound_w}")
        return self


class GpuSpec(_Spec):
    """One GPU. ``nvlink_GBps_per_dir`` is the line rate over all ``nvlink_links`` links in one direction;
    ``nvlink_effective_GBps_per_dir`` is what NCCL's topology model assumes (links × per-link effective rate).
    ``power``: its draw (:class:`GpuPower`; None: unknown, the simulator then reports no energy)."""

    name: str
    arch: Literal["hopper", "blackwell"]
    sm_version: PositiveInt
    sm_count: PositiveInt
    hbm_bytes: PositiveInt
    hbm_GBps: PositiveFloat
    l2_bytes: PositiveInt
    dense_tflops: FormatRates
    nvlink_links: NonNegInt
    nvlink_GBps_per_dir: NonNegFloat
    nvlink_effective_GBps_per_dir: NonNegFloat
    power: GpuPower | None = None

    @model_validator(mode="after")
    def _effective_below_line_rate(self) -> GpuSpec:
        if self.nvlink_effective_GBps_per_dir > self.nvlink_GBps_per_dir:
            raise ValueError(
                f"nvlink_effective_GBps_per_dir ({self.nvlink_effective_GBps_per_dir}) exceeds the line rate "
                f"nvlink_GBps_per_dir ({self.nvlink_GBps_per_dir})"
            )
        if self.nvlink_links == 0 and self.nvlink_GBps_per_dir > 0:
            raise ValueError("nvlink_GBps_per_dir > 0 but nvlink_links is 0")
        return self

    @property
    def nvlink_GBps_per_link(self) -> float:
        """Line rate of one NVLink link, per direction (0 if the GPU has none)."""
        return self.nvlink_GBps_per_dir / self.nvlink_links if self.nvlink_links else 0.0


class CpuSpec(_Spec):
    """One host CPU socket (Grace on GB200 trays, x86 on HGX hosts)."""

    name: str
    isa: Literal["arm", "x86"]
    cores: PositiveInt
    mem_bytes: PositiveInt
    mem_GBps: PositiveFloat


class LinkSpec(_Spec):
    """One edge of the topology graph: ``n_links`` physical links bundled, ``GBps_per_dir`` their total line
    rate per direction, ``latency_us`` the one-way latency added by traversing the edge."""

    kind: Literal["nvlink", "c2c", "pcie", "ib", "efa", "ethernet"]
    GBps_per_dir: PositiveFloat
    latency_us: NonNegFloat
    n_links: PositiveInt = 1

    def bundle(self, n: int) -> LinkSpec:
        """``n`` of these links as one edge (bandwidth × n, same latency)."""
        return self.model_copy(update={"GBps_per_dir": self.GBps_per_dir * n, "n_links": self.n_links * n})


class SwitchSpec(_Spec):
    """A switch ASIC. ``sharp``: can reduce in the switch (NVLink SHARP / NVLS on NVSwitch, SHARP on IB);
    ``reduce_GBps``: rate at which it can absorb reduction traffic (0 when not ``sharp``); ``latency_us``: one
    traversal, port to port."""

    name: str = ""
    kind: Literal["nvswitch", "ib", "ethernet"]
    ports: PositiveInt
    sharp: bool
    reduce_GBps: NonNegFloat
    latency_us: NonNegFloat

    @model_validator(mode="after")
    def _reduce_needs_sharp(self) -> SwitchSpec:
        if self.reduce_GBps > 0 and not self.sharp:
            raise ValueError("reduce_GBps > 0 needs sharp: true")
        return self


class NicSpec(_Spec):
    """A scale-out NIC. ``gpu_initiated_rdma``: a GPU kernel can post RDMA work itself (IBGDA on ConnectX);
    EFA cannot (a CPU proxy thread posts work). ``latency_us``: the NIC's share of one-way latency."""

    name: str
    kind: Literal["ib", "efa"]
    line_rate_Gbps: PositiveFloat
    gpu_initiated_rdma: bool
    latency_us: NonNegFloat

    @property
    def GBps(self) -> float:
        """Line rate in gigabytes per second (Gb/s ÷ 8)."""
        return self.line_rate_Gbps / 8


# ----------------------------------------------------------------------------------------------- catalogue

# Power draw (GpuPower). compute_bound_w is the board power limit the vendor publishes. idle_w and
# memory_bound_w are measured on one H200 SXM (results/h200/power/power_draw_h200.json, nvidia-smi every 100 ms
# for 12 s per phase: idle with the driver loaded 80.7 W; a device-to-device copy at 4.25 TB/s 578 W; a bf16
# GEMM at 654 TFLOP/s 692 W against the 700 W limit). No datasheet gives idle or memory-bound draw, so the other
# GPUs take the H200's measured shares of its board limit (idle 11.5 %, memory-bound 82.6 %): an assumption
# until they are measured. The serving runs' check: docs/FIDELITY.md ("GPU power").
# - H100 SXM5 and H800 SXM5: 700 W max TDP (NVIDIA H100 datasheet; H800 the same board power).
# - H200 SXM: 700 W max TDP (NVIDIA H200 datasheet).
# - B200 in HGX B200: 1000 W per GPU (NVIDIA HGX B200 datasheet / DGX B200 datasheet, 14.3 kW per 8-GPU system).
# - B300 in HGX B300: 1100 W per GPU (NVIDIA HGX B300 material; 1100-1200 W are the published figures).
# - GB200: ~1200 W per GPU including its half of a Grace (NVIDIA GB200 NVL72 material: a GB200 superchip, two
#   GPUs and one Grace, is rated up to ~2.7 kW; 2 x 1200 W + ~300 W Grace).
# - GB300: ~1400 W per GPU including its half of a Grace (NVIDIA GB300 NVL72 material gives 1.4 kW per Blackwell
#   Ultra GPU; assumption that the Grace share fits in it).
H200_POWER = GpuPower(idle_w=80.7, memory_bound_w=578.0, compute_bound_w=700.0)


def _h200_shares(board_w: float) -> GpuPower:
    """A board of ``board_w`` W drawing the measured H200's shares of its limit idle and memory-bound."""
    return GpuPower(idle_w=round(board_w * H200_POWER.idle_w / 700.0, 1),
                    memory_bound_w=round(board_w * H200_POWER.memory_bound_w / 700.0, 1), compute_bound_w=board_w)


HOPPER_700W = _h200_shares(700.0)
B200_POWER = _h200_shares(1000.0)
B300_POWER = _h200_shares(1100.0)
GB200_POWER = _h200_shares(1200.0)
GB300_POWER = _h200_shares(1400.0)

# H200 SXM. Sources: NVIDIA H200 datasheet (141 GB HBM3e, 4.8 TB/s, dense BF16 989 / FP8 1979 TFLOP/s — the
# datasheet's 1979 / 3958 figures are with sparsity), Hopper whitepaper (132 SMs on SXM5, 50 MB L2, NVLink-4:
# 18 links, 900 GB/s bidirectional = 450 GB/s per direction); NCCL src/graph/topo.h SM90_NVLINK_BW = 20.6 GB/s
# per link effective (×18 = 370.8). No MX / FP4 tensor cores on Hopper. fp8_block runs at the FP8 rate.
H200_SXM = GpuSpec(
    name="H200-SXM",
    arch="hopper",
    sm_version=90,
    sm_count=132,
    hbm_bytes=141 * GB,
    hbm_GBps=4800.0,
    l2_bytes=50 * MiB,
    dense_tflops=FormatRates(bf16=989.0, fp8=1979.0, fp8_block=1979.0),
    nvlink_links=18,
    nvlink_GBps_per_dir=450.0,
    nvlink_effective_GBps_per_dir=370.8,  # 18 × 20.6
    power=H200_POWER,
)

# GB200 (the Blackwell GPU of a GB200 NVL72 tray). Sources: NVIDIA GB200 NVL72 datasheet (186 GB HBM3e per
# GPU — the Perplexity write-up says 180 GB —, ~8 TB/s; dense BF16 2.5, FP8 5, FP4 10 PFLOP/s per GPU, i.e. half
# the sparse figures), 152 SMs as reported by the CUDA runtime on GB200; NVLink-5: 18 links, 1.8 TB/s
# bidirectional = 900 GB/s per direction; NCCL topo.h SM100_NVLINK_BW = 40.1 GB/s per link (×18 = 721.8).
# L2 126 MiB: microbenchmark reports on B200 (assumption for GB200). MXFP8/MXFP6 at the FP8 rate, MXFP4/NVFP4
# at the FP4 rate (Blackwell tensor cores, datasheet).
GB200_GPU = GpuSpec(
    name="B200-GB200",
    arch="blackwell",
    sm_version=100,
    sm_count=152,
    hbm_bytes=186 * GB,
    hbm_GBps=8000.0,
    l2_bytes=126 * MiB,
    dense_tflops=FormatRates(
        bf16=2500.0, fp8=5000.0, fp8_block=5000.0, mxfp8=5000.0, mxfp6=5000.0, mxfp4=10000.0, nvfp4=10000.0
    ),
    nvlink_links=18,
    nvlink_GBps_per_dir=900.0,
    nvlink_effective_GBps_per_dir=721.8,  # 18 × 40.1
    power=GB200_POWER,
)

# B200 in an HGX B200 board. Sources: NVIDIA HGX B200 datasheet (180 GB HBM3e, 8 TB/s; dense BF16 2.25, FP8 4.5,
# FP4 9 PFLOP/s per GPU = half the sparse figures), 148 SMs; NVLink-5 as GB200.
B200_HGX = GpuSpec(
    name="B200-HGX",
    arch="blackwell",
    sm_version=100,
    sm_count=148,
    hbm_bytes=180 * GB,
    hbm_GBps=8000.0,
    l2_bytes=126 * MiB,
    dense_tflops=FormatRates(
        bf16=2250.0, fp8=4500.0, fp8_block=4500.0, mxfp8=4500.0, mxfp6=4500.0, mxfp4=9000.0, nvfp4=9000.0
    ),
    nvlink_links=18,
    nvlink_GBps_per_dir=900.0,
    nvlink_effective_GBps_per_dir=721.8,  # 18 × 40.1
    power=B200_POWER,
)

# H100 SXM5 (HGX H100). Sources: NVIDIA H100 datasheet (80 GB HBM3 at 3.35 TB/s; dense BF16 989 / FP8 1979
# TFLOP/s, half the datasheet's with-sparsity figures), Hopper whitepaper (132 SMs, 50 MB L2, NVLink-4: 18 links,
# 900 GB/s both directions together = 450 per direction). The same die and NVLink as H200; only the memory
# differs. NCCL effective NVLink rate as H200 (18 × 20.6).
H100_SXM = GpuSpec(
    name="H100-SXM",
    arch="hopper",
    sm_version=90,
    sm_count=132,
    hbm_bytes=80 * GB,
    hbm_GBps=3350.0,
    l2_bytes=50 * MiB,
    dense_tflops=FormatRates(bf16=989.0, fp8=1979.0, fp8_block=1979.0),
    nvlink_links=18,
    nvlink_GBps_per_dir=450.0,
    nvlink_effective_GBps_per_dir=370.8,  # 18 × 20.6
    power=HOPPER_700W,
)

# H800 SXM5: the export variant of H100 SXM5. Same die, SM count, clocks, HBM (80 GB, 3.35 TB/s) and tensor-core
# rates as H100; its NVLink is cut to 400 GB/s both directions together (200 per direction). NVIDIA's H800
# product material states the 400 GB/s; the link count is not published: 8 NVLink-4 links of 25 GB/s per direction
# give that rate (assumption, the count used here), which the NVSwitch board spreads 2/2/2/2 over its four
# switches. NCCL-style effective rate 8 × 20.6 = 164.8 GB/s per direction — DeepSeek's published DeepEP
# measurements on H800 report ~160 GB/s of NVLink bandwidth, close to it.
H800_SXM = H100_SXM.model_copy(update={
    "name": "H800-SXM", "nvlink_links": 8, "nvlink_GBps_per_dir": 200.0, "nvlink_effective_GBps_per_dir": 164.8,
})

# GB300 (the Blackwell Ultra GPU of a GB300 NVL72 tray). Sources: NVIDIA GB300 NVL72 datasheet (per rack: up to
# 21 TB HBM3e at up to 576 TB/s, i.e. 288 GB and 8 TB/s per GPU; FP4 1440 PFLOP/s with sparsity and 1080
# without = 15 dense per GPU; FP8/FP6 720 with sparsity = 5 dense per GPU; BF16 360 with sparsity = 2.5 dense
# per GPU; NVLink 130 TB/s per rack = 1.8 TB/s per GPU both directions), NVIDIA's Blackwell Ultra technical
# overview (160 SMs, compute capability 10.3; the dense FP4 rate is 1.5x Blackwell's, BF16 / FP8 unchanged).
# L2 as B200 (assumption). MXFP8/MXFP6 at the FP8 rate, MXFP4/NVFP4 at the FP4 rate.
GB300_GPU = GpuSpec(
    name="B300-GB300",
    arch="blackwell",
    sm_version=103,
    sm_count=160,
    hbm_bytes=288 * GB,
    hbm_GBps=8000.0,
    l2_bytes=126 * MiB,
    dense_tflops=FormatRates(
        bf16=2500.0, fp8=5000.0, fp8_block=5000.0, mxfp8=5000.0, mxfp6=5000.0, mxfp4=15000.0, nvfp4=15000.0
    ),
    nvlink_links=18,
    nvlink_GBps_per_dir=900.0,
    nvlink_effective_GBps_per_dir=721.8,  # 18 × 40.1, as Blackwell
    power=GB300_POWER,
)

# B300 in an HGX B300 board. Sources: NVIDIA HGX B300 datasheet (8 GPUs: up to 2.3 TB HBM3e = 288 GB per GPU,
# 62 TB/s of HBM bandwidth = 7.75 TB/s per GPU; FP4 144 PFLOP/s with sparsity and 108 without = 13.5 dense per
# GPU; FP8 72 with sparsity = 4.5 dense per GPU; BF16 36 with sparsity = 2.25 dense per GPU; NVLink 1.8 TB/s per
# GPU both directions; one 800 Gb/s ConnectX-8 per GPU), Blackwell Ultra overview (160 SMs, compute capability
# 10.3). The board runs the same chip at a lower power limit than GB300, hence the lower rates.
B300_HGX = GpuSpec(
    name="B300-HGX",
    arch="blackwell",
    sm_version=103,
    sm_count=160,
    hbm_bytes=288 * GB,
    hbm_GBps=7750.0,
    l2_bytes=126 * MiB,
    dense_tflops=FormatRates(
        bf16=2250.0, fp8=4500.0, fp8_block=4500.0, mxfp8=4500.0, mxfp6=4500.0, mxfp4=13500.0, nvfp4=13500.0
    ),
    nvlink_links=18,
    nvlink_GBps_per_dir=900.0,
    nvlink_effective_GBps_per_dir=721.8,  # 18 × 40.1, as Blackwell
    power=B300_POWER,
)

# Grace (one of the 2 per GB200 compute tray). Source: NVIDIA GB200 NVL72 / Grace datasheets: 72 Arm Neoverse V2
# cores, up to 480 GB LPDDR5X at up to 512 GB/s per Grace.
GRACE = CpuSpec(name="Grace", isa="arm", cores=72, mem_bytes=480 * GB, mem_GBps=512.0)

# x86 host CPU of an HGX H200/B200 node (2 per node). Illustrative: Intel Xeon Platinum 8480C as in DGX H100
# (56 cores, 8 × DDR5-4800 channels ≈ 307 GB/s; 1 TB per socket of the DGX's 2 TB).
XEON_8480C = CpuSpec(name="Xeon-8480C", isa="x86", cores=56, mem_bytes=1000 * GB, mem_GBps=307.0)

# ConnectX-7 400 Gb/s NDR InfiniBand (NVIDIA CX-7 datasheet); GPU-initiated RDMA via IBGDA (used by DeepEP).
# latency_us: assumption — a NIC work-request post costs 1–2 µs end to end (sim.costs.constants.NIC_POST_US);
# half of 1 µs per NIC.
CX7_IB = NicSpec(name="CX-7", kind="ib", line_rate_Gbps=400.0, gpu_initiated_rdma=True, latency_us=0.5)

# ConnectX-8 SuperNIC, 800 Gb/s XDR InfiniBand (NVIDIA ConnectX-8 datasheet; one per GPU on GB300 NVL72 and
# HGX B300); GPU-initiated RDMA as CX-7. latency_us: the same assumption as CX-7.
CX8_IB = NicSpec(name="CX-8", kind="ib", line_rate_Gbps=800.0, gpu_initiated_rdma=True, latency_us=0.5)

# AWS EFA on p5en: 16 EFA devices, 3200 Gb/s per node (AWS p5en documentation) = 200 Gb/s each, 2 per GPU;
# no GPU-initiated RDMA (a CPU proxy thread posts work; SRD delivers out of order). latency_us: assumption —
# the proxy hop and SRD make EFA several µs slower than IB per message; 2.5 µs per NIC.
EFA_P5EN = NicSpec(name="EFA-p5en", kind="efa", line_rate_Gbps=200.0, gpu_initiated_rdma=False, latency_us=2.5)

# NVSwitch gen 3 (HGX H100/H200: 4 per board). 64 NVLink-4 ports × 25 GB/s per direction; NVLS capable
# (Hopper whitepaper). reduce_GBps: port bandwidth × NCCL nvlsEfficiency 0.85 for Hopper (NCCL tuning.cc) —
# a derived estimate. latency_us 0.1: assumption, chosen so GPU→switch→GPU totals NCCL's 0.6 µs per-step
# NVLink latency (0.25 + 0.1 + 0.25).
NVSWITCH3 = SwitchSpec(
    name="NVSwitch-3", kind="nvswitch", ports=64, sharp=True, reduce_GBps=64 * 25.0 * 0.85, latency_us=0.1
)

# NVLink Switch ASIC (NVLink-5): 72 ports × 50 GB/s per direction (NVIDIA GB200 NVL72: 9 switch trays × 2 chips,
# 130 TB/s total); NVLS/SHARP capable; reduce_GBps derived with nvlsEfficiency 0.74 for Blackwell (tuning.cc).
NVLINK_SWITCH5 = SwitchSpec(
    name="NVLink-Switch-5", kind="nvswitch", ports=72, sharp=True, reduce_GBps=72 * 50.0 * 0.74, latency_us=0.1
)

# Quantum-2 QM9700 NDR switch: 64 × 400 Gb/s ports, port-to-port < 150 ns, SHARPv3 in-network reduction
# (NVIDIA QM9700 datasheet). reduce_GBps: assumption — bounded by the port rate (64 × 50 GB/s).
QUANTUM2 = SwitchSpec(
    name="Quantum-2-QM9700", kind="ib", ports=64, sharp=True, reduce_GBps=64 * 50.0, latency_us=0.15
)

# Quantum-X800 Q3400 XDR switch: 144 ports of 800 Gb/s, SHARPv4 in-network reduction (NVIDIA Quantum-X800
# datasheet). reduce_GBps: assumption — bounded by the port rate (144 × 100 GB/s). latency_us: as Quantum-2
# (assumption).
QUANTUM_X800 = SwitchSpec(
    name="Quantum-X800-Q3400", kind="ib", ports=144, sharp=True, reduce_GBps=144 * 100.0, latency_us=0.15
)

# The AWS network behind EFA, modelled as one switch tier; no in-network reduction. latency_us: assumption.
EFA_FABRIC = SwitchSpec(name="AWS-EFA-fabric", kind="ethernet", ports=64, sharp=False, reduce_GBps=0.0,
                        latency_us=2.0)

# One NVLink-4 / NVLink-5 link (25 / 50 GB/s per direction = 450 / 900 GB/s over 18 links). latency_us 0.25:
# assumption, half of NCCL's 0.6 µs LL per-step NVLink latency (tuning.cc) minus the switch's 0.1 µs.
NVLINK4 = LinkSpec(kind="nvlink", GBps_per_dir=25.0, latency_us=0.25)
NVLINK5 = LinkSpec(kind="nvlink", GBps_per_dir=50.0, latency_us=0.25)
# One NVLink-4 link straight from GPU to GPU, no switch (18 of them = NV18, the h200x2 lab box: 450 GB/s per
# direction line rate; measured P2P copies 367-393 GB/s per direction: results/h200x2/allreduce.json and the
# p2p_us curve of calibration/h200.yaml). latency 0.6 µs = NCCL's per-step NVLink latency (tuning.cc), the
# same GPU-to-GPU figure as through a switch.
NVLINK4_DIRECT = LinkSpec(kind="nvlink", GBps_per_dir=25.0, latency_us=0.6)
# NVLink-C2C Grace↔GPU: 900 GB/s bidirectional = 450 per direction (NVIDIA Grace/GB200 material);
# latency assumption.
C2C = LinkSpec(kind="c2c", GBps_per_dir=450.0, latency_us=0.5)
# PCIe Gen5 x16: 32 GT/s × 16 lanes ≈ 63 GB/s per direction (PCI-SIG); latency assumption (~0.5 µs per
# traversal including the PCIe switch).
PCIE5_X16 = LinkSpec(kind="pcie", GBps_per_dir=63.0, latency_us=0.5)
# NDR cable, NIC↔switch or switch↔switch: 400 Gb/s = 50 GB/s; ~5 ns/m × ~10 m of cable.
IB_NDR = LinkSpec(kind="ib", GBps_per_dir=50.0, latency_us=0.05)
# XDR cable: 800 Gb/s = 100 GB/s; latency as NDR.
IB_XDR = LinkSpec(kind="ib", GBps_per_dir=100.0, latency_us=0.05)
# PCIe Gen6 x16 (ConnectX-8's host and GPU side): 64 GT/s × 16 lanes ≈ 126 GB/s per direction (PCI-SIG);
# latency as Gen5 (assumption).
PCIE6_X16 = LinkSpec(kind="pcie", GBps_per_dir=126.0, latency_us=0.5)
# EFA port, 200 Gb/s = 25 GB/s.
EFA_200 = LinkSpec(kind="efa", GBps_per_dir=25.0, latency_us=0.05)

GPUS: dict[str, GpuSpec] = {s.name: s for s in (H200_SXM, GB200_GPU, B200_HGX, H100_SXM, H800_SXM, GB300_GPU,
                                                 B300_HGX)}
CPUS: dict[str, CpuSpec] = {s.name: s for s in (GRACE, XEON_8480C)}
NICS: dict[str, NicSpec] = {s.name: s for s in (CX7_IB, CX8_IB, EFA_P5EN)}
SWITCHES: dict[str, SwitchSpec] = {s.name: s for s in (NVSWITCH3, NVLINK_SWITCH5, QUANTUM2, QUANTUM_X800,
                                                       EFA_FABRIC)}
LINKS: dict[str, LinkSpec] = {
    "nvlink4": NVLINK4,
    "nvlink5": NVLINK5,
    "nvlink4-direct": NVLINK4_DIRECT,
    "c2c": C2C,
    "pcie5-x16": PCIE5_X16,
    "ib-ndr": IB_NDR,
    "ib-xdr": IB_XDR,
    "pcie6-x16": PCIE6_X16,
    "efa-200": EFA_200,
}

CATALOGUES: dict[type, dict] = {GpuSpec: GPUS, CpuSpec: CPUS, NicSpec: NICS, SwitchSpec: SWITCHES,
                                LinkSpec: LINKS}


def _by_name(catalogue: dict):
    """A BeforeValidator: a string names a catalogue entry, anything else is validated as the model."""

    def resolve(value):
        if isinstance(value, str):
            if value not in catalogue:
                raise ValueError(f"unknown spec {value!r} (known: {', '.join(catalogue)})")
            return catalogue[value]
        return value

    return BeforeValidator(resolve)


GpuRef = Annotated[GpuSpec, _by_name(GPUS)]
CpuRef = Annotated[CpuSpec, _by_name(CPUS)]
NicRef = Annotated[NicSpec, _by_name(NICS)]
SwitchRef = Annotated[SwitchSpec, _by_name(SWITCHES)]
LinkRef = Annotated[LinkSpec, _by_name(LINKS)]


# ----------------------------------------------------------------------------------------------- shapes


class NodeSpec(_Spec):
    """One host: an HGX node or a GB200 compute tray.

    GPU ``i`` of the node hangs off CPU ``i * n_cpus // n_gpus`` through ``cpu_link`` and owns ``nics_per_gpu``
    NICs through ``nic_link``. NVLink inside the node is either ``n`` in-node switches (``nvswitch``) with
    ``links_per_switch[j]`` links from every GPU to switch ``j`` (HGX H200: 5/4/4/5), or, without a switch,
    ``direct_links`` links between every pair of GPUs (h200x2: NV18). A GB200 tray has neither: its NVLink
    switches sit at rack level (:class:`RackSpec`).

    ``overhead_w``: the node's draw apart from its GPUs (CPUs, NICs, in-node switches, fans, drives, power
    conversion) in watts, counted as constant while the node is in a deployment's pool.
    """

    name: str
    gpu: GpuRef
    n_gpus: PositiveInt
    cpu: CpuRef | None = None
    n_cpus: NonNegInt = 0
    cpu_link: LinkRef | None = None
    nic: NicRef | None = None
    nics_per_gpu: NonNegInt = 0
    nic_link: LinkRef | None = None
    nvlink: LinkRef | None = None
    nvswitch: SwitchRef | None = None
    links_per_switch: tuple[PositiveInt, ...] = ()
    direct_links: NonNegInt = 0
    overhead_w: NonNegFloat = 0.0

    @model_validator(mode="after")
    def _consistent(self) -> NodeSpec:
        if self.n_cpus and (self.cpu is None or self.cpu_link is None):
            raise ValueError("n_cpus > 0 needs cpu and cpu_link")
        if self.nics_per_gpu and (self.nic is None or self.nic_link is None):
            raise ValueError("nics_per_gpu > 0 needs nic and nic_link")
        if self.nvswitch is not None and not self.links_per_switch:
            raise ValueError("nvswitch given but links_per_switch is empty")
        if self.links_per_switch and self.nvswitch is None:
            raise ValueError("links_per_switch given but no nvswitch")
        if self.nvswitch is not None and self.direct_links:
            raise ValueError("use either nvswitch or direct_links, not both")
        used = sum(self.links_per_switch) + self.direct_links * (self.n_gpus - 1)
        if used and self.nvlink is None:
            raise ValueError("NVLink links are used but nvlink (the link spec) is missing")
        if used > self.gpu.nvlink_links:
            raise ValueError(
                f"each GPU would use {used} NVLink links but {self.gpu.name} has {self.gpu.nvlink_links}"
            )
        if self.nvswitch is not None:
            for j, k in enumerate(self.links_per_switch):
                if self.n_gpus * k > self.nvswitch.ports:
                    raise ValueError(
                        f"links_per_switch[{j}]: {self.n_gpus} GPUs × {k} links need {self.n_gpus * k} ports, "
                        f"{self.nvswitch.name or 'the switch'} has {self.nvswitch.ports}"
                    )
        return self


class RackSpec(_Spec):
    """``n_nodes`` nodes; with ``nvswitch`` the rack is one NVLink domain: ``n_nvswitches`` switch ASICs and
    ``links_per_switch`` links from every GPU of every node to each of them (GB200 NVL72: 18 ASICs, 1 link).

    ``overhead_w``: rack-level draw outside the nodes (NVLink switch trays, power shelves, management), watts,
    constant while any of its GPUs is in a deployment's pool. ``rack_power_kw``: the power the rack can be fed
    (None: no limit); a deployment whose peak draw in one rack — its GPUs at ``compute_bound_w``, their nodes'
    and the rack's overhead — exceeds it is refused (``topology.power.check_rack_power``).
    """

    name: str
    node: NodeSpec
    n_nodes: PositiveInt
    nvswitch: SwitchRef | None = None
    n_nvswitches: NonNegInt = 0
    links_per_switch: NonNegInt = 0
    nvlink: LinkRef | None = None
    overhead_w: NonNegFloat = 0.0
    rack_power_kw: PositiveFloat | None = None

    @model_validator(mode="after")
    def _consistent(self) -> RackSpec:
        has = self.nvswitch is not None
        if has != (self.n_nvswitches > 0) or has != (self.links_per_switch > 0) or has != (self.nvlink is not None):
            raise ValueError("rack NVLink switches need all of nvswitch, n_nvswitches > 0, links_per_switch > 0 "
                             "and nvlink (or none of them)")
        if has:
            node = self.node
            if node.nvswitch is not None or node.direct_links:
                raise ValueError("a rack NVLink domain needs nodes without their own NVLink (node.nvswitch / "
                                 "node.direct_links)")
            used = self.n_nvswitches * self.links_per_switch
            if used > node.gpu.nvlink_links:
                raise ValueError(f"each GPU would use {used} NVLink links but {node.gpu.name} has "
                                 f"{node.gpu.nvlink_links}")
            need = self.n_nodes * node.n_gpus * self.links_per_switch
            if need > self.nvswitch.ports:
                raise ValueError(f"{self.n_nodes * node.n_gpus} GPUs × {self.links_per_switch} links need {need} "
                                 f"ports per switch, {self.nvswitch.name or 'the switch'} has {self.nvswitch.ports}")
        return self


class FabricSpec(_Spec):
    """The scale-out network joining all NICs: one switch if the NICs fit its ports, else a two-level fat tree
    (leaves use half their ports down, half up to spines). ``link`` is one switch port's cable."""

    switch: SwitchRef
    link: LinkRef


class ClusterSpec(_Spec):
    """``n_racks`` copies of ``rack``, their NICs joined by ``fabric`` (None: no scale-out network)."""

    name: str
    rack: RackSpec
    n_racks: PositiveInt = 1
    fabric: FabricSpec | None = None

    @model_validator(mode="after")
    def _fabric_needs_nics(self) -> ClusterSpec:
        if self.fabric is not None and not self.rack.node.nics_per_gpu:
            raise ValueError("fabric given but the nodes have no NICs (rack.node.nics_per_gpu is 0)")
        return self
