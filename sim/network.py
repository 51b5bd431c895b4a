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
  and are added once, after the last flow.

Instead of one SimPy process and event per flow, each direction keeps the time it becomes free (a reservation
calendar): the answer is the same for FIFO service, and a transfer costs one SimPy timeout in the KV stream's
worker process, which keeps the simulator fast. A transfer aborted by a fault keeps its reservation (the NIC
time it was using is not given back — a small, conservative approximation).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class Network:
    """Reservation calendar of every NIC direction (see module docstring)."""

    def __init__(self, nic_GBps: Mapping[str, float]) -> None:
        self.nic_Bps = {nic: float(r) * 1e9 for nic, r in nic_GBps.items()}  # GB/s -> B/s
        self.tx_free_s: dict[str, float] = {}
        self.rx_free_s: dict[str, float] = {}
        self.tx_busy_s: dict[str, float] = {}
        self.rx_busy_s: dict[str, float] = {}
        self.bytes_sent: dict[str, int] = {}
        self._pair_Bps: dict[tuple[str, str], float] = {}  # min(rate_src, rate_dst), per (src, dst)

    def reserve(self, now_s: float, flows: Iterable[tuple[str, str, int]]) -> float:
        """Book ``flows`` starting no earlier than ``now_s``; return when the last one ends (seconds)."""
        end = now_s
        tx, rx = self.tx_free_s, self.rx_free_s
        tx_busy, rx_busy, sent = self.tx_busy_s, self.rx_busy_s, self.bytes_sent
        pair_Bps = self._pair_Bps
        for src, dst, n_bytes in flows:
            if n_bytes <= 0:
                continue
            start = now_s  # max(now_s, tx free, rx free)
            f = tx.get(src)
            if f is not None and f > start:
                start = f
            f = rx.get(dst)
            if f is not None and f > start:
                start = f
            rate = pair_Bps.get((src, dst))
            if rate is None:
                rate = pair_Bps[(src, dst)] = min(self.nic_Bps[src], self.nic_Bps[dst])
            busy = n_bytes / rate  # B / (B/s) = s
            fin = start + busy
            tx[src] = fin
            rx[dst] = fin
            f = tx_busy.get(src)
            tx_busy[src] = busy if f is None else f + busy
            f = rx_busy.get(dst)
            rx_busy[dst] = busy if f is None else f + busy
            f = sent.get(src)
            sent[src] = n_bytes if f is None else f + n_bytes
            if fin > end:  # noqa: PLR1730 (cheaper than max() in this hot loop)
                end = fin
        return end

    def utilisation(self, duration_s: float) -> dict[str, dict[str, float]]:
        """Busy fraction of each used NIC direction over ``duration_s``: ``{nic: {"tx": .., "rx": ..}}``."""
        d = max(duration_s, 1e-12)
        nics = sorted(set(self.tx_busy_s) | set(self.rx_busy_s))
        return {n: {"tx": self.tx_busy_s.get(n, 0.0) / d, "rx": self.rx_busy_s.get(n, 0.0) / d} for n in nics}
