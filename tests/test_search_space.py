"""The search space's knobs reach the priced plans: the KV cache format (capacity and attention reads), the batch-cap
grid (spec and flag, one-line errors), and the decoders' attention TP in the budget search."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed import topology
from rackbed.engine.core.model import get_model
from rackbed.sim import budget as bu
from rackbed.sim import search as se
from rackbed.topology.errors import UserError

DECODE_BOUND = {"kind": "synthetic", "arrival": {"kind": "constant", "rate_per_s": 10},
                "prompt": {"kind": "fixed", "tokens": 6000}, "output": {"kind": "fixed", "tokens": 1000},
                "duration_s": 10}


def make_spec(space=None, **kw):
    data = {"name": "t", "model": "qwen3-235b-a22b",
            "workload": {"kind": "synthetic", "arrival": {"kind": "constant", "rate_per_s": 10},
                         "prompt": {"kind": "fixed", "tokens": 6000}, "output": {"kind": "fixed", "tokens": 100},
                         "duration_s": 10},
            "slo": {"ttft_s": 2.0, "tpot_s": 0.05},
            "space": {"topology": ["hgx-h200"], "weight_format": ["fp8"], "prefill_tp": [8],
                      "decode_ep": [8], "max_batch_per_rank": [64], "draft_k": [0], **(space or {})},
            **kw}
    return se.parse_search(data, "t.yaml")


def parts(spec):
    return get_model(spec.model), {t: topology.load(t) for t in spec.space.topology}, se.workload_load(spec.workload)


def test_fp8_kv_doubles_the_kv_capacity_and_reads_half_the_bytes():
    """With ``space.kv_dtype: [bf16, fp8]`` each decode option is priced with its own KV format: fp8 holds about
    twice the tokens per rank (so more sequences under a cap the bf16 KV binds) and its step at one batch is
    cheaper (the attention reads half the bytes); candidates pair options of one format and carry it."""
    spec = make_spec({"kv_dtype": ["bf16", "fp8"], "max_batch_per_rank": [512]}, slo={"ttft_s": 2.0, "tpot_s": 0.1})
    model, topos, load = parts(spec)
    dec = {o.kv_dtype: o for o in se.decode_options(spec, load, model, topos)}
    bf, f8 = dec["bf16"], dec["fp8"]
    assert bf.pruned is None and f8.pruned is None, (bf.pruned, f8.pruned)
    assert 1.9 < f8.kv_capacity_tokens / bf.kv_capacity_tokens < 2.1
    assert bf.b_max < 512 and f8.b_max > 1.8 * bf.b_max  # the KV binds, not the cap
    # one batch for both (the bf16 option's b_max as the cap): the fp8 step is the cheaper
    spec1 = make_spec({"kv_dtype": ["bf16", "fp8"], "max_batch_per_rank": [bf.b_max]}, slo=spec.slo.model_dump())
    same = {o.kv_dtype: o for o in se.decode_options(spec1, load, model, topos)}
    assert same["fp8"].b_max == same["bf16"].b_max == bf.b_max
    assert same["fp8"].tpot_at_cap_s < same["bf16"].tpot_at_cap_s
    pre = se.prefill_options(spec1, load, model, topos)
    cands = se.candidates(spec1, load, model, topos, pre, list(same.values()))
    assert sorted(c.prefill.kv_dtype for c in cands) == ["bf16", "fp8"]
    for c in cands:
        assert c.prefill.kv_dtype == c.decode.kv_dtype == c.overrides["kv_dtype"]
        assert c.label.endswith(f"kv {c.decode.kv_dtype}")
        assert se._scenario(se.base_scenario(spec1), c.overrides).kv_dtype == c.decode.kv_dtype


def test_an_unvaried_kv_format_leaves_the_overrides_as_they_were():
    spec = make_spec()
    model, topos, load = parts(spec)
    pre, dec = se.prefill_options(spec, load, model, topos), se.decode_options(spec, load, model, topos)
    (c,) = se.candidates(spec, load, model, topos, pre, dec)
    assert spec.space.kv_dtype is None and "kv_dtype" not in c.overrides and "kv" not in c.label
    from rackbed.engine.cli.search import identity

    assert "kv_dtype" not in identity(spec, "rate")["spec"]["space"]


def test_fp8_kv_wins_the_budget_search_where_the_kv_binds():
    """On 16 H200 with 6000-token prompts and 1000-token outputs (decode-bound) the bf16 KV holds fewer sequences
    than a batch cap of 128: the budget search's best disaggregated estimate with the fp8 KV carries more
    requests/s on the same GPUs."""
    spec = make_spec({"kv_dtype": ["bf16", "fp8"], "max_batch_per_rank": [128], "prefill_tp": [2],
                      "topology": ["hgx-h200*2"]}, slo={"ttft_s": 2.0, "tpot_s": 0.1},
                     workload=DECODE_BOUND)
    model, topos, load = parts(spec)
    cands = [c for c in bu.disaggregated_candidates(spec, load, model, topos["hgx-h200*2"], 16)
             if c.pruned is None]
    best = {kv: max((c for c in cands if c.overrides.get("kv_dtype") == kv),
                    key=lambda c: c.est_tokens_per_s_per_gpu) for kv in ("bf16", "fp8")}
    assert best["fp8"].est_tokens_per_s_per_gpu > 1.1 * best["bf16"].est_tokens_per_s_per_gpu


def test_decode_attention_tp_reaches_the_budget_search_plans():
    """``space.decode_tp`` in the budget search: the candidate's overrides carry ``decode.tp`` and its TPOT is
    priced with that plan (TP2 ranks: half as many DP ranks, each with its attention split two ways)."""
    spec = make_spec({"decode_tp": [1, 2], "prefill_tp": [2], "max_batch_per_rank": [16],
                      "topology": ["hgx-h200*2"]}, workload=DECODE_BOUND)
    model, topos, load = parts(spec)
    cands = [c for c in bu.disaggregated_candidates(spec, load, model, topos["hgx-h200*2"], 16) if c.overrides]
    by_tp = {}
    for c in cands:
        by_tp.setdefault(c.overrides.get("decode.tp", 1), []).append(c)
    assert set(by_tp) == {1, 2}
    assert all("TP2/DP-EP8" in c.label for c in by_tp[2])
    d1, d2 = sorted((o for o in se.decode_options(spec, load, model, topos)), key=lambda o: o.tp)
    base = se.base_scenario(spec)
    f1, f2 = (bu._decode_tpot_fn(spec, base, model, topos["hgx-h200*2"], o) for o in (d1, d2))
    assert f2(8) != pytest.approx(f1(8))
    # the budget search's TPOT(b) is the decode option's own pricing (which has always used decode.tp)
    assert f2(d2.b_max) == pytest.approx(d2.tpot_at_cap_s) and f1(d1.b_max) == pytest.approx(d1.tpot_at_cap_s)
    # a decoder of TP2 ranks holds ep / 2 ranks' batches: its rate is sized on those, not on ep
    assert d2.ranks == 4
    for c in by_tp[2]:
        assert c.rate_per_s <= c.overrides["decode.replicas"] * d2.ranks * d2.b_max / (1000 * d2.tpot_at_cap_s) + 1e-9


def test_batch_cap_grid_in_a_spec():
    assert make_spec({"max_batch_per_rank": {"lo": 8, "hi": 24, "step": 4}}).space.max_batch_per_rank == \
        (8, 12, 16, 20, 24)
    assert make_spec({"max_batch_per_rank": {"lo": 8, "hi": 64, "factor": 1.25}}).space.max_batch_per_rank == \
        (8, 10, 12, 15, 19, 24, 30, 38, 48, 60, 64)
    assert make_spec().space.max_batch_per_rank == (64,)
    assert se.SearchSpace().max_batch_per_rank == (8, 16, 32, 64, 128)  # the default list is unchanged
    for bad, msg in (({"lo": 8, "hi": 4, "step": 2}, "1 <= lo <= hi"), ({"lo": 8, "hi": 64}, "got keys hi, lo"),
                     ({"lo": 8, "hi": 64, "step": 0}, "step must be"), ({"lo": 8, "hi": 64, "factor": 1}, "factor"),
                     ({"lo": 8, "hi": 64, "step": 4, "factor": 2}, "{lo, hi, step}")):
        with pytest.raises(UserError, match="max_batch_per_rank") as e:
            make_spec({"max_batch_per_rank": bad})
        assert msg in str(e.value) and "\n" not in str(e.value)


@settings(max_examples=200, deadline=None)
@given(lo=st.integers(1, 300), span=st.integers(0, 500), step=st.integers(1, 50),
       factor=st.floats(1.01, 4.0), geometric=st.booleans())
def test_batch_grid_is_increasing_from_lo_to_hi(lo, span, step, factor, geometric):
    hi = lo + span
    caps = se.batch_grid({"lo": lo, "hi": hi, **({"factor": factor} if geometric else {"step": step})})
    assert caps[0] == lo and caps[-1] == hi
    assert all(a < b for a, b in zip(caps, caps[1:]))
    if not geometric:
        assert all(b - a == step for a, b in zip(caps[:-2], caps[1:-1]))
        assert 0 < caps[-1] - caps[-2] <= step if len(caps) > 1 else True
    else:  # each cap the one before it times the factor, rounded, at least one more (but the last, hi)
        assert all(b == max(a + 1, round(a * factor)) for a, b in zip(caps[:-1], caps[1:-1]))


@pytest.mark.parametrize("argv, flag", [
    (["--batch-cap", "8:4:2"], "--batch-cap 8:4:2"),
    (["--batch-cap", "8:64:x0.9"], "--batch-cap 8:64:x0.9"),
    (["--batch-cap", "8:64:0"], "--batch-cap 8:64:0"),
    (["--kv-dtype", "fp4"], "--kv-dtype fp4"),
    (["--decode-tp", "0"], "--decode-tp 0"),
])
def test_bad_space_flags_one_line_exit_2(argv, flag, capsys):
    from rackbed.engine.cli.main import main

    assert main(["search", "--gpus", "8", "--topology", "hgx-h200", *argv, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err, err


def test_space_flags_reach_the_spec():
    import argparse

    from rackbed.engine.cli import search as cs

    p = argparse.ArgumentParser()
    cs.register(p.add_subparsers(dest="command"))
    args = p.parse_args(["search", "--gpus", "8", "--topology", "hgx-h200", "--batch-cap", "8:20:4",
                         "--kv-dtype", "bf16,fp8", "--decode-tp", "1,2"])
    assert cs.check_flags(args) == "budget"
    spec = cs._flags_spec(args, 1.0, 1)
    assert spec.space.max_batch_per_rank == (8, 12, 16, 20)
    assert spec.space.kv_dtype == ("bf16", "fp8") and spec.space.decode_tp == (1, 2)
    with pytest.raises(SystemExit):
        p.parse_args(["search", "--batch-cap", "8:x"])
    # --wide: the KV format, a geometric cap grid and TP2 decoder ranks where those flags are not given
    args = p.parse_args(["search", "--gpus", "8", "--topology", "hgx-h200", "--wide", "--decode-tp", "1"])
    cs.check_flags(args)
    spec = cs._flags_spec(args, 1.0, 1)
    assert spec.space.kv_dtype == ("bf16", "fp8") and spec.space.decode_tp == (1,)
    assert spec.space.max_batch_per_rank == se.batch_grid({"lo": 8, "hi": 256, "factor": 1.25})


def test_a_rate_search_simulates_both_kv_formats_and_reports_the_axis(tmp_path, capsys):
    """``--kv-dtype bf16,fp8`` in a ``--rate`` search: the simulated points run the KV format of their candidate
    (through the sweep's overrides into the scenario) and the report's per-knob table has a ``kv_dtype`` row per
    format."""
    import json

    from rackbed.engine.cli.main import main

    out = tmp_path / "s"
    assert main(["search", "--model", "qwen3-30b-a3b", "--topology", "hgx-h200", "--rate", "4", "--isl", "1000",
                 "--osl", "30", "--duration", "3", "--decode-ep", "4", "--batch-cap", "16", "--prefill-tp", "2",
                 "--kv-dtype", "bf16,fp8", "--max-simulations", "2", "--jobs", "1", "--no-progress",
                 "--out", str(out)]) == 0
    capsys.readouterr()
    recs = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    by_kv = {r["overrides"]["kv_dtype"]: r["summary"] for r in recs}
    assert sorted(by_kv) == ["bf16", "fp8"]
    # the same deployment with half the KV bytes read per step decodes faster per user
    assert by_kv["fp8"]["tokens_per_s_per_user"] > by_kv["bf16"]["tokens_per_s_per_user"]
    report = (out / "report.md").read_text()
    assert "| kv_dtype | bf16 |" in report and "| kv_dtype | fp8 |" in report
