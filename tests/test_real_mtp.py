"""Speculative decoding with the MTP module in the real engine (``engine.real.mtp``) on a tiny DeepSeek-V3 model with
random weights: the tokens a request emits with k = 1, 2, 3 drafts equal plain greedy decoding of the target; a
draft made to agree has every draft accepted (k + 1 tokens a step); the static (CUDA-graph) forward of a verify
step equals the eager one; and a ``run_real`` run with draft_k = 2 finishes every request with its output's tokens
(plain greedy's), the scheduler counting exactly the tokens the ranks emitted, and its replay makes identical
decisions — also from a checkpoint whose drafts are always accepted (3 tokens a step)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from greedy_ref import greedy, page_table
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_families import TINY

from rackbed.engine.real.comm import Comm
from rackbed.engine.real.config import TorchModelConfig
from rackbed.engine.real.families import ShardedMoeLM
from rackbed.engine.real.model import Shard
from rackbed.engine.real.mtp import draft_room, mtp_step

SEED = 3
PAGE = 4


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
    c = TorchModelConfig.from_hf({"model_type": "deepseek_v3", **TINY["deepseek_v3"], "num_nextn_predict_layers": 1})
    assert c.mtp_layers == 1 and c.runs_mtp
    return c


@pytest.fixture(scope="module")
def models(cfg):
    """The target alone, and the target with its MTP module (same seed: the same target weights)."""
    return (ShardedMoeLM.random(cfg, Shard(), Comm(), seed=SEED),
            ShardedMoeLM.random(cfg, Shard(), Comm(), seed=SEED, mtp=True))


_table = page_table


def _greedy(model, prompts, n):
    return greedy(model, prompts, n, page=PAGE, n_pages=64)


@torch.inference_mode()
def _speculative(model, prompts, n, k, hook=None, n_pages=64):
    """Decode with k drafts a step until every sequence has n tokens; returns (tokens, tokens per step per seq)."""
    cache = model.new_cache(n_pages, PAGE)
    pts = [cache.alloc(len(p)) for p in prompts]
    first = model.forward_prefill(prompts, cache, pts).argmax(-1).tolist()
    seqs = [_Seq(pt, len(p), t) for pt, p, t in zip(pts, prompts, first)]
    out, per_step = [[t] for t in first], []
    while min(len(o) for o in out) < n:
        emitted = mtp_step(model, cache, seqs, draft_room(cache, seqs, k), k, draft_hook=hook)
        per_step.append([len(e) for e in emitted])
        for o, e, s, p in zip(out, emitted, seqs, prompts):
            o += e
            assert s.length == len(s.tokens) + len(p) and s.last_token == o[-1]
    return out, per_step


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=st.lists(st.integers(1, 10), min_size=1, max_size=2), k=st.integers(1, 3), seed=st.integers(0, 99))
def test_speculative_tokens_equal_plain_greedy(models, cfg, lens, k, seed):
    plain, spec = models
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, cfg.vocab, (n,), generator=g) for n in lens]
    n = 7
    ref = _greedy(plain, prompts, n)
    got, per_step = _speculative(spec, prompts, n, k)
    assert [o[:n] for o in got] == ref
    assert all(1 <= x <= k + 1 for step in per_step for x in step)
    assert all(x == 1 for x in per_step[0])      # a sequence's first step has no target hidden state: no drafts


@pytest.mark.parametrize("k", [1, 3])
def test_a_draft_that_agrees_is_always_accepted(models, cfg, k):
    """The draft replaced by the target's own greedy continuation: after the first step (no drafts yet), every
    step emits k + 1 tokens, and they are still plain greedy's."""
    plain, spec = models
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, cfg.vocab, (n,), generator=g) for n in (9, 4)]
    n = 1 + 1 + 3 * (k + 1)
    ref = _greedy(plain, prompts, n + k + 1)
    start = {len(p): i for i, p in enumerate(prompts)}
    prompt_len = [len(p) for p in prompts]

    def agree(s, j, _proposed):
        i = start[s.length - len(s.tokens)]
        return ref[i][s.length - prompt_len[i] + j]

    got, per_step = _speculative(spec, prompts, n, k, hook=agree)
    assert per_step[0] == [1, 1] and all(x == [k + 1, k + 1] for x in per_step[1:])
    assert [o for o in got] == [r[:len(o)] for r, o in zip(ref, got)]


def test_drafts_shrink_to_the_pages_left(models, cfg):
    """A cache without room for a sequence's k extra positions verifies as many drafts as its pages hold (down to
    none), and the tokens stay plain greedy's."""
    plain, spec = models
    cache = spec.new_cache(3, PAGE)                                    # 12 tokens
    s = _Seq(cache.alloc(9), 9, 0, mtp_h=torch.zeros(1, cfg.hidden))
    assert draft_room(cache, [s], 3) == [2] and len(s.pages) == 3      # positions 9, 10, 11
    s.length = 11
    assert draft_room(cache, [s], 3) == [0]
    assert draft_room(cache, [_Seq(s.pages, 5, 0)], 3) == [0]          # no target hidden state yet: no drafts
    prompts = [torch.arange(7) % cfg.vocab]
    ref = _greedy(plain, prompts, 5)
    got, _ = _speculative(spec, prompts, 5, 3, n_pages=3)               # rooms 0, 3, then what is left
    assert got[0][:5] == ref[0]


def test_static_verify_forward_equals_the_eager_one(models, cfg):
    """The CUDA-graph path's forward (``forward_decode_static``, here eager on CPU) of a verify step — k + 1 rows per
    sequence at consecutive positions — gives the eager forward's logits and hidden states."""
    _, spec = models
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, cfg.vocab, (n,), generator=g) for n in (6, 3)]
    outs = []
    for fwd in (spec.forward_decode, spec.forward_decode_static):
        cache = spec.new_cache(32, PAGE)
        pts = [cache.alloc(len(p) + 3) for p in prompts]
        with torch.inference_mode():
            spec.forward_prefill(prompts, cache, pts)
            rows = [0, 0, 0, 1, 1, 1]
            toks = torch.randint(0, cfg.vocab, (6,), generator=torch.Generator().manual_seed(4))
            pos = torch.tensor([6, 7, 8, 3, 4, 5])
            outs.append(fwd(toks, pos, cache, _table(pts)[rows], hidden=True))
    assert torch.allclose(outs[0][0], outs[1][0], atol=1e-5) and torch.allclose(outs[0][1], outs[1][1], atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("deployment", ["disaggregated", "aggregated"])
def test_real_run_with_two_drafts_finishes_every_request_and_replays(tmp_path, cfg, models, deployment):
    """``run_real`` (CPU ranks, gloo: a TP=2 prefiller and a decoder of two DP ranks sharing its experts — EP=2:
    every draft and verify forward exchanges tokens between them, with or without rows of their own — or two
    aggregated one-GPU workers whose mixed steps decode speculatively) with mtp.draft_k = 2: every request gets its
    output's tokens, plain greedy's; each decode step's replies counted 1 + accepted tokens per request and the
    scheduler finished each request at the step those completed its output; the replay, fed the recorded accepted
    counts, makes identical decisions."""
    import json

    from rackbed.engine.core.workload import generate
    from rackbed.engine.real.driver import replay, run_real
    from rackbed.sim.driver import simulate
    from rackbed.sim.scenario import build, parse_scenario

    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", **TINY["deepseek_v3"],
                                               "num_nextn_predict_layers": 1,
                                               "architectures": ["DeepseekV3ForCausalLM"]}))
    data = {
        "name": "cpu-real-mtp", "topology": "hgx-h200", "model": str(d / "config.json"), "weight_format": "bf16",
        "prefill": {"tp": 2, "ep": 2, "replicas": 1, "max_batch_tokens": 256},
        "decode": {"ep": 2, "replicas": 1, "max_batch_per_rank": 4, "page_tokens": PAGE},
        "mtp": {"draft_k": 2},
        "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 20},
                     "prompt": {"kind": "uniform", "lo": 5, "hi": 20}, "output": {"kind": "uniform", "lo": 2, "hi": 9},
                     "n_requests": 6, "seed": 1}}
    if deployment == "aggregated":
        data |= {"deployment": "aggregated",
                 "aggregated": {"workers": 2, "tp": 1, "dp": 1, "ep": 1, "max_batch_per_rank": 4,
                                "max_batch_tokens": 40, "chunk_tokens": None, "page_tokens": PAGE}}
    sc = parse_scenario(data)
    b = build(sc)
    reqs = generate(sc.workload, sc.seed)
    res, run = run_real(b, reqs, simulate=simulate, device="cpu", dtype="fp32", prefill_pages=256, decode_pages=256,
                        tiny_cfg=cfg, seed=SEED)
    assert run.draft_k == 2
    assert res.metrics["requests"]["done"] == len(reqs)
    plain, _ = models
    for r in reqs:
        assert len(run.generated[r.id]) == r.output_tokens
        ref = _greedy(plain, [torch.tensor(run.prompt_ids[r.id])], r.output_tokens)[0]
        assert run.generated[r.id] == ref, f"request {r.id}"
    steps = [rec for rec in run.records if rec[1] == ("mixed" if deployment == "aggregated" else "decode")]
    assert steps and all(len(rec) == 6 for rec in steps)
    if deployment == "aggregated":
        assert not res.log.of_kind("kv_transfer")
    emitted: dict[int, list[int]] = {}
    for rec in steps:
        for rid, a in rec[5].items():
            emitted.setdefault(rid, []).append(1 + a)
    # the scheduler finished each request at the step whose real tokens completed its output (the first token
    # comes from the prefill), not at a drawn step: it left the batch right after
    for r in reqs:
        e = emitted[r.id]
        assert sum(e[:-1]) < r.output_tokens - 1 <= sum(e), (r.id, e, r.output_tokens)
    rep = replay(b, reqs, run.records, simulate=simulate, seed=sc.seed, deaths=run.deaths)
    assert res.log.decisions() == rep.log.decisions()


def test_real_mode_refuses_drafts_for_a_model_without_an_mtp_module(tmp_path):
    """mtp.draft_k > 0 on a model whose family has no MTP module: one line naming the model and the field."""
    from rackbed.engine.real.rank_setup import real_model_config
    from rackbed.sim.scenario import build, parse_scenario
    from rackbed.topology.errors import UserError

    sc = parse_scenario({
        "name": "cpu-real-no-mtp", "topology": "hgx-h200", "model": "qwen3-30b-a3b", "weight_format": "bf16",
        "prefill": {"tp": 1, "ep": 1, "replicas": 1}, "decode": {"ep": 1, "replicas": 1},
        "mtp": {"draft_k": 2, "draft": {"kind": "mtp", "layers": 1}},
        "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 1},
                     "prompt": {"kind": "uniform", "lo": 5, "hi": 6}, "output": {"kind": "uniform", "lo": 2, "hi": 3},
                     "n_requests": 1, "seed": 1}})
    with pytest.raises(UserError, match=r"mtp\.draft_k: 2 .*qwen3-30b-a3b") as e:
        real_model_config(build(sc), n_layers=1)
    assert "\n" not in str(e.value)


def test_mtp_module_is_read_from_a_deepseek_checkpoint(tmp_path, cfg):
    """A DeepSeek-V3 state dict holds the MTP module as layer ``n_layers`` (a decoder layer plus enorm / hnorm /
    eh_proj / shared_head.norm): the engine loads it from there, and decoding with it gives plain greedy's tokens."""
    import transformers as tf
    from safetensors.torch import save_file

    from rackbed.engine.real.rank_setup import _has_mtp_weights

    torch.manual_seed(0)
    hf = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**{**TINY["deepseek_v3"], "num_hidden_layers": 4})).eval()
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    n, D = cfg.n_layers, cfg.hidden
    p = f"model.layers.{n}."
    state |= {p + "enorm.weight": 1 + 0.1 * torch.randn(D), p + "hnorm.weight": 1 + 0.1 * torch.randn(D),
              p + "eh_proj.weight": 0.1 * torch.randn(D, 2 * D), p + "shared_head.norm.weight": torch.ones(D)}
    spec = ShardedMoeLM.from_state_dict(state, cfg, Shard(), Comm(), mtp=True)
    plain = ShardedMoeLM.from_state_dict(state, cfg, Shard(), Comm())
    assert torch.equal(spec.mtp["eh_proj"], state[p + "eh_proj.weight"])
    assert torch.equal(spec.mtp["kv_a"], state[p + "self_attn.kv_a_proj_with_mqa.weight"])
    assert "head_norm" in spec.mtp and spec.n_kv_layers == n + 1 and spec.new_cache(4, PAGE).storage.shape[0] == n + 1
    prompts = [torch.tensor([3, 1, 4, 1, 5, 9]), torch.tensor([2, 7])]
    assert [o[:6] for o in _speculative(spec, prompts, 6, 2)[0]] == _greedy(plain, prompts, 6)
    save_file({p + "eh_proj.weight": state[p + "eh_proj.weight"]}, str(tmp_path / "a.safetensors"))
    assert _has_mtp_weights(tmp_path, n) and not _has_mtp_weights(tmp_path, n + 1)
    with pytest.raises(ValueError, match="no MTP module"):
        ShardedMoeLM.from_state_dict({k: v for k, v in state.items() if not k.startswith(p)}, cfg, Shard(), Comm(),
                                     mtp=True)


def test_glm_mtp_module_tokens_equal_plain_greedy():
    """GLM-4.5's MTP module (a full-attention GQA layer) drafts the same way: k = 2 gives plain greedy's tokens."""
    c = TorchModelConfig.from_hf({"model_type": "glm4_moe", **TINY["glm4_moe"], "num_nextn_predict_layers": 1})
    plain = ShardedMoeLM.random(c, Shard(), Comm(), seed=SEED)
    spec = ShardedMoeLM.random(c, Shard(), Comm(), seed=SEED, mtp=True)
    prompts = [torch.tensor([5, 6, 7, 8, 9, 10, 11]), torch.tensor([1, 2, 3])]
    assert [o[:6] for o in _speculative(spec, prompts, 6, 2)[0]] == _greedy(plain, prompts, 6)


def test_engine_calibration_replays_a_speculative_step_with_its_recorded_counts():
    """real.json keeps a speculative step's accepted counts (JSON keys are strings); the calibration's replay
    answers that step with them, as the run's completion did."""
    from rackbed.engine.core.plans import Accepted, DecodeStep
    from rackbed.sim.engine_calibration import _Replayed

    ex = _Replayed([{"worker": "D0", "kind": "decode", "key": 0, "measured_s": 0.25, "worker_s": 0.2,
                     "accepted": {"5": 2, "7": 0}},
                    {"worker": "D0", "kind": "decode", "key": 1, "measured_s": 0.5, "worker_s": 0.4}])
    step = DecodeStep("D0", 0, (2,), (10,), 2, (), ())
    assert ex.duration(step, 0.0) == Accepted(0.25, {5: 2, 7: 0})
    assert ex.duration(step._replace(step=1), 0.25) == 0.5


@pytest.mark.slow
def test_real_run_where_every_draft_is_accepted(tmp_path, cfg):
    """A checkpoint (with its MTP module, ``real.weights``) whose lm head is zero: every logit ties, the target's
    greedy token and the draft's are both token 0, so every draft is accepted. With draft_k = 2 each decode step
    after a request's first emits 3 tokens; the scheduler finishes each request at the step whose real tokens
    complete its output (fewer steps than tokens), the request keeps exactly its output's tokens, and the replay
    makes identical decisions."""
    import json

    import transformers as tf
    from safetensors.torch import save_file

    from rackbed.engine.core.workload import generate
    from rackbed.engine.real.driver import replay, run_real
    from rackbed.sim.driver import simulate
    from rackbed.sim.scenario import build, parse_scenario

    torch.manual_seed(0)
    hf = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**{**TINY["deepseek_v3"], "num_hidden_layers": 4})).eval()
    state = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}
    n, D = cfg.n_layers, cfg.hidden
    p = f"model.layers.{n}."
    state |= {p + "enorm.weight": torch.ones(D), p + "hnorm.weight": torch.ones(D),
              p + "eh_proj.weight": 0.1 * torch.randn(D, 2 * D)}
    state["lm_head.weight"] = torch.zeros_like(state["lm_head.weight"])
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file(state, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", **TINY["deepseek_v3"],
                                               "num_nextn_predict_layers": 1,
                                               "architectures": ["DeepseekV3ForCausalLM"]}))
    sc = parse_scenario({
        "name": "cpu-real-mtp-agree", "topology": "hgx-h200", "model": str(d / "config.json"), "weight_format": "bf16",
        "prefill": {"tp": 2, "ep": 2, "replicas": 1, "max_batch_tokens": 256},
        "decode": {"ep": 1, "replicas": 2, "max_batch_per_rank": 4, "page_tokens": PAGE},
        "mtp": {"draft_k": 2},
        "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 20},
                     "prompt": {"kind": "uniform", "lo": 5, "hi": 20}, "output": {"kind": "uniform", "lo": 4, "hi": 12},
                     "n_requests": 6, "seed": 2}})
    b = build(sc)
    reqs = generate(sc.workload, sc.seed)
    res, run = run_real(b, reqs, simulate=simulate, device="cpu", dtype="fp32", weights=str(d), prefill_pages=256,
                        decode_pages=256, tiny_cfg=TorchModelConfig.from_hf(json.loads((d / "config.json").read_text())))
    assert res.metrics["requests"]["done"] == len(reqs)
    emitted: dict[int, list[int]] = {}
    for rec in run.records:
        if rec[1] == "decode":
            for rid, a in rec[5].items():
                emitted.setdefault(rid, []).append(1 + a)
    for r in reqs:
        assert run.generated[r.id] == [0] * r.output_tokens
        e = emitted[r.id]
        assert e == [1] + [3] * (len(e) - 1), e                        # the first step has no drafts
        assert len(e) == 1 + -(-(r.output_tokens - 2) // 3)           # steps: the output's tokens, 3 at a time
    rep = replay(b, reqs, run.records, simulate=simulate, seed=sc.seed, deaths=run.deaths)
    assert res.log.decisions() == rep.log.decisions()


def test_prefill_writes_the_mtp_modules_kv_after_a_cached_prefix_too(models, cfg):
    """The prefill writes the MTP module's latent rows (layer ``n_layers``) for every prompt position; after a cached
    prefix it writes those of the suffix, equal to a full prefill's, and the prefix's rows are the cached ones —
    equal too except the prefix's last position, whose next token was the caching prompt's."""
    _, spec = models
    n = cfg.n_layers
    g = torch.Generator().manual_seed(9)
    a = torch.randint(0, cfg.vocab, (12,), generator=g)
    b = torch.cat([a[:8], (a[8:11] + 1) % cfg.vocab])                    # shares 8 tokens (2 pages) with a
    with torch.inference_mode():
        full = spec.new_cache(16, PAGE)
        pf = full.alloc(len(b))
        spec.forward_prefill([b], full, [pf])
        rows_full = full.read_rows(n, pf, len(b))
        part = spec.new_cache(16, PAGE)
        pa = part.alloc(len(a))
        spec.forward_prefill([a], part, [pa])
        pb = part.share(pa[:2])
        part.grow(pb, len(b))
        spec.forward_prefill([b[8:]], part, [pb], starts=[8])
        rows_part = part.read_rows(n, pb, len(b))
    assert torch.allclose(rows_part[8:], rows_full[8:], atol=1e-5)
    assert torch.allclose(rows_part[:7], rows_full[:7], atol=1e-5)
    assert not torch.allclose(rows_part[7], rows_full[7], atol=1e-5)    # a's token 8 followed it, not b's
    assert torch.allclose(part.read_rows(n - 1, pb, len(b)), full.read_rows(n - 1, pf, len(b)), atol=1e-5)
