"""``rackbed bench sim`` (sim/bench.py) and the scenario cost model's fast paths (sim.scenario.ScenarioCostModel):
the decode step split into context-free terms + attention is exactly ``decode_step_time``; ``decode_point`` keeps
its bucket contract; the prefill memo (shared by groups that look alike) is exactly ``prefill_batch_time``."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.engine.cli.main import main as cli_main
from rackbed.engine.core.plans import PrefillBatch
from rackbed.sim.bench import bench_scenario, run_bench
from rackbed.sim.costs.step import decode_step_time, prefill_batch_time
from rackbed.sim.scenario import build, parse_scenario

_BUILT: dict[str, object] = {}


def _built(kind: str):
    """Built scenarios (cached): the benchmark's GB200 NVL72 (Qwen3-235B), and Qwen3.5-122B (linear attention,
    native MTP layer) on an HGX H200 with a calibration table."""
    if kind not in _BUILT:
        if kind == "nvl72":
            sc = bench_scenario(60.0)
        else:
            sc = parse_scenario({
                "name": "q35", "topology": "hgx-h200", "model": "qwen3.5-122b-a10b", "weight_format": "fp8_block",
                "prefill": {"tp": 4, "ep": 4, "replicas": 1}, "decode": {"ep": 4, "replicas": 1},
                "mtp": {"draft_k": 2}, "workload": {"kind": "trace", "name": "mooncake", "max_requests": 10}})
        _BUILT[kind] = build(sc)
    return _BUILT[kind]


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["nvl72", "q35"]), b=st.integers(0, 64), ctx=st.integers(0, 3_000_000),
       k=st.integers(0, 3), group_i=st.integers(0, 2))
def test_decode_point_is_decode_step_time_at_the_bucket_middle(kind, b, ctx, k, group_i):
    bt = _built(kind)
    cm = bt.cost_model
    g = bt.deployment.decoders[group_i % len(bt.deployment.decoders)]
    st_, hi = cm.decode_point(g, b, ctx, k)
    pl = cm._plan_for(g)
    n = pl.world
    if b == 0:
        mid = 0
    else:
        shift = max(ctx.bit_length() - cm.CTX_BITS, 0)
        lo = ctx >> shift << shift
        mid = lo + (1 << shift >> 1)
        assert hi == lo + (1 << shift) - 1 and lo <= ctx <= hi
        assert hi - lo + 1 <= max(1, ctx / 2 ** (cm.CTX_BITS - 1))  # the grid: <= 1/64 of the context wide
    direct = decode_step_time(bt.model, pl, bt.topology, [b] * n, [mid] * n, draft_k=k, calib=cm.calib)
    assert st_ == direct  # exact: the split reproduces every float
    # every context up to hi prices the same; the plan-based entry point agrees
    assert cm.decode_point(g, b, hi, k)[0] is st_
    assert cm._split_ok


def _mid(ctx: int, bits: int) -> int:
    shift = max(ctx.bit_length() - bits, 0)
    return (ctx >> shift << shift) + (1 << shift >> 1)


def test_decode_split_falls_back_when_the_check_fails():
    bt = build(bench_scenario(60.0))
    cm = bt.cost_model
    g = bt.deployment.decoders[0]
    pl = cm._plan_for(g)
    cm._assemble = lambda *a, **kw: None  # a split that no longer matches sim.costs.step
    for b, ctx in ((10, 200_000), (11, 300_000)):
        st_, _ = cm.decode_point(g, b, ctx, 1)
        mid = _mid(ctx, cm.CTX_BITS)
        assert st_ == decode_step_time(bt.model, pl, bt.topology, [b] * 16, [mid] * 16, draft_k=1,
                                       calib=cm.calib)
        assert not cm._split_ok  # direct evaluation from the first failed check on


def test_prefill_memo_is_exact_across_groups():
    bt = build(bench_scenario(60.0))
    cm = bt.cost_model
    rng = random.Random(3)
    groups = bt.deployment.prefillers
    batches = []
    for _ in range(30):
        items = tuple((i, 0, rng.randint(1, 9000)) for i in range(rng.randint(1, 3)))
        batches.append(items)
    for rep in range(3):  # second and third passes hit the memo, from other groups too
        for j, items in enumerate(batches):
            g = groups[(j + rep) % len(groups)]
            plan = PrefillBatch(g.id, 0, items, sum(x[2] for x in items))
            got = cm.prefill(plan, g)
            assert got == prefill_batch_time(bt.model, cm._plan_for(g), bt.topology, plan, calib=cm.calib)
    assert len({cm._pclass[g.id] for g in groups}) == 1  # the six trays look the same to sim.costs
    assert len(cm._prefill_memo) == len(set(batches))


def test_bench_sim_short_run(tmp_path):
    out = run_bench(20.0)
    for key in ("wall_s", "cpu_s", "sim_s_per_wall_s", "events", "events_per_s", "decode_steps",
                "decode_steps_per_wall_s", "wall_s_per_sim_hour"):
        assert out[key] > 0, key
    assert out["requests"]["done"] > 300
    assert out["utilisation"]["decode"] > 0.5  # the rack is loaded
    assert out["decode_steps"] <= out["events"]
    # the CLI writes the same JSON shape
    path = tmp_path / "b.json"
    assert cli_main(["bench", "sim", "--sim-s", "5", "--out", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["sim_s"] == 5.0 and data["scenario"] == "bench-sim-nvl72"


def test_bench_sim_user_errors(capsys):
    assert cli_main(["bench", "sim", "--sim-s", "0"]) == 2
    assert "--sim-s: must be > 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--rate"):
        bench_scenario(10.0, 0.0)
