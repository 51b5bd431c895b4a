"""``sim.network.Network`` (one state list per NIC) books exactly what the FIFO calendar rule says: each flow
starts when its sender's tx and its receiver's rx are both free (and not before ``now``), holds both for
``bytes / min(rates)``; a transfer ends with its last flow. Checked against a plain dict-per-direction version
of the rule, float for float, over random transfer sequences."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.sim.network import Network

_RATES = {"a": 25.0, "b": 50.0, "c": 50.0, "nvlink:x": 900.0}


def _reference(transfers):
    bps = {n: float(r) * 1e9 for n, r in _RATES.items()}
    tx, rx, tx_busy, rx_busy, sent = {}, {}, {}, {}, {}
    ends = []
    for now, flows in transfers:
        end = now
        for src, dst, n in flows:
            if n <= 0:
                continue
            start = max(now, tx.get(src, now), rx.get(dst, now))
            busy = n / min(bps[src], bps[dst])
            fin = start + busy
            tx[src] = rx[dst] = fin
            tx_busy[src] = tx_busy[src] + busy if src in tx_busy else busy
            rx_busy[dst] = rx_busy[dst] + busy if dst in rx_busy else busy
            sent[src] = sent.get(src, 0) + n
            end = max(end, fin)
        ends.append(end)
    return ends, tx_busy, rx_busy, sent


_nic = st.sampled_from(sorted(_RATES))
_flow = st.tuples(_nic, _nic, st.integers(-5, 10**9))


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5, allow_nan=False), st.lists(_flow, max_size=4)), max_size=12),
       st.floats(0.5, 20, allow_nan=False))
def test_reserve_matches_the_fifo_rule(transfers, duration):
    transfers = sorted(transfers, key=lambda x: x[0])  # the driver books in time order
    net = Network(_RATES)
    got = [net.reserve(now, flows) for now, flows in transfers]
    ends, tx_busy, rx_busy, sent = _reference(transfers)
    assert got == ends
    assert net.tx_busy_s == tx_busy
    assert net.rx_busy_s == rx_busy
    assert net.bytes_sent == sent
    nics = sorted(set(tx_busy) | set(rx_busy))
    d = max(duration, 1e-12)
    assert net.utilisation(duration) == {n: {"tx": tx_busy.get(n, 0.0) / d, "rx": rx_busy.get(n, 0.0) / d}
                                         for n in nics}


def test_flows_into_one_nic_serialise_and_disjoint_ones_overlap():
    net = Network({"s0": 10.0, "s1": 10.0, "d": 10.0, "e": 10.0})
    # two senders into one receiver: 1 s each, one after the other
    assert net.reserve(0.0, [("s0", "d", 10**10), ("s1", "d", 10**10)]) == 2.0
    # disjoint NICs later: in parallel, from now
    assert net.reserve(5.0, [("s0", "d", 10**10), ("s1", "e", 10**10)]) == 6.0
    assert net.utilisation(10.0)["d"] == {"tx": 0.0, "rx": 0.3}
