"""Tokens/s per kW as a search objective (sim.search ``objective: kw``, ``rackbed search --objective kw``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as hs

from rackbed.sim import search as se
from rackbed.sim.search_results import front_of


def _rec(gpu, kw, user):
    return {"summary": {"tokens_per_s_per_gpu": gpu, "tokens_per_s_per_kw": kw,
                        "tokens_per_s_per_user": user}}


def _kw_user(r):
    return r["summary"]["tokens_per_s_per_kw"], r["summary"]["tokens_per_s_per_user"]


POINT = hs.tuples(hs.floats(1, 100), hs.floats(1, 100), hs.floats(1, 100))


@given(hs.lists(POINT, min_size=1, max_size=12))
def test_kw_front_is_non_dominated_on_kw(pts):
    recs = [_rec(*p) for p in pts]
    front = front_of(recs, "kw")
    assert front
    for f in front:
        fk, fu = _kw_user(f)
        assert not any(k >= fk and u >= fu and (k, u) != (fk, fu) for k, u in map(_kw_user, recs))


def test_records_without_power_are_off_the_kw_front():
    recs = [_rec(10, None, 5), _rec(5, 3, 5)]
    assert front_of(recs, "kw") == [recs[1]] and len(front_of(recs, "gpu")) == 1


def test_small_search_by_tokens_per_kw(tmp_path):
    data = {"name": "t", "model": "qwen3-235b-a22b", "objective": "kw",
            "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 6},
                         "prompt": {"kind": "fixed", "tokens": 1500},
                         "output": {"kind": "fixed", "tokens": 40}, "duration_s": 4},
            "slo": {"ttft_s": 2.0, "tpot_s": 0.05},
            "space": {"topology": ["gb200-nvl72"], "weight_format": ["mxfp8"], "prefill_tp": [4],
                      "decode_ep": [8, 16], "max_batch_per_rank": [16], "draft_k": [0]},
            "max_simulations": 2, "top": 3}
    spec = se.parse_search(data, "t.yaml")
    res = se.run_search(spec, tmp_path, jobs=1, progress=False)
    ok = [r for r in res.records if r["status"] == "ok"]
    assert ok
    for r in ok:
        s = r["summary"]
        e = r["metrics"]["energy"]
        assert s["tokens_per_s_per_kw"] == pytest.approx(s["output_tokens_per_s"] / e["mean_kW"])
        assert s["j_per_output_token"] > 0 and "workers" not in e
    kw = [r["summary"]["tokens_per_s_per_kw"] for r in res.best]
    assert res.best and kw == sorted(kw, reverse=True)
    with pytest.raises(ValueError, match="objective"):
        se.parse_search({**data, "objective": "watts"}, "t.yaml")
