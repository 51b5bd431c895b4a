"""Calibration files: writing and reading them, the shipped ones (``calibration/``) and which one a simulation uses.

A calibration file is a :class:`~sim.costs.calibration.CalibrationTable` (``version: 2``, ``kernel_fixed_us``,
``entries``; version-1 files, without ``kernel_fixed_us``, still load) plus a ``meta`` block (schema
``rackbed.calibration/2``: device, driver, torch / CUDA / NCCL versions, date, the measurement files, the hold-out
rule and held-out row ids, how the fixed cost was fitted; files built from imported tables also say their ``stack``).
:func:`load_calibration_file` reads it (``meta`` kept on the returned :class:`CalibrationFile`);
:func:`default_calibration_for` picks the shipped file for a GPU model and serving stack;
:func:`describe_calibration` is the one line the simulator prints.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import yaml
from pydantic import ValidationError

from rackbed import shipped
from rackbed.sim.costs.calibration import _YAML_LOADER, CalibrationTable
from rackbed.topology.errors import UserError, from_validation
from rackbed.topology.outputs import write_text
from rackbed.topology.yamlio import is_json_name, read_text

#: calibration file schema (``meta.schema``) written; /2 adds the table's ``kernel_fixed_us`` (CalibrationTable
#: version 2). Every schema in ``FILE_SCHEMAS`` is read (/1 files get the default fixed cost).
FILE_SCHEMA = "rackbed.calibration/2"
FILE_SCHEMAS = ("rackbed.calibration/1", FILE_SCHEMA)
#: where the shipped calibration files live (package data next to sim/)
CALIBRATION_DIR = shipped("calibration")


class CalibrationFile(CalibrationTable):
    """A CalibrationTable read from a calibration file, with its ``meta`` block (provenance, hold-outs) and the
    path it came from. Usable wherever a CalibrationTable is."""

    meta: dict = {}
    path: str = ""


def dump_calibration(doc: dict, path: str | Path) -> None:
    """Write a calibration file (YAML, or JSON for ``*.json``); points as flow lists."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if is_json_name(p):
        write_text(p, json.dumps(doc, indent=1))
        return

    class _D(yaml.SafeDumper):
        pass

    def _seq(dumper, data):
        flow = all(not isinstance(v, (dict, list, tuple)) for v in data) and len(data) <= 8
        return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)

    _D.add_representer(list, _seq)
    _D.add_representer(tuple, _seq)
    head = (f"# rackbed calibration file ({FILE_SCHEMA}): {doc['meta'].get('gpu')} measured "
            f"{doc['meta'].get('date')} by `rackbed calibrate`; do not edit by hand.\n")
    write_text(p, head + yaml.dump(doc, Dumper=_D, sort_keys=False, width=120))


def load_calibration_file(path: str | Path) -> CalibrationFile:
    """Read a calibration file (YAML or JSON) with its ``meta``; one-line UserError on mistakes."""
    from rackbed.topology.yamlio import load_data

    p = Path(path)
    data = load_data(p, "calibration file")
    if not isinstance(data, dict):
        raise UserError(f"{p}: a calibration file must be a mapping with 'entries'")
    meta = data.get("meta", {})
    if meta and meta.get("schema", FILE_SCHEMA) not in FILE_SCHEMAS:
        raise UserError(f"{p}: meta.schema must be one of {', '.join(FILE_SCHEMAS)}, got {meta.get('schema')!r}")
    try:
        return CalibrationFile.model_validate({**data, "meta": meta or {}, "path": str(p)})
    except ValidationError as exc:
        raise from_validation(exc, p) from exc


#: serving stacks a calibration can describe: ``rackbed`` is the engine in this repository, calibrated from its own
#: measurements (files without ``meta.stack``); the others are calibrated from imported per-operator tables
STACKS = ("rackbed", "trtllm", "sglang", "vllm")


def _read_meta(f: Path) -> dict:
    """A calibration file's ``meta`` block, read cheaply (JSON files keep it at the top)."""
    if is_json_name(f):
        data = json.loads(read_text(f, "calibration file"))
    else:
        data = yaml.load(f.read_text(), Loader=_YAML_LOADER) or {}
    meta = data.get("meta", {}) if isinstance(data, dict) else {}
    return meta if isinstance(meta, dict) else {}


def file_stack(meta: dict) -> str:
    """The serving stack a calibration file describes (``meta.stack``; absent: ``rackbed``)."""
    return str(meta.get("stack") or "rackbed")


@lru_cache(maxsize=16)
def _shipped(directory: str) -> tuple[tuple[str, str, str], ...]:
    """``(gpu, stack, path)`` of every calibration file shipped in ``directory``."""
    out = []
    d = Path(directory)
    if d.is_dir():
        for f in sorted(d.glob("*.yaml")) + sorted(d.glob("*.json")) + sorted(d.glob("*.json.gz")):
            try:
                meta = _read_meta(f)
            except (yaml.YAMLError, json.JSONDecodeError, OSError, AttributeError, UserError):
                continue
            if meta.get("gpu"):
                out.append((str(meta["gpu"]), file_stack(meta), str(f)))
    return tuple(out)


def shipped_stacks(gpu_name: str, directory: str | Path | None = None) -> list[str]:
    """The stacks with a shipped calibration for GPU model ``gpu_name``, in :data:`STACKS` order."""
    have = {st for g, st, _ in _shipped(str(directory or CALIBRATION_DIR)) if g == gpu_name}
    return [st for st in STACKS if st in have] + sorted(have - set(STACKS))


def default_calibration_for(gpu_name: str, directory: str | Path | None = None,
                            stack: str | None = None) -> CalibrationTable | None:
    """The shipped calibration for GPU model ``gpu_name`` (``GpuSpec.name``, e.g. ``H200-SXM``) and serving
    ``stack``, or None when none is shipped — the simulator then uses the first-principles constants alone.
    ``stack`` None or ``auto``: the first of :data:`STACKS` that has a file for the GPU (the engine's own
    measurements before imported tables). A named stack without a file for the GPU is a UserError naming those
    that exist."""
    files = {st: path for g, st, path in _shipped(str(directory or CALIBRATION_DIR)) if g == gpu_name}
    if stack in (None, "auto"):
        for st in shipped_stacks(gpu_name, directory):
            return _load_shipped(files[st])
        return None
    if stack not in files:
        have = ", ".join(shipped_stacks(gpu_name, directory)) or "none"
        raise UserError(f"stack: no calibration of stack {stack!r} is shipped for {gpu_name} (shipped: {have}; "
                        f"use stack: auto, or make one with `rackbed calibrate`)")
    return _load_shipped(files[stack])


def _load_shipped(path: str) -> CalibrationFile:
    """A shipped file, read once per process while it is unchanged on disk (tables are immutable; a search or
    sweep builds many scenarios on the same GPU)."""
    st = Path(path).stat()
    return _load_cached(path, st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=8)
def _load_cached(path: str, mtime_ns: int, size: int) -> CalibrationFile:
    return load_calibration_file(path)


def calibration_for_topology(topo, directory: str | Path | None = None,
                             stack: str | None = None) -> CalibrationTable | None:
    """:func:`default_calibration_for` the topology's GPU model (first GPU; mixed GPUs are not calibrated)."""
    names = {topo.gpu_spec(i).name for i in topo.gpu_ids}
    if len(names) != 1:
        return None
    return default_calibration_for(names.pop(), directory, stack)


def describe_calibration(table: CalibrationTable | None, gpu_name: str | None = None) -> str:
    """One line for the simulator's output: what calibration is in use (or that none is, and why that matters)."""
    if table is None:
        g = f" for {gpu_name}" if gpu_name else ""
        return (f"uncalibrated{g}: first-principles constants (datasheet peaks, assumed efficiencies; "
                f"see calibration/README.md for the uncertainty)")
    meta = getattr(table, "meta", {}) or {}
    gpus = sorted({e.gpu for e in table.entries})
    kinds = sorted({e.kind for e in table.entries})
    path = getattr(table, "path", "") or "an in-memory table"
    try:
        path = str(Path(path).resolve().relative_to(CALIBRATION_DIR.parent))
    except ValueError:
        pass
    if meta.get("source") == "aiconfigurator-core":
        return (f"calibrated ({file_stack(meta)} stack, measured tables): {meta.get('gpu')} from {path} "
                f"(aiconfigurator-core {meta.get('package_version')}, {meta.get('system')}/{meta.get('backend')}, "
                f"{len(kinds)} kinds, {len(table.entries)} curves)")
    return (f"calibrated ({file_stack(meta)} stack): {meta.get('gpu') or ', '.join(gpus)} from {path} "
            f"({meta.get('date', 'undated')}, {len(kinds)} kinds, {len(table.entries)} curves)")
