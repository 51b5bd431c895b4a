"""Random weights whose MTP drafts are accepted at a chosen rate (``engine.real.agreeing``,
``real.mtp_agree``) on a tiny DeepSeek-V3 model with an MTP module: the two next-token maps are permutations
that agree exactly on the chosen tokens; a speculative greedy run accepts drafts at the chosen rate (each
step's accepted count is the one the agreement mask predicts) while its tokens stay plain greedy decoding of
the target; the reshaped tensors keep their shapes and dtypes; bad settings are refused."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from greedy_ref import greedy, page_table
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_families import TINY

from rackbed.engine.real.agreeing import permutations
from rackbed.engine.real.comm import Comm
from rackbed.engine.real.config import TorchModelConfig
from rackbed.engine.real.families import ShardedMoeLM
from rackbed.engine.real.model import Shard
from rackbed.engine.real.mtp import draft_room, mtp_step

SEED = 5
PAGE = 16
#: TINY's DeepSeek-V3 at hidden 128 and a 1024-token vocabulary: the logit peaks stand sqrt(D / 2) = 8
#: standard deviations above the rest (at hidden 64 a few percent of tokens would miss)
WIDE = {"hidden_size": 128, "vocab_size": 1024}


@dataclass
class _Seq:     # what mtp_step reads and updates of the worker's sequence
    pages: list
    length: int
    last_token: int
    tokens: list = field(default_factory=list)
    mtp_h: object = None
    mtp_next: list = field(default_factory=list)


@pytest.fixture(scope="module")
def cfg():
    return TorchModelConfig.from_hf({"model_type": "deepseek_v3", **TINY["deepseek_v3"], **WIDE,
                                     "num_nextn_predict_layers": 1})


_table = page_table


@settings(max_examples=40, deadline=None)
@given(vocab=st.integers(2, 300), p=st.floats(0.0, 1.0), seed=st.integers(0, 10_000))
def test_the_maps_are_permutations_that_agree_exactly_on_the_chosen_tokens(vocab, p, seed):
    pi, rho, agree = permutations(vocab, p, seed)
    assert sorted(pi.tolist()) == list(range(vocab)) and sorted(rho.tolist()) == list(range(vocab))
    assert torch.equal(agree, rho == pi)
    want = round(p * vocab)
    assert int(agree.sum()) == (vocab if vocab - want == 1 else want)   # one odd token out cannot disagree
    t, seen = 0, set()                                                   # pi is one cycle through every token
    while t not in seen:
        seen.add(t)
        t = int(pi[t])
    assert len(seen) == vocab
    again = permutations(vocab, p, seed)
    assert all(torch.equal(a, b) for a, b in zip((pi, rho, agree), again))


def _greedy(model, prompts, n):
    return greedy(model, prompts, n, page=PAGE, n_pages=256)


@torch.inference_mode()
def _speculative(model, prompts, steps, k):
    """``steps`` speculative steps of k drafts -> (tokens, [(last token, drafts verified, accepted)])."""
    cache = model.new_cache(256, PAGE)
    pts = [cache.alloc(len(p)) for p in prompts]
    first = model.forward_prefill(prompts, cache, pts).argmax(-1).tolist()
    seqs = [_Seq(pt, len(p), t) for pt, p, t in zip(pts, prompts, first)]
    out, log = [[t] for t in first], []
    for _ in range(steps):
        rooms = draft_room(cache, seqs, k)
        last = [s.last_token for s in seqs]
        for o, e, r, t in zip(out, mtp_step(model, cache, seqs, rooms, k), rooms, last):
            o += e
            log.append((t, r, len(e) - 1))
    return out, log


@pytest.mark.parametrize("p,k,steps", [(0.0, 2, 14), (0.5, 2, 14), (0.9, 3, 10)])
def test_drafts_are_accepted_at_the_chosen_rate_and_tokens_stay_greedy(cfg, p, k, steps):
    """Eight sequences, 10-14 steps: the accepted drafts over the drafts verified (each accepted, or the
    first rejected one) is p within 0.1 (2.5 to 5 standard deviations of the 100-300 draws); each step
    accepts what the mask predicts from the token it starts at (the draft after u is accepted iff u agrees);
    the target's tokens follow pi and are plain greedy decoding of the target (built without the module, same
    seed and p)."""
    plain = ShardedMoeLM.random(cfg, Shard(), Comm(), seed=SEED, mtp_agree=p)
    spec = ShardedMoeLM.random(cfg, Shard(), Comm(), seed=SEED, mtp=True, mtp_agree=p)
    pi, _, agree = permutations(cfg.vocab, p, SEED)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab, (n,), generator=g) for n in (5, 9, 3, 12, 1, 7, 4, 10)]
    got, log = _speculative(spec, prompts, steps, k)
    n = min(len(o) for o in got)
    assert [o[:n] for o in got] == _greedy(plain, prompts, n)
    follows = [int(pi[a]) == b for o, q in zip(got, prompts) for a, b in zip([int(q[-1])] + o, o)]
    assert sum(follows) >= 0.97 * len(follows)
    verified = sum(a + (a < r) for _, r, a in log)
    rate = sum(a for _, _, a in log) / verified
    assert verified >= 100 and abs(rate - p) <= 0.1, (rate, verified)

    def predicted(t, r):
        a = 0
        while a < r and agree[t]:
            a, t = a + 1, int(pi[t])
        return a

    assert sum(predicted(t, r) == a for t, r, a in log) >= 0.95 * len(log)


def test_the_reshaped_tensors_keep_shapes_dtypes_and_the_layers_are_untouched(cfg):
    base = ShardedMoeLM.random(cfg, Shard(), Comm(), seed=SEED, mtp=True, dtype=torch.bfloat16)
    agr = ShardedMoeLM.random(cfg, Shard(), Comm(), seed=SEED, mtp=True, dtype=torch.bfloat16, mtp_agree=0.7)
    for k in ("embed", "lm_head", "final_norm"):
        assert agr.glob[k].shape == base.glob[k].shape and agr.glob[k].dtype == torch.bfloat16
    assert torch.equal(agr.glob["final_norm"], base.glob["final_norm"])
    for a, b in zip(agr.layers, base.layers):
        assert all(torch.equal(a[k], b[k]) for k in b)
    assert all(torch.equal(agr.mtp[k], base.mtp[k]) for k in base.mtp if k != "eh_proj")
    assert agr.mtp["eh_proj"].shape == base.mtp["eh_proj"].shape
    lm = agr.glob["lm_head"].float()
    assert abs(lm.std().item() - cfg.init_std) < 0.2 * cfg.init_std       # the head keeps init_std's scale
    assert (lm != 0).float().mean() > 0.99 and (agr.glob["embed"] != 0).float().mean() > 0.99


def test_bad_settings_are_refused():
    glm_tied = TorchModelConfig.from_hf({"model_type": "glm4_moe", **TINY["glm4_moe"],
                                         "num_nextn_predict_layers": 1, "tie_word_embeddings": True})
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        ShardedMoeLM.random(glm_tied, Shard(), Comm(), mtp=True, mtp_agree=0.5)
    oss = TorchModelConfig.from_hf({"model_type": "gpt_oss", **TINY["gpt_oss"]})
    with pytest.raises(ValueError, match="no MTP module"):
        ShardedMoeLM.random(oss, Shard(), Comm(), mtp_agree=0.5)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        permutations(10, 1.5, 0)


def test_the_shipped_mtp_scenarios_ask_for_the_rate_they_tell_the_simulator():
    """scenarios/real/h200-agg-mtp(-heldout).yaml: DeepSeek-V3 width with its MTP module, draft_k 2, random
    weights agreeing at the geometric acceptance the simulator assumes; every rank spec carries the
    agreement."""
    from rackbed.engine.real.rank_setup import rank_specs, real_model_config
    from rackbed.sim.scenario import build, load_scenario

    seen = set()
    for name in ("h200-agg-mtp", "h200-agg-mtp-heldout"):
        sc = load_scenario(f"scenarios/real/{name}.yaml")
        assert sc.model == "deepseek-v3" and sc.mtp.draft_k == 2 and sc.real.weights is None
        assert sc.real.mtp_agree == sc.mtp.accept_p and sc.mtp.acceptance is None
        seen.add((sc.real.weights_seed, sc.real.mtp_agree, sc.workload.seed))
        b = build(sc)
        c = real_model_config(b)
        assert c.runs_mtp and c.hidden == 7168 and not c.tie_embeddings
        specs = rank_specs(b, c, {0: 0}, 1, use_cuda=False, dtype="bf16", seed=sc.real.weights_seed,
                           weights=None, prefill_pages=64, decode_pages=64, mtp_agree=sc.real.mtp_agree)
        assert [(s.draft_k, s.mtp_agree) for s in specs.values()] == [(2, sc.real.mtp_agree)]
    assert len(seen) == 2 and len({s[1] for s in seen}) == 2       # held out: other seeds and acceptance


def test_rackbed_real_refuses_agreement_it_cannot_build(tmp_path, capsys):
    """real.mtp_agree on a model without an MTP module the engine runs, with a checkpoint, or out of [0, 1]:
    exit 2 and one line naming the field (before any rank starts)."""
    import yaml

    from rackbed.engine.cli.main import main
    from rackbed.engine.real.rank_setup import check_mtp_agree
    from rackbed.topology.errors import UserError

    base = {"name": "agree", "topology": "hgx-h200", "model": "qwen3-30b-a3b", "weight_format": "bf16",
            "prefill": {"tp": 1, "ep": 1, "replicas": 1}, "decode": {"ep": 1, "replicas": 1},
            "mtp": {"draft_k": 0},
            "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 1},
                         "prompt": {"kind": "uniform", "lo": 5, "hi": 6},
                         "output": {"kind": "uniform", "lo": 2, "hi": 3}, "n_requests": 1, "seed": 1}}
    for i, real in enumerate(({"device": "cpu", "mtp_agree": 0.5}, {"device": "cpu", "mtp_agree": 1.5})):
        f = tmp_path / f"s{i}.yaml"
        f.write_text(yaml.safe_dump({**base, "real": real}))
        assert main(["real", str(f), "--out", str(tmp_path / f"o{i}")]) == 2
        err = capsys.readouterr().err.strip()
        assert "mtp_agree" in err and "\n" not in err, err
    cfg = TorchModelConfig.from_hf({"model_type": "deepseek_v3", **TINY["deepseek_v3"],
                                    "num_nextn_predict_layers": 1})
    check_mtp_agree(cfg, 0.5, None)
    check_mtp_agree(cfg, None, "/ckpt")
    with pytest.raises(UserError, match="real.mtp_agree: 0.5 .*real.weights"):
        check_mtp_agree(cfg, 0.5, "/ckpt")


@pytest.mark.slow
def test_a_real_run_with_agreeing_weights_accepts_drafts_and_emits_greedy_tokens(tmp_path, cfg):
    """``run_real`` (one aggregated CPU worker, draft_k 2, real.mtp_agree 0.9): every request gets the
    agreeing target's plain greedy tokens, and the steps accept about what p = 0.9 gives (p + p^2 = 1.71
    drafts a step with drafts; more than 1.3 is asked, against ~0 for plain random weights)."""
    import json

    from rackbed.engine.core.workload import generate
    from rackbed.engine.real.driver import run_real
    from rackbed.sim.driver import simulate
    from rackbed.sim.scenario import build, parse_scenario

    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", **TINY["deepseek_v3"], **WIDE,
                                               "num_nextn_predict_layers": 1,
                                               "architectures": ["DeepseekV3ForCausalLM"]}))
    sc = parse_scenario({
        "name": "cpu-real-mtp-agree", "topology": "hgx-h200", "model": str(d / "config.json"),
        "weight_format": "bf16", "deployment": "aggregated",
        "aggregated": {"workers": 1, "tp": 1, "dp": 1, "ep": 1, "max_batch_per_rank": 4,
                       "max_batch_tokens": 64, "chunk_tokens": None, "page_tokens": PAGE},
        "mtp": {"draft_k": 2, "accept_p": 0.9},
        "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 50},
                     "prompt": {"kind": "uniform", "lo": 3, "hi": 12},
                     "output": {"kind": "uniform", "lo": 24, "hi": 32}, "n_requests": 4, "seed": 1}})
    b = build(sc)
    reqs = generate(sc.workload, sc.seed)
    res, run = run_real(b, reqs, simulate=simulate, device="cpu", dtype="fp32", prefill_pages=64,
                        decode_pages=64, tiny_cfg=cfg, seed=SEED, mtp_agree=0.9)
    assert res.metrics["requests"]["done"] == len(reqs)
    plain = ShardedMoeLM.random(cfg, Shard(), Comm(), seed=SEED, mtp_agree=0.9)
    for r in reqs:
        ref = _greedy(plain, [torch.tensor(run.prompt_ids[r.id])], r.output_tokens)[0]
        assert run.generated[r.id] == ref
    per_req: dict[int, list[int]] = {}
    for rec in run.records:
        if rec[1] == "mixed" and len(rec) == 6:
            for rid, a in rec[5].items():
                per_req.setdefault(rid, []).append(a)
    drafted = [a for acc in per_req.values() for a in acc[1:]]     # a request's first step has no drafts
    assert drafted and sum(drafted) / len(drafted) > 1.3, per_req
