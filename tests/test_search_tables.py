"""The search's tables at any terminal width (engine.cli.tables): rendered on an 80-column rich Console no cell is
cut with an ellipsis, no line is wider than the console and the key numbers and configurations appear whole; a
wide console keeps the ordinary table."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from rackbed.engine.cli.tables import block_lines, print_table, table_widths
from rackbed.sim import budget as bu
from rackbed.sim import search as se
from rackbed.sim.report import fmt

HEADERS = ("#", "configuration", "GPUs", "tok/s/GPU", "tok/s/user", "TTFT p90 ms", "TPOT p90 ms", "$/M tok",
           "est tok/s/GPU", "est tok/s/user", "pruned")
ROWS = [[str(i), f"gb200-nvl72 mxfp8 P{i}xTP4/EP4 D2xEP16 b<=64 k=1", "72", "1.109e+04", "289.3", "18.37",
         "3.518", "-", "30.79", "302.6", "" if i % 2 else "decode group of 32 GPUs exceeds the topology's 16 GPUs"]
        for i in range(1, 6)]


def render(width: int, fn, *args, **kw) -> str:
    buf = io.StringIO()
    fn(Console(width=width, file=buf, color_system=None, force_terminal=False), *args, **kw)
    return buf.getvalue()


def assert_whole(out: str, width: int, values) -> None:
    assert "…" not in out
    assert all(len(line) <= width for line in out.splitlines()), max(out.splitlines(), key=len)
    for v in values:
        assert re.search(rf"(?<![\w.+-]){re.escape(v)}(?![\w.+-])", out), (v, out)


@pytest.mark.parametrize("width", [60, 80, 100, 120, 160, 240])
def test_every_value_is_whole_at_any_width(width):
    out = render(width, print_table, "best points", HEADERS, ROWS, text=("pruned",), left=("configuration",), key=2)
    values = {c for r in ROWS for h, c in zip(HEADERS, r) if c and h not in ("pruned", "#", "$/M tok")}
    assert_whole(out, width, values)
    reason = ROWS[1][-1]
    assert all(w in out for w in reason.split(" "))  # prose may wrap, at spaces only
    layout = table_widths(list(HEADERS), ROWS, width, ("pruned",))
    assert ("┃" in out) == (layout is not False)  # a table while one fits, else one block per row
    if layout is False:
        assert out.count("#1 ") == 1 and "GPUs: 72" in out and "$/M tok" not in out  # a "-" value is left out


def test_natural_widths_keep_rich_s_own_table():
    assert table_widths(["a", "bb"], [["1", "22"]], 80) is None
    assert table_widths(["tok/s/GPU", "note"], [["1.109e+04", "a long note " * 5]], 40, ("note",)) == [9, 40 - 7 - 9]  # frame: 3 a column + 1
    lines = block_lines(["knob", "value", "note"], [["decode.ep", "8", "x " * 40]], 30, key=2, bare=("knob",))
    assert lines[0] == "decode.ep  value 8" and all(len(x) <= 30 for x in lines)


def test_a_search_s_tables_at_80_columns(tmp_path):
    """A real search's printout on an 80-column console: the best points' configurations and numbers whole."""
    from rackbed.engine.cli.search import print_search

    spec = se.spec_from_flags(model="qwen3-30b-a3b", topology=["hgx-h200"], weight_format=["fp8"], rate_per_s=4,
                              prompt_tokens=1000, output_tokens=30, duration_s=3, ttft_s=2, tpot_s=0.05,
                              prefill_tp=[2, 4], decode_ep=[4, 8], max_batch_per_rank=[16], max_simulations=2,
                              gpu_hour_usd=6.0)
    res = se.run_search(spec, tmp_path, jobs=1, progress=False)
    assert res.best
    out = render(80, print_search, res)
    keys = [r["candidate"] for r in res.best]
    for r in res.best:
        s = r["summary"]
        keys += [fmt(s["tokens_per_s_per_gpu"]), fmt(s["tokens_per_s_per_user"]), fmt(s["cost_per_mtok_usd"], 3)]
    assert_whole(out, 80, keys)
    assert "tok/s/GPU: " + fmt(res.best[0]["summary"]["tokens_per_s_per_gpu"]) in out


def test_a_budget_search_s_fronts_at_80_columns(tmp_path):
    from rackbed.engine.cli.search import print_budget

    spec = se.spec_from_flags(model="qwen3-30b-a3b", topology=["hgx-h200"], weight_format=["fp8"], rate_per_s=1.0,
                              prompt_tokens=1000, output_tokens=40, duration_s=4, ttft_s=2, tpot_s=0.05,
                              prefill_tp=[2], decode_ep=[4], max_batch_per_rank=[64], name="t")
    res = bu.run_budget_search(spec, 8, tmp_path, kinds=("disaggregated",), per_front=1, max_simulations=1,
                               progress=False)
    front = res.fronts["disaggregated"]
    assert front
    out = render(80, print_budget, res)
    keys = [p["candidate"] for p in front]
    for p in front:
        keys += [fmt(p["summary"]["tokens_per_s_per_gpu"]), fmt(p["use"]["tokens_per_s_per_budget_gpu"]),
                 str(p["gpus"])]
    assert_whole(out, 80, keys)
    assert f"GPUs: {front[0]['gpus']}" in out
