"""NIC contention for KV transfers: each NIC direction is a FIFO server (the ns.py ``Port`` idea, as a calendar).

Timing assumptions:

- a NIC sends (tx) and receives (rx) independently (full duplex); each direction serves one flow at a time, FIFO
  in the order transfers start;
- a flow ``(src_nic, dst_nic, n_bytes)`` holds the sender's tx and the receiver's rx together, cut-through, for
  ``n_bytes / (min(rate_src, rate_dst) × 1e9)`` seconds (rates in GB/s = 1e9 B/s per direction), starting when
  both are free;
- the flows of one transfer (one per sending NIC) go in parallel where their NICs differ; flows into the same
  receiving NIC serialise there — a DP decoder rank receiving a TP=4 prefiller's KV through its one NIC takes
  ``total bytes / its rate``;
- fixed costs (per-chunk overhead, path latency) come from the cost model's :class:`~sim.executor.TransferCost`
  and are added once, after the last flow;
- a NIC of a group whose expert-parallel all-to-all crosses nodes (``span_nodes``) also carries that traffic:
  ``ep_share[nic]`` (``ScenarioCostModel.ep_nic_share``: the all-to-all's RDMA seconds over the step's, at the
  group's full batch) is taken off its rate for KV flows, in both directions. The share is a steady-state
  fraction, not a per-step reservation: the all-to-all's own time is in the step cost and is not slowed by KV.

Instead of one SimPy process and event per flow, each direction keeps the time it becomes free (a reservation
calendar, one small list per NIC): the answer is the same for FIFO service, and a transfer costs one SimPy
timeout in the KV stream's worker process, which keeps the simulator fast. A transfer aborted by a fault keeps its reservation (the NIC
time it was using is not given back — a small, conservative approximation).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from math import inf


class Network:
    """Reservation calendar of every NIC direction (see module docstring)."""

    def __init__(self, nic_GBps: Mapping[str, float], ep_share: Mapping[str, float] | None = None) -> None:
        share = ep_share or {}
        # GB/s -> B/s, less the share an EP all-to-all across nodes keeps busy (module docstring)
        self.nic_Bps = {nic: float(r) * 1e9 * (1.0 - share.get(nic, 0.0)) for nic, r in nic_GBps.items()}
        # per NIC that carried a flow: [tx free at, rx free at, tx busy s, rx busy s, bytes sent, rate B/s]
        # (one list per NIC: two dict look-ups per flow instead of a dozen)
        self._st: dict[str, list] = {}

    def _nic(self, nic: str) -> list:
        st = self._st[nic] = [-inf, -inf, 0.0, 0.0, 0, self.nic_Bps[nic]]
        return st

    def reserve(self, now_s: float, flows: Iterable[tuple[str, str, int]]) -> float:
        """Book ``flows`` starting no earlier than ``now_s``; return when the last one ends (seconds)."""
        end = now_s
        st = self._st
        for src, dst, n_bytes in flows:
            if n_bytes <= 0:
                continue
            a = st.get(src)
            if a is None:
                a = self._nic(src)
            b = st.get(dst)
            if b is None:
                b = self._nic(dst)
            start = now_s  # max(now_s, tx free, rx free)
            f = a[0]
            if f > start:  # noqa: PLR1730 (no max() call in this hot loop)
                start = f
            f = b[1]
            if f > start:  # noqa: PLR1730
                start = f
            ra = a[5]
            rb = b[5]
            busy = n_bytes / (ra if ra <= rb else rb)  # noqa: FURB136 (B / min(rate_src, rate_dst) = s)
            fin = start + busy
            a[0] = fin
            b[1] = fin
            a[2] += busy
            b[3] += busy
            a[4] += n_bytes
            if fin > end:  # noqa: PLR1730 (cheaper than max() in this hot loop)
                end = fin
        return end

    # the per-direction views (NICs that sent / received), for inspection
    @property
    def tx_busy_s(self) -> dict[str, float]:
        return {n: v[2] for n, v in self._st.items() if v[0] != -inf}

    @property
    def rx_busy_s(self) -> dict[str, float]:
        return {n: v[3] for n, v in self._st.items() if v[1] != -inf}

    @property
    def bytes_sent(self) -> dict[str, int]:
        return {n: v[4] for n, v in self._st.items() if v[0] != -inf}

    def utilisation(self, duration_s: float) -> dict[str, dict[str, float]]:
        """Busy fraction of each used NIC direction over ``duration_s``: ``{nic: {"tx": .., "rx": ..}}``."""
        d = max(duration_s, 1e-12)
        st = self._st
        return {n: {"tx": st[n][2] / d, "rx": st[n][3] / d} for n in sorted(st)}
