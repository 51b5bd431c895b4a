"""rackbed.engine.core.collectives: all-reduce schedules, their traffic counters, the executor, the link mapping."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rackbed.engine.core.collectives import (
    ALGORITHMS,
    Step,
    execute,
    link_bytes,
    make_schedule,
    schedule,
    sharp_cut,
    sharp_cut_per_direction,
    slices,
)

# N in 2..72, biased towards small groups (most examples) so the run stays fast, with the full range covered.
ranks = st.one_of(st.integers(2, 9), st.integers(2, 16), st.integers(2, 72))
sizes = st.one_of(st.integers(0, 40), st.integers(0, 400))
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _inputs(seed: int, n: int, n_elems: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(-1000, 1000, n_elems) for _ in range(n)]


def _is_broken(sched, arrays) -> bool:
    """True if executing ``sched`` raises or leaves some rank without the elementwise sum."""
    try:
        out = execute(sched, arrays)
    except RuntimeError:
        return True
    expected = np.sum(arrays, axis=0)
    return any(not np.array_equal(o, expected) for o in out)


# --------------------------------------------------------------------------------------------- correctness


@pytest.mark.slow
@FAST
@given(n=ranks, n_elems=sizes, seed=st.integers(0, 2**32 - 1), data=st.data())
def test_every_algorithm_returns_the_elementwise_sum_on_every_rank(n, n_elems, seed, data):
    algo = data.draw(st.sampled_from(ALGORITHMS))
    arrays = _inputs(seed, n, n_elems)
    expected = np.sum(arrays, axis=0)  # integer data: the sum is exact whatever the reduction order
    out = execute(schedule(algo, n, n_elems, elem_bytes=2), arrays)
    assert len(out) == n
    for r in range(n):
        np.testing.assert_array_equal(out[r], expected, err_msg=f"{algo} n={n} n_elems={n_elems} rank {r}")


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_float_inputs_and_shapes_are_kept(algo):
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal((3, 7)) for _ in range(5)]
    out = execute(schedule(algo, 5, 21, elem_bytes=8), arrays)
    for o in out:
        assert o.shape == (3, 7)
        np.testing.assert_allclose(o, np.sum(arrays, axis=0), rtol=1e-12, atol=1e-12)


@settings(max_examples=200, deadline=None)
@given(algo=st.sampled_from(ALGORITHMS), n=st.integers(2, 6), n_elems=st.integers(1, 20), data=st.data())
def test_dropping_any_step_breaks_the_result(algo, n, n_elems, data):
    """Every step is needed: without it, execute raises or some rank's output is wrong."""
    sched = schedule(algo, n, n_elems)
    i = data.draw(st.integers(0, len(sched.steps) - 1))
    broken = make_schedule(algo, n, n_elems, 2, sched.steps[:i] + sched.steps[i + 1 :])
    arrays = [(np.arange(n_elems) + 1) * (3**r) for r in range(n)]  # positive, distinct: no cancellations
    assert _is_broken(broken, arrays)


@pytest.mark.parametrize("algo", ["two_shot", "ring", "nvls"])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_merging_dependent_phases_breaks_the_schedule(algo, n):
    """Steps of one phase run concurrently: collapsing a multi-phase schedule into one phase must fail."""
    s = schedule(algo, n, 7)
    merged = make_schedule(algo, n, 7, 2, [x._replace(phase=0) for x in s.steps])
    assert _is_broken(merged, _inputs(11, n, 7))


# --------------------------------------------------------------------------------------------- counters


@pytest.mark.slow
@FAST
@given(algo=st.sampled_from(ALGORITHMS), n=ranks, n_elems=sizes, elem_bytes=st.sampled_from([1, 2, 4]))
def test_traffic_counters_equal_the_writeup_formulas(algo, n, n_elems, elem_bytes):
    B = n_elems * elem_bytes
    part_bytes = [ln * elem_bytes for _, ln in slices(n_elems, n)]
    t = schedule(algo, n, n_elems, elem_bytes).traffic

    if algo in ("naive", "one_shot"):
        assert t.total_read_bytes == n * (n - 1) * B  # naive N(N-1)B reads
        assert t.total_write_bytes == 0
        assert t.per_rank_read_bytes == (((n - 1) * B),) * n
        assert t.n_phases == (1 if algo == "one_shot" else n - 1) * (B > 0)
    elif algo == "two_shot":
        assert t.total_peer_bytes == 2 * (n - 1) * B  # reduce-scatter + all-gather 2(N-1)B
        assert t.total_read_bytes == t.total_write_bytes == (n - 1) * B
        assert t.per_rank_read_bytes == t.per_rank_send_bytes == tuple((n - 1) * pb for pb in part_bytes)
        assert t.per_rank_transaction_bytes == tuple(2 * (n - 1) * pb for pb in part_bytes)
        if n_elems % n == 0:
            assert t.per_rank_transaction_bytes == (Fraction(2 * (n - 1) * B, n),) * n  # 2(N-1)B/N per GPU
    elif algo == "ring":
        assert t.total_peer_bytes == t.total_write_bytes == 2 * (n - 1) * B
        assert t.total_read_bytes == 0
        assert t.n_phases == (2 * (n - 1) if n_elems else 0)  # 2(N-1) steps
    else:
        assert t.total_peer_bytes == 0
        # SHARP: GPU<->switch transactions B per GPU (B/N own slice + (N-1)B/N for the peers' slices)
        assert t.per_rank_transaction_bytes == (B,) * n
        # physical per-direction bytes on each GPU port: B + |s_r| both ways; all of it GPU<->switch
        assert t.per_rank_tx_bytes == t.per_rank_rx_bytes == tuple(B + pb for pb in part_bytes)
        assert t.per_rank_gpu_switch_bytes == tuple(2 * (B + pb) for pb in part_bytes)
        if n_elems % n == 0 and n_elems:
            two = schedule("two_shot", n, n_elems, elem_bytes).traffic
            # without SHARP 2(N-1)B/N per GPU, with SHARP B: ratio N/(2(N-1)) exactly
            ratio = Fraction(t.per_rank_transaction_bytes[0], two.per_rank_transaction_bytes[0])
            assert ratio == Fraction(n, 2 * (n - 1)) == 1 - Fraction(sharp_cut(n)).limit_denominator(10**6)
            ratio_dir = Fraction(t.per_rank_tx_bytes[0], two.per_rank_tx_bytes[0])
            assert ratio_dir == Fraction(n + 1, 2 * (n - 1))
            assert sharp_cut_per_direction(n) == pytest.approx(float(1 - ratio_dir))
    # every byte that leaves a GPU arrives at one
    assert sum(t.per_rank_tx_bytes) == sum(t.per_rank_rx_bytes)


def test_sharp_cut_is_33_percent_at_4_gpus():
    assert sharp_cut(4) == pytest.approx(1 / 3)
    assert 1 - sharp_cut(4) == pytest.approx(0.6667, abs=1e-4)  # N/(2(N-1)) at N=4
    assert sharp_cut(2) == 0.0
    assert sharp_cut_per_direction(4) == pytest.approx(1 / 6)
    assert sharp_cut_per_direction(8) == pytest.approx(5 / 14)
    with pytest.raises(ValueError, match="n_ranks"):
        sharp_cut(1)


@pytest.mark.parametrize(
    "algo, n, phases, syncs",
    [
        ("naive", 4, 3, 1),  # N-1 dependent peer loads, inputs ready once
        ("one_shot", 4, 1, 1),
        ("two_shot", 4, 2, 2),  # start barrier + stores landed
        ("ring", 4, 6, 6),  # 2(N-1) steps, each a flagged send
        ("ring", 72, 142, 142),
        ("nvls", 4, 2, 2),
        ("nvls", 72, 2, 2),
    ],
)
def test_phases_and_sync_points(algo, n, phases, syncs):
    t = schedule(algo, n, 1000).traffic
    assert (t.n_phases, t.n_sync_points) == (phases, syncs)


def test_two_shot_steps_by_hand():
    """N=3, 5 elements: slices [0,2) [2,4) [4,5); rank r reduces slice r then stores it to the others."""
    s = schedule("two_shot", 3, 5, elem_bytes=2)
    assert slices(5, 3) == [(0, 2), (2, 2), (4, 1)]
    assert s.steps[:3] == (
        Step(0, "load", 0, 0, 0, 2),
        Step(0, "reduce_load", 0, 1, 0, 2),
        Step(0, "reduce_load", 0, 2, 0, 2),
    )
    stores_of_rank_2 = [x for x in s.steps if x.kind == "store" and x.rank == 2]
    assert stores_of_rank_2 == [Step(1, "store", 2, 0, 4, 1, "out"), Step(1, "store", 2, 1, 4, 1, "out")]
    assert s.traffic.per_rank_read_bytes == (8, 8, 4)  # 2 peers x 2 elements x 2 bytes; last slice 1 element
    assert s.traffic.total_peer_bytes == 2 * 2 * 10


def test_one_rank_and_empty_buffers():
    for algo in ALGORITHMS:
        out = execute(schedule(algo, 1, 4), [np.arange(4)])
        np.testing.assert_array_equal(out[0], np.arange(4))
        assert schedule(algo, 1, 4).traffic.total_peer_bytes == 0
        assert execute(schedule(algo, 3, 0), [np.zeros(0)] * 3)[0].shape == (0,)


def test_user_errors_are_one_line_value_errors():
    with pytest.raises(ValueError, match="algo must be one of"):
        schedule("tree", 4, 10)
    with pytest.raises(ValueError, match="n_ranks must be >= 1"):
        schedule("ring", 0, 10)
    with pytest.raises(ValueError, match="expected"):
        execute(schedule("ring", 2, 10), [np.zeros(10), np.zeros(9)])
    with pytest.raises(ValueError, match="outside"):
        make_schedule("x", 2, 4, 2, [Step(0, "load", 0, 1, 2, 3)])
    with pytest.raises(ValueError, match="switch"):
        make_schedule("x", 2, 4, 2, [Step(0, "multimem_st", 0, 1, 0, 1)])


def test_executor_follows_the_steps_not_a_sum():
    """A schedule with its stores' destinations swapped (src/dst offsets exchanged) gives wrong results."""
    s = schedule("two_shot", 3, 6)
    bad = [x._replace(elem_offset=(x.elem_offset + 2) % 6) if x.kind == "store" else x for x in s.steps]
    assert _is_broken(make_schedule("two_shot", 3, 6, 2, bad), _inputs(7, 3, 6))
    # stores sent from the peer to the rank instead of rank to peer
    bad = [x._replace(rank=x.peer, peer=x.rank) if x.kind == "store" else x for x in s.steps]
    assert _is_broken(make_schedule("two_shot", 3, 6, 2, bad), _inputs(7, 3, 6))
    # a ring whose all-gather forwards the wrong chunk
    s = schedule("ring", 4, 8)
    bad = [x._replace(elem_offset=(x.elem_offset + 2) % 8) if x.kind == "recv" else x for x in s.steps]
    assert _is_broken(make_schedule("ring", 4, 8, 2, bad), _inputs(3, 4, 8))
    # reading a peer's out before anyone wrote it is an error
    with pytest.raises(RuntimeError, match="before it was written"):
        execute(make_schedule("x", 2, 2, 2, [Step(0, "load", 0, 1, 0, 2, "out")]), _inputs(0, 2, 2))
    # a recv without a send is an error
    with pytest.raises(RuntimeError, match="no message"):
        execute(make_schedule("x", 2, 2, 2, [Step(0, "recv", 0, 1, 0, 2)]), _inputs(0, 2, 2))


# --------------------------------------------------------------------------------------------- links


@dataclass(frozen=True)
class _Hop:
    src: str
    dst: str


class _StarTopology:
    """A fake NVSwitch box: every GPU hangs off one switch plane for P2P; ``n_planes`` reducing switches."""

    def __init__(self, n_planes: int = 2, sharp: bool = True):
        self.n_planes, self.sharp = n_planes, sharp

    def path(self, a: int, b: int) -> list[_Hop]:
        return [_Hop(f"gpu:{a}", "nvsw:0"), _Hop("nvsw:0", f"gpu:{b}")]

    def reducing_switches(self, gpus: list[int]) -> list[str]:
        return [f"nvsw:{j}" for j in range(self.n_planes)] if self.sharp else []


class _LineTopology:
    """GPUs on a line with direct links i <-> i+1 (multi-hop paths)."""

    def path(self, a: int, b: int) -> list[_Hop]:
        step = 1 if b > a else -1
        return [_Hop(f"gpu:{i}", f"gpu:{i + step}") for i in range(a, b, step)]

    def reducing_switches(self, gpus):
        return []


@settings(max_examples=200, deadline=None)
@given(
    algo=st.sampled_from(ALGORITHMS),
    n=st.integers(2, 9),
    n_elems=st.integers(1, 50),
    offset=st.integers(0, 5),
)
def test_link_bytes_on_a_star_equal_the_port_counters(algo, n, n_elems, offset):
    s = schedule(algo, n, n_elems, elem_bytes=2)
    gpus = [offset + 2 * i for i in range(n)]  # ranks on non-contiguous GPU ids
    planes = 3
    links = link_bytes(s, _StarTopology(planes), gpus)
    for r, g in enumerate(gpus):
        up = sum(v for (a, _), v in links.items() if a == f"gpu:{g}")
        down = sum(v for (_, b), v in links.items() if b == f"gpu:{g}")
        assert up == pytest.approx(s.traffic.per_rank_tx_bytes[r])
        assert down == pytest.approx(s.traffic.per_rank_rx_bytes[r])
    if algo == "nvls":
        assert {b for (_, b) in links if b.startswith("nvsw")} == {f"nvsw:{j}" for j in range(planes)}


def test_link_bytes_by_hand_on_a_line():
    # two_shot over GPUs 0,1,2 on a line, 3 elements x 2 bytes: every rank moves one 2-byte element per peer.
    s = schedule("two_shot", 3, 3, elem_bytes=2)
    links = link_bytes(s, _LineTopology(), [0, 1, 2])
    # data 0->1: rank1 reads from 0 (2) + rank0 stores to 1 (2) + 0->2 traffic crossing (rank2 reads 0, rank0
    # stores to 2: 4) = 8; symmetric on every directed link
    assert links == {
        ("gpu:0", "gpu:1"): 8.0,
        ("gpu:1", "gpu:2"): 8.0,
        ("gpu:1", "gpu:0"): 8.0,
        ("gpu:2", "gpu:1"): 8.0,
    }
    # a reversed rank->GPU mapping keeps the totals
    assert sum(link_bytes(s, _LineTopology(), [2, 1, 0]).values()) == sum(links.values())


def test_link_bytes_errors():
    with pytest.raises(ValueError, match="no reducing switch"):
        link_bytes(schedule("nvls", 4, 8), _StarTopology(sharp=False), [0, 1, 2, 3])
    with pytest.raises(ValueError, match="repeat"):
        link_bytes(schedule("ring", 2, 8), _StarTopology(), [0, 0])
    with pytest.raises(ValueError, match="gpus for a"):
        link_bytes(schedule("ring", 2, 8), _StarTopology(), [0])
