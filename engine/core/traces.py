"""Request traces on disk: parse the Azure LLM 2023 CSV and the Mooncake JSONL formats into arrays.

Formats (one request per line; see ``data/TRACES.md`` for sources, licences and attribution):

- ``azure``: CSV with a header naming ``TIMESTAMP,ContextTokens,GeneratedTokens`` (any order, any case, extra
  columns ignored). ``TIMESTAMP`` is an absolute ISO date-time (``2023-11-16 18:15:46.6805900``; digits past the
  microsecond are dropped; no zone = UTC) or a plain number of seconds.
- ``mooncake``: JSON Lines, objects with ``timestamp`` (milliseconds, number >= 0), ``input_length``,
  ``output_length`` (integers >= 0) and optionally ``hash_ids`` (list of integers >= 0: one id per 512-token
  prefix block, equal ids = shareable prefix KV). Other keys are ignored, blank lines skipped. The same format
  holds Mooncake's conversation, tool/agent and synthetic traces.

  ``hash_ids``, when given and not empty, must hold exactly ``ceil(input_length / 512)`` ids: one per block,
  the last, partial block included. That is how every Mooncake trace counts (all 2000 requests of the shipped
  copy, 3 of them an exact multiple of 512 tokens); another count means another block size or a broken file,
  and a prefix cache would then credit hits beyond the prompt, so it is an error naming the line. An empty or
  missing ``hash_ids`` means no prefix information (the request shares nothing).

Either may be gzip-compressed (detected from the content, not the name). ``format="auto"`` picks by file name
(``.csv[.gz]`` -> azure, ``.jsonl``/``.json[.gz]`` -> mooncake), else by the first non-blank line (``{`` ->
mooncake, otherwise azure).

What a :class:`Trace` holds: requests sorted stably by time (file order breaks ties), ``arrival_s`` in seconds
from the earliest request of the file (so the first is at 0.0), token counts *as written* (0 is kept here; the
workload clamps 0 to 1 and counts it, because a ``Request`` needs >= 1 of each). Parse errors are one-line
``UserError`` (a ``ValueError``) of the form ``path:LINE: what is wrong``.

Shipped trimmed copies (first 2000 requests of each) are found by name with :func:`trace_path`.
"""

from __future__ import annotations

import csv
import functools
import gzip
import io
import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Literal

import numpy as np

from rackbed import shipped
from rackbed.topology.errors import UserError

TraceFormat = Literal["azure", "mooncake", "auto"]

DATA_DIR = shipped("engine.core", "data")

#: tokens per prefix block of ``hash_ids`` (Mooncake's block size)
HASH_BLOCK_TOKENS = 512

#: Names of the trimmed traces shipped with the package -> file name under ``engine/core/data/``.
TRACE_FILES: dict[str, str] = {
    "azure-conv": "azure_llm_2023_conv.head2000.csv.gz",
    "azure-code": "azure_llm_2023_code.head2000.csv.gz",
    "mooncake": "mooncake_conversation.head2000.jsonl.gz",
}

_AZURE_COLUMNS = ("timestamp", "contexttokens", "generatedtokens")
_AZURE_NAMES = {
    "timestamp": "TIMESTAMP",
    "contexttokens": "ContextTokens",
    "generatedtokens": "GeneratedTokens",
}
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_US = timedelta(microseconds=1)


@dataclass(frozen=True, eq=False)
class Trace:
    """A parsed trace. All arrays have shape ``(n,)`` and are read-only.

    source:          the file it came from (as given).
    format:          ``"azure"`` or ``"mooncake"``.
    arrival_s:       float64, seconds since the earliest request of the file; non-decreasing; ``arrival_s[0] == 0``.
    prompt_tokens:   int64 >= 0, input tokens as written in the file (Azure ContextTokens, Mooncake input_length).
    output_tokens:   int64 >= 0, generated tokens as written (Azure GeneratedTokens, Mooncake output_length).
    prefix_hash_ids: per request, the Mooncake prefix block ids (512 tokens each); ``()`` for Azure.
    """

    source: str
    format: str
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    prefix_hash_ids: tuple[tuple[int, ...], ...]

    def __len__(self) -> int:
        return int(self.arrival_s.shape[0])

    @property
    def span_s(self) -> float:
        """Seconds from the first to the last arrival."""
        return float(self.arrival_s[-1] - self.arrival_s[0])

    @property
    def max_hash_id(self) -> int:
        """The largest prefix block id in the trace, -1 if it has none."""
        return max((max(ids) for ids in self.prefix_hash_ids if ids), default=-1)


def trace_path(name: str) -> Path:
    """Path of a shipped trimmed trace: ``"mooncake"``, ``"azure-conv"`` or ``"azure-code"``."""
    try:
        return DATA_DIR / TRACE_FILES[name]
    except KeyError:
        known = ", ".join(sorted(TRACE_FILES))
        raise UserError(f"unknown trace name {name!r}; known: {known} (or give a path)") from None


def resolve_trace(path: str | Path | None = None, name: str | None = None) -> Path:
    """The file for ``path`` or ``name`` (exactly one must be given)."""
    if (path is None) == (name is None):
        raise UserError("give exactly one of trace path or trace name")
    return trace_path(name) if name is not None else Path(path)


def load_trace(path: str | Path, format: TraceFormat = "auto") -> Trace:
    """Parse a trace file (cached by path, size and modification time; the result is immutable).

    Raises ``UserError`` (a ``ValueError``) naming the file (and line) when it is missing or malformed.
    """
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise UserError(f"{path}: trace file not found") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read trace file ({exc.strerror or exc})") from None
    if not p.is_file():
        raise UserError(f"{path}: trace path is not a file")
    if format not in ("azure", "mooncake", "auto"):
        raise UserError(f"{path}: format must be 'azure', 'mooncake' or 'auto', got {format!r}")
    return _load_cached(str(path), st.st_size, st.st_mtime_ns, format)


@functools.lru_cache(maxsize=16)
def _load_cached(path: str, size: int, mtime_ns: int, format: str) -> Trace:
    del size, mtime_ns  # cache key only
    text = _read_text(path)
    fmt = _detect_format(path, text) if format == "auto" else format
    if fmt == "azure":
        t_raw, prompt, output, hashes = _parse_azure(path, text)
        per_s = 1e6  # integer microseconds -> s
    else:
        t_raw, prompt, output, hashes = _parse_mooncake(path, text)
        per_s = 1e3  # ms -> s
    if not t_raw:
        raise UserError(f"{path}: trace has no requests")
    t = np.asarray(t_raw)
    order = np.argsort(t, kind="stable")
    t = t[order]
    arrival_s = ((t - t[0]) / per_s).astype(np.float64)
    prompt_a = np.asarray(prompt, dtype=np.int64)[order]
    output_a = np.asarray(output, dtype=np.int64)[order]
    hashes_t = tuple(hashes[i] for i in order.tolist()) if hashes is not None else ((),) * len(t_raw)
    for a in (arrival_s, prompt_a, output_a):
        a.setflags(write=False)
    return Trace(path, fmt, arrival_s, prompt_a, output_a, hashes_t)


def _read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise UserError(f"{path}: cannot read trace file ({exc.strerror or exc})") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise UserError(f"{path}: corrupt gzip data ({exc})") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: not UTF-8 text") from None


def _detect_format(path: str, text: str) -> str:
    name = path.lower().removesuffix(".gz")
    if name.endswith(".csv"):
        return "azure"
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "mooncake"
    for line in text.splitlines():
        if line.strip():
            return "mooncake" if line.lstrip().startswith("{") else "azure"
    raise UserError(f"{path}: trace is empty")


#: the largest token count of one request (a trace row, a length distribution): 2^20 tokens is far beyond the
#: context of every supported model (Qwen3: 128 Ki tokens with YaRN); larger values would overflow the int64 arrays
#: requests are kept in, or exhaust memory when simulated
MAX_TOKENS = 1 << 20


def _int_field(path: str, line: int, name: str, raw: object) -> int:
    """A token count: an integer in [0, ``MAX_TOKENS``] (a string of digits in CSV, a JSON integer in JSONL)."""
    v = None
    if isinstance(raw, str):
        s = raw.strip()
        if s.isascii() and s.isdigit():
            v = int(s)
    elif isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0:
        v = raw
    if v is None:
        raise UserError(f"{path}:{line}: {name} must be an integer >= 0, got {raw!r}")
    if v > MAX_TOKENS:
        raise UserError(f"{path}:{line}: {name} must be at most {MAX_TOKENS:,} tokens (beyond any supported "
                        f"model's context), got {str(v)[:30]}")
    return v


def _parse_azure(path: str, text: str) -> tuple[list[int], list[int], list[int], None]:
    reader = csv.reader(io.StringIO(text))
    try:
        header = next(reader)
    except StopIteration:
        raise UserError(f"{path}: trace is empty") from None
    except csv.Error as exc:
        raise UserError(f"{path}:1: not valid CSV ({exc})") from None
    cols = [h.strip().lower() for h in header]
    idx = []
    for c in _AZURE_COLUMNS:
        if c not in cols:
            raise UserError(
                f"{path}:1: Azure CSV header must name TIMESTAMP, ContextTokens, GeneratedTokens; "
                f"missing {_AZURE_NAMES[c]} (header: {','.join(header)})"
            )
        idx.append(cols.index(c))
    i_ts, i_ctx, i_gen = idx
    t_us: list[int] = []
    prompt: list[int] = []
    output: list[int] = []
    try:
        for row in reader:
            line = reader.line_num
            if not row or all(not f.strip() for f in row):
                continue
            if len(row) != len(header):
                raise UserError(f"{path}:{line}: expected {len(header)} fields, got {len(row)}")
            t_us.append(_azure_time_us(path, line, row[i_ts]))
            prompt.append(_int_field(path, line, "ContextTokens", row[i_ctx]))
            output.append(_int_field(path, line, "GeneratedTokens", row[i_gen]))
    except csv.Error as exc:
        raise UserError(f"{path}:{reader.line_num}: not valid CSV ({exc})") from None
    return t_us, prompt, output, None


def _azure_time_us(path: str, line: int, raw: str) -> int:
    """TIMESTAMP as integer microseconds since the Unix epoch (a plain number is taken as seconds)."""
    s = raw.strip()
    try:
        x = float(s)
    except ValueError:
        pass
    else:
        if math.isfinite(x) and x >= 0:
            return round(x * 1e6)
        raise UserError(f"{path}:{line}: TIMESTAMP must be a date-time or seconds >= 0, got {raw!r}")
    try:
        dt = datetime.fromisoformat(s)
    except ValueError:
        raise UserError(
            f"{path}:{line}: TIMESTAMP must be a date-time like 2023-11-16 18:15:46.680 or seconds, got {raw!r}"
        ) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return (dt - _EPOCH) // _ONE_US


def _parse_mooncake(path: str, text: str) -> tuple[list[float], list[int], list[int], list[tuple[int, ...]]]:
    t_ms: list[float] = []
    prompt: list[int] = []
    output: list[int] = []
    hashes: list[tuple[int, ...]] = []
    for line, s in enumerate(text.splitlines(), start=1):
        if not s.strip():
            continue
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{line}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        except RecursionError:
            raise UserError(f"{path}:{line}: nested too deeply to parse") from None
        if not isinstance(obj, dict):
            raise UserError(f"{path}:{line}: expected a JSON object, got {type(obj).__name__}")
        for key in ("timestamp", "input_length", "output_length"):
            if key not in obj:
                raise UserError(f"{path}:{line}: missing key {key!r}")
        ts = obj["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
            raise UserError(f"{path}:{line}: timestamp must be a number of milliseconds >= 0, got {ts!r}")
        t_ms.append(float(ts))
        prompt.append(_int_field(path, line, "input_length", obj["input_length"]))
        output.append(_int_field(path, line, "output_length", obj["output_length"]))
        ids = obj.get("hash_ids", [])
        if not isinstance(ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 1 << 63 for h in ids
        ):
            raise UserError(f"{path}:{line}: hash_ids must be a list of integers in [0, 2^63)")
        if ids and len(ids) != (want := -(-prompt[-1] // HASH_BLOCK_TOKENS)):
            raise UserError(f"{path}:{line}: hash_ids has {len(ids)} ids, input_length {prompt[-1]} needs "
                            f"ceil({prompt[-1]} / {HASH_BLOCK_TOKENS}) = {want} (one per {HASH_BLOCK_TOKENS}-token "
                            "block, the last partial one included)")
        hashes.append(tuple(ids))
    return t_ms, prompt, output, hashes
