"""Peer-memory all-reduce: schedule, size selection and the flag protocol (CPU), and the device check (2 GPUs)."""

from __future__ import annotations

import importlib.util

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.kernels.allreduce_schedule import (
    ONE_SHOT_MAX_BYTES,
    block_range,
    bound_us,
    chunk_range,
    emulate,
    expected,
    launch_shape,
    make_layout,
    select_algo,
    sizes_from_args,
    traffic_bytes,
    vector_width,
)
from rackbed.topology.errors import UserError


@given(count=st.integers(0, 5000), nblk=st.integers(1, 300))
@settings(max_examples=300, deadline=None)
def test_block_ranges_partition_exactly(count, nblk):
    seen = []
    for b in range(nblk):
        lo, hi = block_range(count, b, nblk)
        assert 0 <= lo <= hi <= count
        seen.extend(range(lo, hi))
    assert seen == list(range(count))


@given(n_vec=st.integers(0, 5000), n=st.integers(2, 8))
@settings(max_examples=300, deadline=None)
def test_chunks_partition_exactly_even_when_not_divisible(n_vec, n):
    seen = []
    for c in range(n):
        lo, hi = chunk_range(n_vec, n, c)
        seen.extend(range(lo, hi))
        assert hi - lo <= -(-n_vec // n)
    assert seen == list(range(n_vec))


@given(n=st.integers(2, 8), max_bytes=st.integers(1, 1 << 28), blocks=st.integers(1, 264))
@settings(max_examples=300, deadline=None)
def test_layout_regions_are_disjoint_and_large_enough(n, max_bytes, blocks):
    lay = make_layout(n, max_bytes, blocks)
    regions = [(lay.table_off, 8 * (n + 2)), (lay.err_off, 4), (lay.counters_off, 4 * blocks),
               (lay.flags_off, 2 * blocks * 8 * 4), (lay.rs_off, n * lay.rs_slot_bytes), (lay.ag_off, lay.ag_bytes),
               (lay.os_off, 2 * n * lay.os_slot_bytes)]
    regions.sort()
    for (a, la), (b, _) in zip(regions, regions[1:]):
        assert a + la <= b
    assert regions[-1][0] + regions[-1][1] <= lay.total_bytes
    # the largest vectorised tensor fits: n_vec*16 <= max_bytes+15; a two-shot chunk is ceil(n_vec/N) vectors
    n_vec16 = -(-max_bytes // 16)
    assert n_vec16 * 16 <= lay.ag_bytes and n_vec16 * 16 <= lay.os_slot_bytes
    assert -(-n_vec16 // n) * 16 <= lay.rs_slot_bytes
    assert lay.flag_off(1, blocks - 1, 7) + 4 <= lay.rs_off


def test_flag_offsets_hand_computed():
    lay = make_layout(2, 1 << 20, 132)
    assert lay.flags_off == 1024  # round_up(256 + 4*132, 256)
    assert lay.flag_off(0, 0, 1) == 1024 + 4
    assert lay.flag_off(1, 2, 3) == 1024 + ((1 * 132 + 2) * 8 + 3) * 4


def test_vector_width():
    assert vector_width(1024, 2) == 8
    assert vector_width(1024, 4) == 4
    assert vector_width(1020, 2) == 4
    assert vector_width(1001, 2) == 1
    assert vector_width(1024, 2, 256, 8) == 4  # an address only 8-byte aligned
    assert vector_width(6, 4) == 2


def test_select_algo_and_launch_shape():
    assert select_algo(8 << 10, 2) == "one_shot"
    assert select_algo(ONE_SHOT_MAX_BYTES[4] + 1, 4) == "two_shot"
    assert select_algo(1 << 20, 2, one_shot_max_bytes=1 << 19) == "two_shot"
    s = launch_shape(4096, "bf16", 2, "one_shot", 132)  # 512 vectors of 8 -> one block of 512 threads
    assert (s.vec, s.n_vec, s.grid) == (8, 512, 1)
    s = launch_shape(64 << 20, "bf16", 2, "two_shot", 132)
    assert (s.vec, s.n_vec, s.grid) == (8, 8 << 20, 132)
    s = launch_shape(1001, "fp32", 2, "two_shot", 132)
    assert (s.vec, s.n_vec, s.grid) == (1, 1001, 1)
    for bad in (lambda: launch_shape(8, "fp16", 2, "one_shot", 1), lambda: launch_shape(8, "bf16", 2, "ring", 1),
                lambda: make_layout(1, 8), lambda: make_layout(9, 8), lambda: make_layout(2, 0),
                lambda: select_algo(-1, 2)):
        with pytest.raises(UserError):
            bad()


def test_traffic_and_bound_hand_computed():
    b = 128 << 20
    assert traffic_bytes("two_shot", b, 2)["nvlink_send_bytes"] == b  # B/2 reduce-scatter + B/2 gather
    assert traffic_bytes("one_shot", b, 2)["nvlink_send_bytes"] == b
    assert traffic_bytes("two_shot", b, 8)["nvlink_send_bytes"] == pytest.approx(2 * 7 / 8 * b)
    assert traffic_bytes("one_shot", b, 8)["nvlink_send_bytes"] == 7 * b
    # 128 MiB, 2 ranks, 385 GB/s per direction -> 134217728 / 385e9 s = 348.6 us
    assert bound_us(b, 2, 385.0) == pytest.approx(348.62, abs=0.01)


def test_sizes_from_args():
    assert sizes_from_args(["8K", "1M", "128MiB", "4096"]) == [8192, 1 << 20, 128 << 20, 4096]
    default = sizes_from_args(None)
    assert default[0] == 8 << 10 and default[-1] == 128 << 20 and len(default) == 15
    for bad in (["8X"], ["-1"], ["0"], ["K"]):
        with pytest.raises(UserError):
            sizes_from_args(bad)


call_st = st.tuples(st.sampled_from(["one_shot", "two_shot", "two_shot_pull"]), st.integers(1, 40), st.integers(1, 6))


@pytest.mark.slow
@given(calls=st.lists(call_st, min_size=1, max_size=6), n=st.integers(2, 4), seed=st.integers(0, 10**6))
@settings(max_examples=200, deadline=None)
def test_emulated_protocol_is_correct_under_any_interleaving(calls, n, seed):
    """Back-to-back calls with mixed schedules, sizes and grids, random interleaving of all blocks of all
    ranks: every rank's output equals the exact sum, so no flag is missed and no buffer is overwritten early."""
    outs = emulate(calls, n, max_blocks=6, seed=seed)
    ref = expected(calls, n)
    for k in range(len(calls)):
        for r in range(n):
            assert outs[k][r] == ref[k], (k, r, calls[k])


def test_emulation_detects_a_broken_protocol(monkeypatch):
    """The emulation can fail: with a single one-shot buffer (no parity halves) a fast rank overwrites a slot
    that a slow peer has not reduced yet, and some seed exposes it."""
    import rackbed.kernels.allreduce_schedule as sch

    orig = sch._block_program

    def no_parity(ranks, r, b, nblk, algo, inp, out, n_vec):
        for rank in ranks:  # alias both halves: parity no longer separates consecutive calls
            rank.os[1] = rank.os[0]
        yield from orig(ranks, r, b, nblk, algo, inp, out, n_vec)

    monkeypatch.setattr(sch, "_block_program", no_parity)
    calls = [("one_shot", 16, 2)] * 4
    ref = expected(calls, 2)
    broken = any(emulate(calls, 2, 2, seed) != [[ref[k]] * 2 for k in range(4)] for seed in range(200))
    assert broken


def _gpu_ready() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return (torch.cuda.is_available() and torch.cuda.device_count() >= 2
            and torch.cuda.get_device_capability(0) >= (9, 0)
            and importlib.util.find_spec("cutlass") is not None
            and importlib.util.find_spec("cuda") is not None)


def _check_worker(rank, world, port, path):
    import json
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from rackbed.kernels.allreduce import PeerAllReduce
    from rackbed.kernels.bench.allreduce import check_correctness

    torch.cuda.set_device(rank)
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120), device_id=torch.device("cuda", rank))
    with PeerAllReduce(None, max_bytes=9 << 20, dtype=torch.bfloat16, backend="cute") as ar:
        res = check_correctness(ar, seed=int.from_bytes(os.urandom(2), "little"))
    if rank == 0:
        with open(path, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ready(), reason="needs >= 2 Hopper GPUs, cuda-python and CuTe DSL")
def test_device_allreduce_correct(tmp_path):
    """Fresh random inputs, poisoned outputs, odd sizes, both schedules, eager and graph replay, on all GPUs."""
    import json

    import torch
    import torch.multiprocessing as mp

    from rackbed.kernels.bench.suites import _free_port

    path = str(tmp_path / "check.json")
    mp.spawn(_check_worker, args=(torch.cuda.device_count(), _free_port(), path), nprocs=torch.cuda.device_count())
    res = json.load(open(path))
    bad = [c for c in res if not c["ok"]]
    assert res and not bad, bad[:5]
