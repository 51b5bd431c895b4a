"""The shared pieces of the measured-table importers (:mod:`sim.perf_tables`, :mod:`sim.perf_tables_attention`):
which systems and dtypes rackbed reads, finding and reading a table with one-line errors, and the ``Curve`` /
``Imported`` records an importer returns.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from rackbed.topology.errors import UserError

PACKAGE = "aiconfigurator-core"
SCHEMA = "rackbed.calibration/2"

#: aiconfigurator system folder -> (rackbed GpuSpec name, short name used in file names)
SYSTEMS: dict[str, tuple[str, str]] = {
    "gb200": ("B200-GB200", "gb200"),
    "h200_sxm": ("H200-SXM", "h200"),
    "b200_sxm": ("B200-HGX", "b200"),
    "gb300": ("B300-GB300", "gb300"),
    "b300_sxm": ("B300-HGX", "b300"),
    "h100_sxm": ("H100-SXM", "h100"),
    "h800": ("H800-SXM", "h800"),
}
#: systems without tables of their own: (the system whose tables are read, its preset, the preset of the system
#: itself, a note for ``meta.notes``). H800 is H100's die with its NVLink cut to 400 GB/s both ways: its GEMM, MoE
#: and attention kernels run as on H100; H100's all-reduce and all-to-all tables measured 900 GB/s NVLink, so each
#: of their points is scaled by the simulator's own model of that collective on the H800 preset over the same on the
#: H100 preset (:func:`sim.perf_tables.scale_collectives`): the measured fixed costs stay, the bandwidth-bound part
#: slows down as the NVLink does.
DERIVED: dict[str, tuple[str, str, str, str]] = {
    "h800": ("h100_sxm", "hgx-h100", "hgx-h800",
             "H800 runs H100's kernels; H100's all-reduce and all-to-all (measured on 900 GB/s NVLink) are scaled "
             "point by point by the model's hgx-h800 / hgx-h100 time (400 vs 900 GB/s NVLink; 1.0-2.25x), "
             "not measured on H800"),
}
#: the model whose DP-EP dispatch / combine the all-to-all scaling prices (its hidden size, 7168, is the widest
#: the tables measure: a curve's x is payload bytes per rank, read as tokens of this width in bf16)
SCALE_MODEL = "deepseek-v3"
#: names a user may type for a system
ALIASES = {"gb200": "gb200", "h200": "h200_sxm", "h200_sxm": "h200_sxm", "b200": "b200_sxm", "b200_sxm": "b200_sxm",
           "gb300": "gb300", "b300": "b300_sxm", "b300_sxm": "b300_sxm", "h100": "h100_sxm", "h100_sxm": "h100_sxm",
           "h800": "h800"}
BACKENDS = ("trtllm", "sglang", "vllm")

#: table dtype names -> rackbed format names (dtypes not listed are not imported)
GEMM_FMT = {"bfloat16": "bf16", "fp8": "fp8", "fp8_block": "fp8_block", "nvfp4": "nvfp4"}
#: element bytes of an all-to-all payload dtype (nvfp4: 4 bits + one fp8 scale per 16 values)
PAYLOAD = {"bfloat16": ("bf16", 2.0), "fp8": ("fp8", 1.0), "nvfp4": ("fp4", 0.5 + 1 / 16)}

#: GEMM shapes with n or k below this are not imported (no model rackbed knows has such a projection)
GEMM_MIN_NK = 128

HOLDOUT_EVERY, HOLDOUT_OFFSET = 3, 1
#: a fit point this many times slower than a larger size's is a glitch (:meth:`Curve.split`)
GLITCH = 1.25
HOLDOUT_RULE = "every 3-th point of each curve from index 1 (end points kept)"


def _sig(v: float, digits: int = 5) -> float:
    """``v`` rounded to ``digits`` significant digits (stable text in the written file)."""
    return float(f"{v:.{digits}g}")


# ------------------------------------------------------------------------------------------------ finding tables


def resolve_system(name: str) -> str:
    """The package's system folder for a name a user typed (``gb200``, ``h200``, ``b300``, ..., or the folder
    name); ``h800`` (no folder: :data:`DERIVED`) is returned as is."""
    s = ALIASES.get(name.strip().lower())
    if s is None:
        raise UserError(f"--from-aiconfigurator: unknown system {name!r}; rackbed models "
                        f"{', '.join(sorted(set(ALIASES)))} (GPU models {', '.join(g for g, _ in SYSTEMS.values())})")
    return s


def _version_key(v: str) -> tuple:
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"[.\-]|(?<=\d)(?=[a-z])", v))


@dataclass(frozen=True)
class Table:
    """One parquet table: its op folder, backend folder, framework version folder and file name."""

    root: Path
    system: str
    op: str
    backend: str
    version: str
    name: str

    @property
    def path(self) -> Path:
        return self.root / self.system / self.op / self.backend / self.version / self.name

    @property
    def rel(self) -> str:
        return f"{self.system}/{self.op}/{self.backend}/{self.version}/{self.name}"


def find_tables(root: Path, system: str, op: str, backend: str, name: str) -> list[Table]:
    """Every version of table ``name`` under ``<system>/<op>/<backend>/``, oldest first."""
    d = root / system / op / backend
    if not d.is_dir():
        return []
    out = [Table(root, system, op, backend, v.name, name) for v in d.iterdir() if (v / name).is_file()]
    return sorted(out, key=lambda t: _version_key(t.version))


# ------------------------------------------------------------------------------------------------ reading tables


#: the unit of a table's ``latency`` column, by file name (others: ms)
LATENCY_UNIT = {"moe_a2a_perf.parquet": "us"}
_UNIT_S = {"ms": 1e-3, "us": 1e-6}


def latency_s(table: Table) -> float:
    """Seconds per unit of ``table``'s latency column."""
    return _UNIT_S[LATENCY_UNIT.get(table.name, "ms")]


def read_rows(table: Table, columns: Iterable[str], *, numeric: Iterable[str] = ("latency",)) -> list[dict]:
    """The table's rows (``columns`` only) as dicts; a missing column, a unit other than the one rackbed reads
    for that table, or a latency that is not a finite number > 0 is one UserError naming the file, the row and
    the column."""
    import pyarrow.parquet as pq

    path = table.path
    try:
        pf = pq.read_table(path)
    except Exception as exc:  # pyarrow raises its own error types for damaged files
        raise UserError(f"{table.rel}: not a readable parquet table: {' '.join(str(exc).split())[:200]}") from exc
    have = set(pf.column_names)
    missing = [c for c in columns if c not in have]
    if missing:
        raise UserError(f"{table.rel}: missing column {missing[0]!r} (has: {', '.join(sorted(have))})")
    unit = LATENCY_UNIT.get(table.name, "ms")
    for ucol in ("unit", "latency_unit", "units"):
        if ucol in have:
            units = {str(u) for u in pf.column(ucol).to_pylist()}
            if units - {unit}:
                raise UserError(f"{table.rel}: column {ucol!r} says {min(units - {unit})!r}; rackbed reads "
                                f"this table's latencies in {unit} only")
    rows = pf.select(list(columns)).to_pylist()
    for i, r in enumerate(rows):
        for c in numeric:
            v = r[c]
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                raise UserError(f"{table.rel}: row {i}: {c} = {v!r}; must be a finite number > 0")
    return rows


# ------------------------------------------------------------------------------------------------ curves


@dataclass
class Curve:
    """Measured ``(x, y)`` points of one calibration entry before the hold-out split; ``measured`` keeps what the
    held-out prediction is compared with (the table's latency in seconds) per x. ``envelope``: the fit points are
    cleared of single slow glitches (:meth:`split`): used for the communication tables, whose small sizes hold
    one-off slow rows; GEMM and MoE tables keep every point (their non-monotone steps are real kernel choices)."""

    kind: str
    key: dict
    source: str
    points: dict[float, float] = field(default_factory=dict)  # x -> y (the entry's units)
    measured: dict[float, float] = field(default_factory=dict)  # x -> seconds as measured
    envelope: bool = False
    #: a name for the part of the kind this curve belongs to (its held-out errors are also reported on their own,
    #: ``meta.validation_groups``); "" for none
    group: str = ""

    def add(self, x: float, y: float, seconds: float) -> None:
        """Keep the fastest of repeated measurements at one x (several kernel sources, duplicates)."""
        if x not in self.measured or seconds < self.measured[x]:
            self.points[x], self.measured[x] = y, seconds

    def split(self) -> tuple[list[tuple[float, float]], list[float]]:
        """(fit points, held-out xs): every third inner point held out. With ``envelope``, a fit point more than
        ``GLITCH`` times slower than a fit point of larger x takes that time instead: more work does not take less
        time, and the tables hold single slow measurements (GB200 EP16 combine: 60 µs at one token, 15 µs at
        four); smaller wiggles (kernel choices, noise) are kept as measured. Held-out points are compared with the
        table as measured."""
        xs = sorted(self.points)
        held = [x for i, x in enumerate(xs) if 0 < i < len(xs) - 1 and (i - HOLDOUT_OFFSET) % HOLDOUT_EVERY == 0]
        hs = set(held)
        fit = [x for x in xs if x not in hs]
        if not self.envelope:
            return [(x, self.points[x]) for x in fit], held
        out, floor = [], math.inf
        for x in reversed(fit):
            s = self.measured[x]
            floor = min(floor, s)
            y = self.points[x]
            if s > GLITCH * floor:  # a time kind scales with the time, a rate (work / time) inversely
                y = _sig(y * floor / s) if self.kind.endswith("_us") else _sig(y * s / floor)
                self.clipped += 1
            out.append((x, y))
        return out[::-1], held

    clipped: int = 0

    @property
    def label(self) -> str:
        return "/".join([self.kind] + [f"{k}={v}" for k, v in sorted(self.key.items())])


@dataclass
class Imported:
    """What one op family contributed: its curves, the tables read, grid kinds, caveats, and a predictor per kind
    (``predict(calib, curve, x) -> seconds``, the cost function the simulator calls)."""

    curves: list[Curve] = field(default_factory=list)
    tables: list[dict] = field(default_factory=list)
    grid: dict[str, tuple[str, ...]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    predict: dict[str, Callable] = field(default_factory=dict)


def _source(t: Table) -> str:
    return f"{PACKAGE} {t.rel}"


def _table_meta(t: Table, n_rows: int, n_used: int, framework: str | None = None) -> dict:
    return {"op": t.op, "file": t.rel, "backend": t.backend, "framework_version": framework or t.version,
            "rows": n_rows, "rows_used": n_used, "latency_unit": LATENCY_UNIT.get(t.name, "ms")}


def cached_rows(t: Table, cols: tuple[str, ...], cache: dict) -> list[dict]:
    """:func:`read_rows` once per table and importer call (choosing a version reads the rows it then imports)."""
    if t.rel not in cache:
        cache[t.rel] = read_rows(t, cols)
    return cache[t.rel]


def _pick(tables: list[Table], count: Callable[[Table], int]) -> Table | None:
    """The version with the most usable rows (ties: the newest)."""
    best, best_n = None, 0
    for t in tables:
        n = count(t)
        if n >= best_n and n > 0:
            best, best_n = t, n
    return best


def _gpu(name: str):
    from rackbed.topology.specs import GPUS

    return GPUS[name]


def _columns(t: Table) -> list[str]:
    import pyarrow.parquet as pq

    return list(pq.read_schema(t.path).names)
