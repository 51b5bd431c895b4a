"""Fault injection: a GPU, a node, a rack or a link (a NIC's link to the fabric, or all of a rack's) goes down
at a time, optionally for a while.

Targets use the topology's names: ``gpu:<i>`` (global GPU index), ``node:<h>`` (host index: all its GPUs and
NICs), ``nic:<k>`` (the link of NIC ``k``), ``rack:<d>`` (NVLink domain ``d``, numbered from the lowest GPU:
all its GPUs and NICs — a whole GB200 NVL72; on HGX nodes one node) and ``rack_link:<d>`` (the fabric links
of every NIC of domain ``d``: the rack cut off from the scale-out network, its GPUs still up). The driver
calls ``scheduler.fail`` at ``at_s`` and, when ``duration_s`` is set, ``scheduler.recover`` at
``at_s + duration_s``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from rackbed.topology.errors import UserError

_TARGET = re.compile(r"^(gpu|node|nic|rack|rack_link):\d+$")
TARGETS = "gpu:<i>, node:<host>, nic:<k>, rack:<domain> or rack_link:<domain>"


@dataclass(frozen=True, order=True)
class Fault:
    at_s: float
    target: str
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if not _TARGET.match(self.target):
            raise UserError(f"faults: target {self.target!r} must be {TARGETS}")
        if not self.at_s >= 0:
            raise UserError(f"faults: at_s must be >= 0, got {self.at_s} for {self.target}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise UserError(f"faults: duration_s must be > 0 or null, got {self.duration_s} for {self.target}")


def parse_faults(items: Iterable[Fault | Mapping]) -> tuple[Fault, ...]:
    """Faults from dicts (``{at_s, target, duration_s?}``) or Fault objects, sorted by (time, target)."""
    out = []
    for i, it in enumerate(items):
        if isinstance(it, Fault):
            out.append(it)
            continue
        extra = set(it) - {"at_s", "target", "duration_s"}
        if extra:
            raise UserError(f"faults[{i}]: unknown key {min(extra)!r}")
        if "at_s" not in it or "target" not in it:
            raise UserError(f"faults[{i}]: needs at_s and target")
        out.append(Fault(at_s=float(it["at_s"]), target=str(it["target"]),
                         duration_s=None if it.get("duration_s") is None else float(it["duration_s"])))
    out.sort(key=lambda f: (f.at_s, f.target))
    return tuple(out)
