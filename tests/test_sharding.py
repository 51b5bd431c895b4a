"""ParallelPlan validation (one-line errors naming the constraint), memory budgets, plan files and the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rackbed import topology
from rackbed.engine.cli.main import main
from rackbed.engine.core.formats import get_format
from rackbed.engine.core.model import PRESET_NAMES, get_model
from rackbed.engine.core.sharding import (
    KV_DTYPE_BYTES,
    RUNTIME_OVERHEAD_BYTES,
    ParallelPlan,
    PlanFile,
    WeightParts,
    check_plan_file,
    load_plan_file,
    parse_gpus,
    tp_kv_head_shards,
)
from rackbed.topology.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
PLAN_FILES = sorted((ROOT / "scenarios" / "plans").glob("*.yaml"))
Q235 = get_model("qwen3-235b-a22b")
Q35 = get_model("qwen3.5-397b-a17b")


@pytest.fixture(scope="module")
def gb200():
    return topology.load("gb200-nvl72")


@pytest.fixture(scope="module")
def h200x2():
    return topology.load("hgx-h200*2")


def plan(**kw) -> ParallelPlan:
    kw.setdefault("role", "prefill")
    return ParallelPlan(**kw)


# ---------------------------------------------------------------------------------------------------------------
# validation: each violated constraint gives one line naming it
# ---------------------------------------------------------------------------------------------------------------


def one_line_error(p: ParallelPlan, model, topo) -> str:
    with pytest.raises(UserError) as ei:
        p.validate(model, topo)
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


def test_tp_beyond_kv_heads_needs_replication(gb200):
    msg = one_line_error(plan(tp=8, ep=8, gpus="0-7"), Q235, gb200)
    assert msg == "tp=8 exceeds 4 KV heads; set kv_replication=2 or tp<=4"
    b = plan(tp=8, ep=8, kv_replication=2, gpus="0-7").validate(Q235, gb200)
    assert b.kv_bytes_per_token_per_rank == 192_512 // 4  # one KV head per rank
    assert "kv_replication=4" in one_line_error(plan(tp=8, ep=8, kv_replication=4, gpus="0-7"), Q235, gb200)
    assert "needs no replication" in one_line_error(plan(tp=4, ep=4, kv_replication=2, gpus="0-3"), Q235, gb200)
    # Qwen3.5 has 2 KV heads: the write-up's TP=4 prefiller needs kv_replication=2
    assert "tp=4 exceeds 2 KV heads; set kv_replication=2" in one_line_error(
        plan(tp=4, ep=4, gpus="0-3", weight_format="mxfp8"), Q35, gb200)
    plan(tp=4, ep=4, kv_replication=2, gpus="0-3", weight_format="mxfp8").validate(Q35, gb200)


@pytest.mark.parametrize("kw, expected", [
    ({"tp": 1, "dp": 3, "ep": 3, "gpus": "0-2"}, "ep=3 does not divide 128 experts of qwen3-235b-a22b"),
    ({"tp": 1, "dp": 4, "ep": 3, "gpus": "0-3"}, "ep=3 does not divide the 4 GPUs"),
    ({"tp": 4, "ep": 4, "gpus": "0-2"}, "gpus lists 3 GPUs but tp*dp = 4*1 = 4"),
    ({"tp": 4, "ep": 4, "gpus": [0, 1, 1, 2]}, "GPU 1 is listed twice"),
    ({"tp": 4, "ep": 4, "gpus": "14-17"}, "rank 2 is on GPU 16, which does not exist"),
    ({"tp": 4, "ep": 4, "gpus": "6-9"}, "TP group 0 (GPUs 6-9) crosses an NVLink domain: GPU 8"),
    ({"tp": 3, "ep": 1, "gpus": "0-2"}, "tp=3 does not divide 64 query heads"),
    ({"tp": 2, "dp": 1, "ep": 1, "gpus": "0-1"}, "plan does not fit: needs"),
    ({"tp": 1, "dp": 4, "ep": 2, "gpus": [0, 8, 1, 9]}, "expert-TP group 0 (GPUs 0,8) crosses an NVLink domain"),
])
def test_each_constraint_named(h200x2, kw, expected):
    assert expected in one_line_error(plan(**kw), Q235, h200x2)


def test_memory_rejection_has_the_numbers():
    h200 = topology.load("hgx-h200")
    msg = one_line_error(plan(tp=2, ep=2, gpus="0-1"), Q235, h200)
    b = plan(tp=2, ep=2, gpus="0-1").memory_budget(Q235, h200)
    assert f"needs {b.needs_bytes / 1e9:.1f} GB/rank, GPU 0 has 141 GB" in msg
    assert not b.fits and b.kv_capacity_tokens == 0
    assert b.needs_bytes == b.weight_bytes + b.activation_reserve_bytes + 16384 * b.kv_bytes_per_token_per_rank


def test_linear_attention_heads_constrain_tp(gb200):
    # tp=32 passes the KV rule with replication 16 but not the 16 DeltaNet key heads
    msg = one_line_error(plan(tp=32, ep=32, kv_replication=16, gpus="0-31"), Q35, gb200)
    assert msg == "tp=32 does not divide 16 linear-attention key heads of qwen3.5-397b-a17b"


def test_pydantic_rejects_bad_fields():
    with pytest.raises(ValueError, match="unknown numeric format"):
        plan(tp=1, gpus=[0], weight_format="fp7")
    with pytest.raises(ValueError):
        plan(tp=0, gpus=[0])
    with pytest.raises(ValueError):
        plan(tp=1, gpus=[0], extra_field=1)
    with pytest.raises(ValueError, match="cannot parse GPU range"):
        plan(tp=1, gpus="0-a")
    assert parse_gpus("0-3,8-9,12") == [0, 1, 2, 3, 8, 9, 12]


def test_tp_kv_head_shards():
    assert tp_kv_head_shards(4, 2) == ((0, 1), (2, 3))
    assert tp_kv_head_shards(4, 8) == ((0,), (0,), (1,), (1,), (2,), (2,), (3,), (3,))
    with pytest.raises(UserError):
        tp_kv_head_shards(4, 3)


# ---------------------------------------------------------------------------------------------------------------
# memory budget: hand-computed and conservation properties
# ---------------------------------------------------------------------------------------------------------------


def test_budget_hand_computed_qwen3_235b_tp4_bf16(gb200):
    b = plan(tp=4, ep=4, gpus="0-3").memory_budget(Q235, gb200)
    h, L = 4096, 94
    q_o = 2 * h * 64 * 128  # q_proj + o_proj per layer
    kv = 2 * h * 4 * 128
    assert b.attention_weight_bytes == 2 * L * (q_o + kv) // 4
    assert b.expert_weight_bytes == 2 * L * 128 * 3 * h * 1536 // 4
    assert b.dense_weight_bytes == 0
    replicated = 2 * 151936 * h + (2 * h * L + h) + 2 * 128 * L + 128 * h * L  # emb+head, norms, qk norms, router
    assert b.replicated_weight_bytes == 2 * replicated
    assert b.kv_bytes_per_token_per_rank == 192_512 // 4
    assert b.hbm_bytes == 186_000_000_000
    free = b.hbm_bytes - b.weight_bytes - b.activation_reserve_bytes
    assert b.kv_capacity_tokens == free // b.kv_bytes_per_token_per_rank // 64 * 64
    assert b.fits


def test_decode_dp_rank_holds_all_kv_heads(gb200):
    b = plan(role="decode", tp=1, ep=16, dp=16, gpus="4-19").memory_budget(Q235, gb200)
    assert b.kv_bytes_per_token_per_rank == 192_512
    assert b.expert_weight_bytes == 2 * 94 * 8 * 3 * 4096 * 1536  # 128 / 16 = 8 experts per rank
    assert b.attention_weight_bytes == 2 * 94 * (2 * 4096 * 64 * 128 + 2 * 4096 * 4 * 128)  # unsharded
    fp8 = plan(role="decode", tp=1, ep=16, dp=16, gpus="4-19", kv_dtype="fp8").memory_budget(Q235, gb200)
    assert fp8.kv_bytes_per_token_per_rank == 192_512 // 2


def test_hybrid_state_per_sequence(gb200):
    p = plan(role="decode", tp=1, ep=16, dp=16, gpus="0-15")
    assert p.state_bytes_per_seq_per_rank(Q35) == Q35.linear_state_bytes_per_seq(2)
    assert p.state_bytes_per_seq_per_rank(Q235) == 0
    p4 = plan(tp=4, ep=4, kv_replication=2, gpus="0-3")
    assert p4.state_bytes_per_seq_per_rank(Q35) == Q35.linear_state_bytes_per_seq(2) // 4
    b = p.memory_budget(Q35, gb200)
    # MTP layer's KV included: 15 full layers + 1 MTP layer, 2 KV heads x 256 dims
    assert b.kv_bytes_per_token_per_rank == 16 * 2 * 2 * 256 * 2
    free = b.hbm_bytes - b.weight_bytes - b.activation_reserve_bytes - b.state_bytes_per_seq_per_rank * 64
    assert b.kv_capacity_tokens == free // b.kv_bytes_per_token_per_rank // 64 * 64


def test_activation_reserve_default_and_override(gb200):
    small = plan(tp=4, ep=4, gpus="0-3", max_batch_tokens=1024).memory_budget(Q235, gb200)
    big = plan(tp=4, ep=4, gpus="0-3", max_batch_tokens=32768).memory_budget(Q235, gb200)
    assert RUNTIME_OVERHEAD_BYTES < small.activation_reserve_bytes < big.activation_reserve_bytes
    # attention stage + MoE stage per token (bf16): 3h + q + 2kv + o per rank; 8 routed copies x (2h + 3I)
    per_tok = 2 * (3 * 4096 + 16 * 128 + 2 * 128 + 16 * 128) + 2 * 8 * (2 * 4096 + 3 * 1536)
    assert big.activation_reserve_bytes - small.activation_reserve_bytes == (32768 - 1024) * per_tok
    fixed = plan(tp=4, ep=4, gpus="0-3", activation_reserve_bytes=123).memory_budget(Q235, gb200)
    assert fixed.activation_reserve_bytes == 123


def test_mla_latent_replicated_under_tp_whole_under_dp(gb200):
    """DeepSeek-V3: 61 MLA layers + 1 MTP, latent 512 + rope 64, bf16: every TP rank holds the whole latent,
    and so does a DP decode rank; fp8 halves it."""
    ds = get_model("deepseek-v3")
    per_tok = 62 * 576 * 2
    pre = plan(tp=8, ep=8, gpus="0-7", weight_format="fp8_block").memory_budget(ds, gb200)
    dec = plan(role="decode", tp=1, ep=32, dp=32, gpus="8-39", weight_format="fp8_block").memory_budget(ds, gb200)
    assert pre.kv_bytes_per_token_per_rank == dec.kv_bytes_per_token_per_rank == per_tok == 71_424
    assert pre.window_bytes_per_seq_per_rank == dec.window_bytes_per_seq_per_rank == 0
    fp8 = plan(role="decode", tp=1, ep=32, dp=32, gpus="8-39", kv_dtype="fp8", weight_format="fp8_block")
    assert fp8.kv_bytes_per_token_per_rank(ds) == per_tok // 2


def test_sliding_window_is_a_per_sequence_cost(gb200):
    """gpt-oss-120b (18 full + 18 sliding layers, window 128, 8 KV heads x 64 dims): per token only the full
    layers; per sequence 18 layers x (128/64 + 1) pages of 64 tokens; the capacity subtracts the batch's windows."""
    m = get_model("gpt-oss-120b")
    p = plan(role="decode", tp=1, ep=4, dp=4, gpus="0-3", weight_format="mxfp4")
    b = p.memory_budget(m, gb200)
    per_tok_layer = 2 * 8 * 64 * 2
    assert b.kv_bytes_per_token_per_rank == 18 * per_tok_layer
    assert b.window_bytes_per_seq_per_rank == 18 * 3 * 64 * per_tok_layer
    free = b.hbm_bytes - b.weight_bytes - b.activation_reserve_bytes - 64 * b.window_bytes_per_seq_per_rank
    assert b.kv_capacity_tokens == free // b.kv_bytes_per_token_per_rank // 64 * 64
    assert b.needs_bytes == b.weight_bytes + b.activation_reserve_bytes + 128 * b.kv_bytes_per_token_per_rank \
        + 64 * b.window_bytes_per_seq_per_rank
    tp8 = plan(tp=8, ep=8, gpus="0-7", weight_format="mxfp4").memory_budget(m, gb200)  # one KV head per rank
    assert (tp8.kv_bytes_per_token_per_rank, tp8.window_bytes_per_seq_per_rank) == \
        (18 * per_tok_layer // 8, 18 * 3 * 64 * per_tok_layer // 8)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 300), st.integers(1, 128), st.integers(1, 5000))
def test_window_pages_bound_any_sequence(window, page, context):
    """``ceil(window / page) + 1`` pages per sliding layer hold any sequence's live window (the pages of its
    latest min(context, window) tokens) plus the page the next token is written to."""
    first, last = (context - min(context, window)) // page, (context - 1) // page
    live = last - first + 1 + (1 if context % page == 0 else 0)
    assert live <= -(-window // page) + 1


@st.composite
def valid_plans(draw):
    model = get_model(draw(st.sampled_from(PRESET_NAMES)))
    kvh = model.n_kv_heads
    tps = [t for t in (1, 2, 4, 8, 16) if model.n_q_heads % t == 0
           and ((t <= kvh and kvh % t == 0) or (t > kvh and t % kvh == 0))
           and (not model.n_linear_layers or (model.linear_n_k_heads % t == 0 and model.linear_n_v_heads % t == 0))]
    tp = draw(st.sampled_from(tps))
    dp = draw(st.sampled_from([1, 2, 4, 8]))
    world = tp * dp
    eps = [e for e in range(1, world + 1) if world % e == 0 and model.n_experts % e == 0
           and model.moe_intermediate % (world // e) == 0]
    ep = draw(st.sampled_from(eps))
    fmt = draw(st.sampled_from(["bf16", "fp8", "fp8_block", "mxfp8", "mxfp4", "nvfp4"]))
    p = ParallelPlan(role=draw(st.sampled_from(["prefill", "decode"])), tp=tp, ep=ep, dp=dp,
                     kv_replication=max(tp // kvh, 1), gpus=list(range(world)), weight_format=fmt,
                     kv_dtype=draw(st.sampled_from(["bf16", "fp8"])), page_tokens=draw(st.sampled_from([16, 64])))
    return model, p


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_plans())
def test_budget_conserves_model_bytes(mp):
    """Shards add back up to the model: experts x world, tp-split parts x tp, KV x tp / replication; a 1-GPU plan
    holds exactly ModelSpec.weight_bytes(fmt, include_mtp=True)."""
    model, p = mp
    b = p.memory_budget(model, hbm_bytes=10**15)
    parts = WeightParts.of(model)
    bpe = get_format(p.weight_format).bytes_per_element("weight")
    assert abs(b.expert_weight_bytes * p.world - parts.experts * bpe) <= p.world
    assert abs(b.dense_weight_bytes * p.tp - parts.tp_dense * bpe) <= p.tp
    attn_total = (parts.attn_split + parts.kv_proj * p.kv_replication + parts.linear_attn) * bpe
    assert abs(b.attention_weight_bytes * p.tp - attn_total) <= p.tp
    # KV split by heads adds back up to the model's KV x kv_replication; a latent (MLA) is whole on every rank;
    # sliding-window layers are a per-sequence cost of ceil(window / page) + 1 pages
    eb = KV_DTYPE_BYTES[p.kv_dtype]
    copies = lambda a: p.tp if a.kv_tp_sharding == "replicated" else p.kv_replication
    held = sum(n * a.kv_bytes_per_token(eb) * copies(a)
               for a, n in model.attention_counts(include_mtp=True) if a.kind != "sliding")
    assert b.kv_bytes_per_token_per_rank * p.tp == held
    window = sum((-(-a.window // p.page_tokens) + 1) * p.page_tokens * n * a.kv_bytes_per_token(eb) * copies(a)
                 for a, n in model.attention_counts(include_mtp=True) if a.kind == "sliding")
    assert b.window_bytes_per_seq_per_rank * p.tp == window
    one = p.model_copy(update={"tp": 1, "ep": 1, "dp": 1, "kv_replication": 1, "gpus": (0,)})
    assert abs(one.memory_budget(model, hbm_bytes=10**15).weight_bytes - model.weight_bytes(
        p.weight_format, include_mtp=True)) <= 4
    assert b.kv_capacity_tokens % p.page_tokens == 0
    assert b.kv_capacity_tokens * b.kv_bytes_per_token_per_rank <= 10**15 - b.weight_bytes \
        - b.activation_reserve_bytes - (b.state_bytes_per_seq_per_rank + b.window_bytes_per_seq_per_rank) * p.batch_seqs
    # fits <=> validate accepts the plan (given a GPU of exactly that size)
    tight = ParallelPlan.model_validate({**p.model_dump(), "min_kv_tokens": 0})
    need = tight.memory_budget(model, hbm_bytes=10**15).needs_bytes
    assert tight.memory_budget(model, hbm_bytes=need).fits
    assert not tight.memory_budget(model, hbm_bytes=need - 1).fits


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(valid_plans(), st.sampled_from([2, 4]))
def test_sharding_wider_never_needs_more_weight_memory(mp, factor):
    model, p = mp
    wider_ep = [e for e in range(p.ep + 1, p.world + 1) if p.world % e == 0 and model.n_experts % e == 0]
    b = p.memory_budget(model, hbm_bytes=10**15)
    for e in wider_ep:
        w = p.model_copy(update={"ep": e}).memory_budget(model, hbm_bytes=10**15)
        assert w.expert_weight_bytes <= b.expert_weight_bytes + 1  # same world: split is the same total
    more_dp = p.model_copy(update={"dp": p.dp * factor, "ep": p.ep * factor,
                                   "gpus": tuple(range(p.world * factor))})
    if model.n_experts % more_dp.ep == 0:
        assert more_dp.memory_budget(model, hbm_bytes=10**15).expert_weight_bytes <= b.expert_weight_bytes


# ---------------------------------------------------------------------------------------------------------------
# plan files and CLI
# ---------------------------------------------------------------------------------------------------------------


def test_example_plan_files_validate():
    assert len(PLAN_FILES) >= 2
    for f in PLAN_FILES:
        pf, budgets = check_plan_file(f)
        assert [b.role for b in budgets] == [p.role for p in pf.plans()]
        assert all(b.fits for b in budgets)


def write(tmp_path, data, name="plan.yaml") -> Path:
    f = tmp_path / name
    f.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return f


BASE = {"topology": "hgx-h200", "model": "qwen3-235b-a22b"}


@pytest.mark.parametrize("data, expected", [
    ({**BASE, "prefill": {"tp": 8, "ep": 8, "gpus": "0-7"}},
     "prefill: tp=8 exceeds 4 KV heads; set kv_replication=2 or tp<=4"),
    ({**BASE, "prefill": {"tp": 2, "ep": 2, "gpus": "0-1"}}, "prefill: plan does not fit: needs 24"),
    ({**BASE, "prefill": {"tp": 4, "ep": 4, "gpus": "0-3"}, "decode": {"tp": 1, "ep": 4, "dp": 4, "gpus": "2-5"}},
     "prefill and decode share GPUs 2-3"),
    ({**BASE, "prefill": {"tp": 4, "ep": 4, "gpus": "0-3", "role": "decode"}}, "prefill.role is 'decode'"),
    ({**BASE, "prefill": {"tp": 4, "ep": 4, "gpus": "0-3", "tpp": 1}}, "prefill.tpp: unknown key"),
    ({**BASE}, "needs a prefill or a decode section"),
    ("topology: [1\n", "invalid YAML"),
    ({**BASE, "model": "qwen9", "decode": {"gpus": [0]}}, "unknown model 'qwen9'"),
    ({**BASE, "topology": "nope.yaml", "decode": {"gpus": [0]}}, "nope.yaml"),
    ({**BASE, "topology": "gb300", "decode": {"gpus": [0]}}, "gb300"),
])
def test_cli_check_one_line_errors(tmp_path, capsys, data, expected):
    f = write(tmp_path, data)
    rc = main(["plan", "check", str(f)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith(f"rackbed: error: {f}: "), err
    assert expected in err and err.count("\n") == 1 and "Traceback" not in err


def test_cli_check_ok_and_show(capsys):
    f = ROOT / "scenarios" / "plans" / "gb200-tp4-prefill-ep16-decode.yaml"
    assert main(["plan", "check", str(f)]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "tp4 ep4 dp1" in out and "tp1 ep16 dp16" in out
    assert main(["plan", "show", str(f), "--formats", "bf16,mxfp8", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert out.count("| prefill |") == 2 and out.count("| decode |") == 2
    assert main(["plan", "show", "--model", "qwen3-235b-a22b", "--topology", "hgx-h200", "--tp", "2",
                 "--ep", "2", "--markdown"]) == 0
    assert "| NO |" in capsys.readouterr().out  # show tabulates plans that do not fit
    assert main(["plan", "show", "--model", "qwen3-235b-a22b", "--topology", "hgx-h200", "--tp", "8"]) == 2
    assert "tp=8 exceeds 4 KV heads" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_show_kv_transfer(tmp_path, capsys):
    f = write(tmp_path, {"topology": "gb200-nvl72", "model": "qwen3-30b-a3b",
                         "prefill": {"tp": 4, "ep": 4, "gpus": "0-3"},
                         "decode": {"tp": 1, "ep": 4, "dp": 4, "gpus": "4-7"}})
    assert main(["plan", "show", str(f), "--markdown", "--kv-seq-len", "256"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith(("| HND", "| NHD"))}
    # 48 layers x K/V x 4 heads x 4 pages (HND) vs x 256 tokens (NHD)
    assert "| 1,536 |" in rows["HND"] and "| 98,304 |" in rows["NHD"]


def test_scenario_file_embeds_plan(tmp_path):
    f = write(tmp_path, {"name": "x", "workload": {"rate": 1},
                         "plan": {**BASE, "decode": {"tp": 1, "ep": 8, "dp": 8, "gpus": "0-7"}}})
    pf = load_plan_file(f)
    assert pf.decode.role == "decode" and pf.prefill is None
    assert isinstance(PlanFile.model_json_schema(), dict)


def test_cli_subprocess_no_traceback(tmp_path):
    f = write(tmp_path, {**BASE, "decode": {"tp": 1, "ep": 5, "dp": 5, "gpus": "0-4"}})
    r = subprocess.run([sys.executable, "-m", "rackbed.engine.cli.main", "plan", "check", str(f)], capture_output=True,
                       text=True, cwd=ROOT, check=False)
    assert r.returncode == 2
    assert r.stderr.strip() == (f"rackbed: error: {f}: decode: ep=5 does not divide 128 experts of qwen3-235b-a22b "
                                "(redundant_experts: 2 gives 130 = 5 x 26 expert slots)")


def test_sharding_md_table_is_generated(capsys, monkeypatch):
    """SHARDING.md's budget table is the output of the command it quotes (regenerate it when this fails)."""
    doc = (ROOT / "engine" / "core" / "SHARDING.md").read_text()
    cmd = "rackbed plan show scenarios/plans/gb200-tp4-prefill-ep16-decode.yaml --formats bf16,fp8,mxfp8 --markdown"
    assert cmd in doc
    monkeypatch.chdir(ROOT)
    block = doc.split("<!-- generated: budget table")[1].split("-->", 1)[1].split("<!-- end generated -->")[0]
    assert main(cmd.split()[1:]) == 0
    assert capsys.readouterr().out.strip() == block.strip()
