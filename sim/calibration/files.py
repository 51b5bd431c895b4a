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
    """A calibration file's ``meta`` block, read cheaply: only the start of the file up to the end of the block
    when it is where the writers put it (:func:`_json_meta`, :func:`_yaml_meta`), else the whole file."""
    if is_json_name(f):
        meta = _json_meta(f)
        if meta is None:
            data = json.loads(read_text(f, "calibration file"))
            meta = data.get("meta", {}) if isinstance(data, dict) else {}
    else:
        text = f.read_text()
        meta = _yaml_meta(text)
        if meta is None:
            data = yaml.load(text, Loader=_YAML_LOADER) or {}
            meta = data.get("meta", {}) if isinstance(data, dict) else {}
    return meta if isinstance(meta, dict) else {}


#: characters of a JSON calibration file read (decompressed) at a time while looking for its ``meta`` block
META_CHUNK = 1 << 16


def _json_meta(f: Path, chunk: int = META_CHUNK):
    """The top-level ``meta`` value of a JSON (or ``.json.gz``) object, decoding its members in order and
    reading the file ``chunk`` characters at a time until ``meta`` has been decoded; None when the file does not
    start as an object whose members up to ``meta`` decode (then the caller parses the whole file, as before).
    The calibration writers put ``meta`` before ``entries``, so a shipped table's few MB are not read to list
    it. Of two ``meta`` members the first is taken (``json.loads`` keeps the last; no writer repeats a key)."""
    import gzip
    import zlib

    dec = json.JSONDecoder()
    ws = " \t\n\r"
    try:
        fh = gzip.open(f, "rt", encoding="utf-8") if f.name.lower().endswith(".gz") else \
            open(f, encoding="utf-8")  # noqa: SIM115 (closed below)
    except OSError:
        return None
    with fh:
        text, eof = "", False

        def more() -> bool:
            nonlocal text, eof
            if eof:
                return False
            try:
                part = fh.read(chunk)
            except (OSError, EOFError, zlib.error, UnicodeDecodeError):
                part = ""
            eof = not part
            text += part
            return not eof

        i = 0
        while True:  # the opening brace
            while i < len(text) and text[i] in ws:
                i += 1
            if i < len(text):
                break
            if not more():
                return None
        if text[i] != "{":
            return None
        i += 1
        while True:  # members in order: "key" : value ,
            try:
                while True:
                    j = i
                    while j < len(text) and text[j] in ws:
                        j += 1
                    if j < len(text) and text[j] == "}":
                        return None  # the object ended without meta: the whole-file path says what it holds
                    try:
                        key, j = dec.raw_decode(text, j)
                        while j < len(text) and text[j] in ws:
                            j += 1
                        if j >= len(text) or text[j] != ":":
                            raise json.JSONDecodeError("no colon yet", text, j)
                        j += 1
                        while j < len(text) and text[j] in ws:
                            j += 1
                        value, j = dec.raw_decode(text, j)
                        while j < len(text) and text[j] in ws:
                            j += 1
                        if j >= len(text) or text[j] not in ",}":
                            # a number cut by the chunk ("0" of "0.5", "0." of "0.5e3") decodes as a shorter one
                            raise json.JSONDecodeError("value may go on", text, j)
                        break
                    except json.JSONDecodeError:
                        if not more():
                            return None
            except RecursionError:
                return None
            if not isinstance(key, str):
                return None
            if key == "meta":
                return value
            if text[j] != ",":
                return None
            i = j + 1


def _yaml_meta(text: str):
    """The ``meta`` block of a YAML calibration file written in block style: the ``meta:`` line at column 0 and
    the indented (or blank / comment) lines under it, parsed alone; None when there is no such line or a line
    before it is not a plain ``key: scalar`` / comment / blank line (then the caller parses the whole file)."""
    lines = text.splitlines()
    start = None
    for n, line in enumerate(lines):
        if line.startswith("meta:"):
            start = n
            break
        if not line.strip() or line.startswith("#"):
            continue
        if line[0] in " \t-[{%&*!|>'\"?" or ":" not in line or line.rstrip().endswith(":") or "#" in line:
            return None  # not a one-line top-level scalar: leave it to the whole-file parse
    if start is None:
        return None
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or lines[end][0] in " \t#"):
        end += 1
    if end < len(lines) and lines[end].startswith(("...", "---")):
        return None
    try:
        data = yaml.load("\n".join(lines[start:end]) + "\n", Loader=_YAML_LOADER)
    except yaml.YAMLError:
        return None
    if not isinstance(data, dict) or list(data) != ["meta"]:
        return None
    return data["meta"]


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
