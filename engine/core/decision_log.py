"""The decision log: one record per scheduler decision, one schema for every driver.

A record is a plain tuple (cheap to append hundreds of thousands of times per simulated hour):

    (t_s, kind, worker, request_id, a, b, note)

t_s float seconds since the run started; kind one of :data:`KINDS`; worker a worker/group id or ``""``;
request_id ``-1`` when the decision is not about one request; ``a``/``b`` ints whose meaning depends on kind;
note a short string (``""`` when unused). Meanings:

=============  ============================  ==========================  ===========================
kind           worker                        a                           b / note
=============  ============================  ==========================  ===========================
route_prefill  chosen prefiller (or worker)  its queued tokens before    b: prompt tokens
reject         ``""``                        prompt tokens               note: reason
prefill        prefiller                     batch number                b: batch tokens; note: n seqs
route_decode   chosen decoder group (worker) DP rank                     b: KV tokens reserved
kv_transfer    KV stream                     bytes                       b: chunks; note: dst group
admit          decoder group                 DP rank                     b: decode steps drawn (-1 real)
decode         decoder group                 step number                 b: total batch
mixed          aggregated worker             step number                 b: decode batch; note: prefill tokens
finish         decoder group / prefiller     tokens generated            b: decode steps used
requeue        failed/drained worker         0                           note: reason
idle           worker                        0                           note: what it waits for
stop           worker                        0                           note: reason
scale_up       new worker                    GPUs                        note: role
scale_down     draining worker               GPUs                        note: role, or unreachable
fault          ``""``                        0                           note: target
=============  ============================  ==========================  ===========================

The cross-mode identity test compares :meth:`DecisionLog.decisions` (the records without ``t_s``): decisions
depend on time only through the order of arrivals/completions and time-based policies, and the two drivers'
clocks differ by overheads that do not change that order.
"""

from __future__ import annotations

import csv
import hashlib
import io
from collections.abc import Iterable
from pathlib import Path

Record = tuple[float, str, str, int, int, int, str]

FIELDS = ("t_s", "kind", "worker", "request_id", "a", "b", "note")
KINDS = (
    "route_prefill", "reject", "prefill", "route_decode", "kv_transfer", "admit", "decode", "finish",
    "requeue", "idle", "stop", "scale_up", "scale_down", "fault", "mixed",
)


class DecisionLog:
    """Append-only list of :data:`Record` tuples. ``log.add(t, kind, worker, rid, a, b, note)``.

    ``enabled=False`` keeps nothing (long benchmark runs: a simulated hour of a full rack logs ~2M records,
    ~300 MB); the scheduler's decisions do not depend on the log.
    """

    __slots__ = ("add_record", "enabled", "records")

    def __init__(self, enabled: bool = True) -> None:
        self.records: list[Record] = []
        self.enabled = enabled
        # bound method: the hot path appends a ready tuple
        self.add_record = self.records.append if enabled else _drop

    def add(self, t_s: float, kind: str, worker: str = "", request_id: int = -1, a: int = 0, b: int = 0,
            note: str = "") -> None:
        self.add_record((t_s, kind, worker, request_id, a, b, note))

    def __len__(self) -> int:
        return len(self.records)

    def decisions(self) -> list[tuple]:
        """Records without their time stamps (what the cross-mode identity test compares)."""
        return [r[1:] for r in self.records]

    def of_kind(self, kind: str) -> list[Record]:
        return [r for r in self.records if r[1] == kind]

    def to_csv(self, path: str | Path | None = None) -> str:
        """CSV text (header + one line per record; times with 9 decimals); written to ``path`` if given."""
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(FIELDS)
        for r in self.records:
            w.writerow((f"{r[0]:.9f}", *r[1:]))
        text = buf.getvalue()
        if path is not None:
            from rackbed.topology.outputs import write_text

            write_text(path, text)
        return text

    def digest(self, with_time: bool = True) -> str:
        """sha256 of the records (a cheap equality check between runs)."""
        h = hashlib.sha256()
        for r in self.records:
            h.update(repr(r if with_time else r[1:]).encode())
        return h.hexdigest()


def _drop(record: Record) -> None:
    return None


def counts(records: Iterable[Record]) -> dict[str, int]:
    """Number of records per kind, sorted by kind."""
    out: dict[str, int] = {}
    for r in records:
        out[r[1]] = out.get(r[1], 0) + 1
    return dict(sorted(out.items()))
