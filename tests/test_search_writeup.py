"""The write-up's deployment choices, as the search's analytic stage (and, where it can place them, the simulator)
sees them for Qwen3-235B:

* prefill on GB200: TP=4/EP=4 inside one tray beats TP=8/EP=8 across two trays in input tokens/s per GPU;
* decode on GB200 NVL72: DP-EP16 beats EP8 at equal batch per rank (tokens/s per user AND per decode GPU), and
  in simulation at equal load per rank;
* decode on H200 over EFA: EP16 spanning two nodes loses to EP8 inside one node.

Not reproduced (reported, not asserted): TP=2/EP=2 prefill has *more* input tokens/s per GPU than TP=4/EP=4 in
these cost models; only a TTFT bound below TP=2's floor (the p90 prompt alone, ~87 ms at 6000 tokens) prunes it.
"""

from __future__ import annotations

from rackbed import topology
from rackbed.engine.core.model import get_model
from rackbed.sim import search as se
from rackbed.sim import sweep as sw


def options(topo: str, fmt: str, *, prefill_tp=(4,), decode_ep=(8,), caps=(16, 32, 64), prompt=6000, stack="auto"):
    spec = se.parse_search({
        "name": "w", "model": "qwen3-235b-a22b",
        "workload": {"kind": "synthetic", "arrival": {"kind": "constant", "rate_per_s": 10},
                     "prompt": {"kind": "fixed", "tokens": prompt}, "output": {"kind": "fixed", "tokens": 400},
                     "duration_s": 5},
        "slo": {"ttft_s": 5.0, "tpot_s": 0.2},
        "space": {"topology": [topo], "weight_format": [fmt], "prefill_tp": list(prefill_tp),
                  "decode_ep": list(decode_ep), "max_batch_per_rank": list(caps), "draft_k": [1]},
        "scenario": {"stack": stack, "mtp": {"draft": {"kind": "mtp", "layers": 1}}}})
    model = get_model(spec.model)
    topos = {topo: topology.load(topo)}
    load = se.workload_load(spec.workload)
    return (se.prefill_options(spec, load, model, topos), se.decode_options(spec, load, model, topos))


def test_gb200_prefill_tp4_beats_tp8_per_gpu():
    pre, _ = options("gb200-nvl72", "mxfp8", prefill_tp=(2, 4, 8))
    per_gpu = {o.tp: o.capacity_tokens_per_s / o.tp for o in pre}
    assert all(o.pruned is None for o in pre)
    assert per_gpu[4] > 1.2 * per_gpu[8], per_gpu
    # where TP=8 loses: its all-reduces do not shrink while everything else halves
    b4, b8 = (next(o for o in pre if o.tp == t).breakdown.by_category() for t in (4, 8))
    assert b8["allreduce_s"] >= 0.9 * b4["allreduce_s"] and b8["moe_gemm_s"] < 0.6 * b4["moe_gemm_s"]


def _at_cap(dec):
    out = {}
    for o in dec:
        assert o.pruned is None, o.pruned
        tpot = o.tpot_at_cap_s
        out[(o.ep, o.max_batch_per_rank)] = (1 / tpot, o.b_max / tpot)  # (tok/s/user, tok/s per decode GPU)
    return out


def test_gb200_decode_ep16_dominates_ep8_at_equal_batch():
    v = _at_cap(options("gb200-nvl72", "mxfp8", decode_ep=(8, 16))[1])
    for cap in (16, 32, 64):
        u8, g8 = v[(8, cap)]
        u16, g16 = v[(16, cap)]
        assert u16 > u8 and g16 > g8, (cap, v)


def test_h200_efa_decode_ep16_across_nodes_loses_to_ep8():
    # priced by a serving stack with grouped FP8 expert kernels (TRT-LLM's measured tables): the rackbed engine
    # runs fp8_block experts one GEMM per expert, which halving the experts per rank hides the network behind
    _, dec = options("hgx-h200-efa*3", "fp8_block", decode_ep=(8, 16), stack="trtllm")
    v = _at_cap(dec)
    for cap in (16, 32, 64):
        u8, g8 = v[(8, cap)]
        u16, g16 = v[(16, cap)]
        assert u16 < u8 and g16 < g8, (cap, v)
    # the loss is the all-to-all over EFA (EP8's is DeepEP's measured NVLink kernel)
    a2a = {o.ep: o.breakdown_at_cap.by_category()["a2a_s"] for o in dec if o.max_batch_per_rank == 16}
    assert a2a[16] > 1.5 * a2a[8]


def test_gb200_decode_ep16_beats_ep8_in_simulation_at_equal_load_per_rank(tmp_path):
    base = {"kind": "serving", "topology": "gb200-nvl72", "model": "qwen3-235b-a22b", "weight_format": "mxfp8",
            "prefill": {"tp": 4, "ep": 4, "replicas": 1}, "decode": {"ep": 8, "replicas": 1,
                                                                       "max_batch_per_rank": 128},
            "mtp": {"draft_k": 1, "accept_p": 0.8, "draft": {"kind": "mtp", "layers": 1}},
            "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 10},
                         "prompt": {"kind": "fixed", "tokens": 2000}, "output": {"kind": "fixed", "tokens": 300},
                         "duration_s": 8},
            "sim": {"decision_log": False}}
    spec = sw.parse_sweep({"name": "w", "scenario": base, "points": [
        {"decode.ep": 8, "prefill.replicas": 1, "workload.arrival.rate_per_s": 30},
        {"decode.ep": 16, "prefill.replicas": 2, "workload.arrival.rate_per_s": 60}]})
    run = sw.run_points(sw.expand(spec), tmp_path / "r.jsonl", jobs=1, progress=False)
    s8, s16 = (r["summary"] for r in run.records)
    assert s8["done"] == s8["requests"] and s16["done"] == s16["requests"]
    assert s16["tokens_per_s_per_user"] > s8["tokens_per_s_per_user"]
    assert s16["tokens_per_s_per_gpu"] > s8["tokens_per_s_per_gpu"]
