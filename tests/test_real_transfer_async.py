"""KV transfers run on their own lane (thread, stream, process group) on both ends: a transfer completes while the
compute lanes of the prefiller and of the decoder are both stuck inside a collective, and the shipped KV is right
(the decoder's next token equals Hugging Face's greedy token). With one command loop per rank the transfer would
wait behind the stuck commands and this test would time out. Also: the decode CUDA-graph buckets captured at
warm-up cover every page-table width a run can reach."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_qwen3moe import save_checkpoint, tiny_hf_model

from rackbed.engine.real.driver import RealRun, graph_pages
from rackbed.engine.real.model import DecodeGraphRunner, TorchModelConfig
from rackbed.sim.scenario import build, parse_scenario


def _collect(pool, need: dict[int, int], timeout_s: float) -> dict[int, dict[int, tuple]]:
    """Replies ``{token: {rank: (status, payload)}}`` until each token in ``need`` has that many replies or time is
    up (replies of other tokens are kept too)."""
    got: dict[int, dict[int, tuple]] = {}
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and any(len(got.get(t, {})) < n for t, n in need.items()):
        for token, rank, status, payload in pool.poll(0.2):
            got.setdefault(token, {})[rank] = (status, payload)
    return got


@pytest.mark.slow
def test_kv_transfer_completes_while_both_compute_lanes_are_blocked(tmp_path):
    hc, hf = tiny_hf_model()
    d = save_checkpoint(hc, hf, tmp_path / "ckpt")
    sc = parse_scenario({
        "name": "cpu-async-kv", "topology": "hgx-h200", "model": str(d / "config.json"), "weight_format": "bf16",
        "prefill": {"tp": 2, "ep": 2, "replicas": 1, "max_batch_tokens": 256},
        "decode": {"ep": 2, "replicas": 1, "max_batch_per_rank": 4, "page_tokens": 4},
        "mtp": {"draft_k": 0},
        "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 20},
                     "prompt": {"kind": "uniform", "lo": 5, "hi": 30},
                     "output": {"kind": "uniform", "lo": 2, "hi": 8}, "n_requests": 2, "seed": 1}})
    b = build(sc)
    cfg = TorchModelConfig.from_hf(json.loads((d / "config.json").read_text()))
    run = RealRun(b, device="cpu", dtype="fp32", n_layers=None, seed=0, weights=str(d), prefill_pages=64,
                  decode_pages=64, tiny_cfg=cfg)
    pool = run.pool
    p0, p1 = run.group_ranks[b.deployment.prefillers[0].id]
    d0, d1 = run.group_ranks[b.deployment.decoders[0].id]
    g = torch.Generator().manual_seed(5)
    ids1 = torch.randint(0, cfg.vocab, (13,), generator=g).tolist()
    ids2 = torch.randint(0, cfg.vocab, (9,), generator=g).tolist()
    try:
        # request 1 prefilled on both TP ranks
        t = pool.token()
        for r in (p0, p1):
            pool.send(r, "prefill", t, items=[(1, ids1)])
        rep = _collect(pool, {t: 2}, 60)[t]
        assert {s for s, _ in rep.values()} == {"ok"}, rep
        tok1, src_pages = rep[p0][1][0][1][:2]   # (first token, pages, cached tokens reused)
        # block both compute lanes inside a collective: only one rank of each group gets the command
        t_pf, t_dec = pool.token(), pool.token()
        pool.send(p0, "prefill", t_pf, items=[(2, ids2)])        # waits in the TP all-reduce for p1
        pool.send(d0, "decode", t_dec, joined=[], left=[])      # waits in the EP all-to-all for d1
        # ship request 1's KV to decoder rank d0
        t_kv = pool.token()
        for r in (p0, p1):
            pool.send(r, "kv_send", t_kv, rid=1, dst_global=d0, seq_len=len(ids1))
        pool.send(d0, "kv_recv", t_kv, rid=1, src_globals=[p0, p1], seq_len=len(ids1), src_pages=src_pages,
                  last_token=tok1, tokens=[])
        got = _collect(pool, {t_kv: 3}, 40)
        kv = got.get(t_kv, {})
        assert set(kv) == {p0, p1, d0}, f"KV transfer did not complete beside blocked compute lanes: {got}"
        assert all(s == "ok" for s, _ in kv.values()), kv
        assert kv[p0][1][0] + kv[p1][1][0] == kv[d0][1][0] > 0          # bytes sent = bytes received
        assert t_pf not in got and t_dec not in got                  # the compute lanes really were blocked
        # release them, then decode request 1 on the decoder from the shipped KV
        pool.send(p1, "prefill", t_pf, items=[(2, ids2)])
        pool.send(d1, "decode", t_dec, joined=[], left=[])
        rel = _collect(pool, {t_pf: 2, t_dec: 2}, 60)
        assert len(rel.get(t_pf, {})) == 2 and len(rel.get(t_dec, {})) == 2, rel
        t2 = pool.token()
        for r in (d0, d1):
            pool.send(r, "decode", t2, joined=[(1, 0)], left=[])
        out = _collect(pool, {t2: 2}, 60)[t2]
        assert {s for s, _ in out.values()} == {"ok"}, out
        tok2 = out[d0][1][0][1]
    finally:
        pool.stop()
        run.tmp.cleanup()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids1]), max_new_tokens=2, do_sample=False)[0, len(ids1):].tolist()
    assert [tok1, tok2] == ref


def test_warmup_buckets_cover_every_reachable_width():
    class _Req:
        def __init__(self, p, o):
            self.prompt_tokens, self.output_tokens = p, o

    @given(st.lists(st.tuples(st.integers(1, 5000), st.integers(1, 600)), min_size=1, max_size=20),
           st.sampled_from([1, 4, 16, 64]), st.integers(1, 64))
    def check(reqs, page_tokens, max_batch):
        rs = [_Req(p, o) for p, o in reqs]
        lo, hi = graph_pages(rs, page_tokens)
        keys = DecodeGraphRunner.buckets(max_batch, lo, hi)
        assert len(keys) == len(set(keys))
        sizes = [b * p for b, p in keys]
        assert sizes == sorted(sizes, reverse=True)                 # largest first: the shared pool is sized once
        for p, o in reqs:
            for n in (p + 1, p + o + 1):                                # first step, last step of this request
                w = -(-n // page_tokens)
                for batch in (1, max_batch):
                    want = (DecodeGraphRunner._bucket(batch, DecodeGraphRunner.BATCH_BUCKETS),
                            -(-w // DecodeGraphRunner.PAGE_ROUND) * DecodeGraphRunner.PAGE_ROUND)
                    assert want in keys

    check()
    assert graph_pages([], 64) == (0, 0)


@pytest.mark.slow
def test_a_source_without_the_kv_fails_its_transfer_and_the_pairs_stay_in_step(tmp_path, monkeypatch):
    """A prefiller rank asked to ship KV it no longer holds (its copy was dropped: a retry after the decoder died)
    fails that transfer — the decoder's receive fails too, it does not hang — and the next transfer on the same
    (prefiller, decoder) pairs, of a different size, lands intact. Gloo aborts a process whose receive meets a
    larger message than it posted, so a source that skipped the offer of the failed transfer would take the
    offer of the next one and kill the prefiller. The decoder frees the pages it reserved for the failed transfer:
    its cache has 8 pages, the failed transfer reserved 7 and the next one needs 3. The failure is a decline
    (reply ``declined``, not ``error``) on the source without the KV and on the decoder, so the driver blames no
    rank. Then a decoder whose cache has no room for a transfer (request 3 needs 6 pages, 5 are free) refuses
    it: it and both sources reply ``declined: no pages`` (alive, nobody's fault: the driver ships it again
    later), the sources keep their copy, and once the decoder has freed a request the same transfer lands."""
    monkeypatch.setenv("RACKBED_KV_ROOM_WAIT_S", "0.2")   # the ranks inherit it: refuse a full cache quickly
    hc, hf = tiny_hf_model()
    d = save_checkpoint(hc, hf, tmp_path / "ckpt")
    sc = parse_scenario({
        "name": "cpu-kv-framing", "topology": "hgx-h200", "model": str(d / "config.json"), "weight_format": "bf16",
        "prefill": {"tp": 2, "ep": 2, "replicas": 1, "max_batch_tokens": 256},
        "decode": {"ep": 2, "replicas": 1, "max_batch_per_rank": 4, "page_tokens": 4},
        "mtp": {"draft_k": 0},
        "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 20},
                     "prompt": {"kind": "uniform", "lo": 5, "hi": 30},
                     "output": {"kind": "uniform", "lo": 2, "hi": 8}, "n_requests": 2, "seed": 1}})
    b = build(sc)
    cfg = TorchModelConfig.from_hf(json.loads((d / "config.json").read_text()))
    run = RealRun(b, device="cpu", dtype="fp32", n_layers=None, seed=0, weights=str(d), prefill_pages=64,
                  decode_pages=8, tiny_cfg=cfg)
    pool = run.pool
    p0, p1 = run.group_ranks[b.deployment.prefillers[0].id]
    d0, d1 = run.group_ranks[b.deployment.decoders[0].id]
    g = torch.Generator().manual_seed(7)
    ids1 = torch.randint(0, cfg.vocab, (9,), generator=g).tolist()
    ids2 = torch.randint(0, cfg.vocab, (26,), generator=g).tolist()
    ids3 = torch.randint(0, cfg.vocab, (21,), generator=g).tolist()

    def kv(rid, ids, src_pages, last):
        t = pool.token()
        for r in (p0, p1):
            pool.send(r, "kv_send", t, rid=rid, dst_global=d0, seq_len=len(ids))
        pool.send(d0, "kv_recv", t, rid=rid, src_globals=[p0, p1], seq_len=len(ids), src_pages=src_pages,
                  last_token=last, tokens=[])
        return _collect(pool, {t: 3}, 60).get(t, {})

    try:
        t = pool.token()
        for r in (p0, p1):
            pool.send(r, "prefill", t, items=[(1, ids1), (2, ids2), (3, ids3)])
        rep = _collect(pool, {t: 2}, 60)[t]
        assert {s for s, _ in rep.values()} == {"ok"}, rep
        (tok1, pages1), (tok2, pages2) = rep[p0][1][0][1][:2], rep[p0][1][0][2][:2]
        tok3, pages3 = rep[p0][1][0][3][:2]
        t = pool.token()
        pool.send(p1, "drop", t, rids=[2])             # p1 no longer holds request 2; p0 still does
        assert _collect(pool, {t: 1}, 30)[t][p1][0] == "ok"
        bad = kv(2, ids2, pages2, tok2)                # 7 pages offered: p0 ships, p1 declines
        assert set(bad) == {p0, p1, d0}, bad
        # a decline, not a rank error: the driver has the request prefilled again and blames no rank
        assert bad[p0][0] == "ok" and bad[p1][0] == "declined" and bad[d0][0] == "declined", bad
        assert "declined" in bad[d0][1], bad
        good = kv(1, ids1, pages1, tok1)               # 3 pages offered on the same pairs
        assert {s for s, _ in good.values()} == {"ok"}, good
        assert good[p0][1][0] + good[p1][1][0] == good[d0][1][0] > 0
        assert all(p.exitcode is None for p in pool.procs)
        t = pool.token()
        for r in (d0, d1):
            pool.send(r, "decode", t, joined=[(1, 0)], left=[])
        out = _collect(pool, {t: 2}, 60)[t]
        assert {s for s, _ in out.values()} == {"ok"}, out
        tok1b = out[d0][1][0][1]
        full = kv(3, ids3, pages3, tok3)               # 6 pages needed, 5 free: refused, nobody's fault
        assert {s for s, _ in full.values()} == {"declined"}, full
        assert all(msg.startswith("declined: no pages") for _, msg in full.values()), full
        t = pool.token()
        pool.send(d0, "drop", t, rids=[1])             # request 1 is done: 8 pages free
        assert _collect(pool, {t: 1}, 30)[t][d0][0] == "ok"
        again = kv(3, ids3, pages3, tok3)              # the sources kept their copy
        assert {s for s, _ in again.values()} == {"ok"}, again
        assert again[p0][1][0] + again[p1][1][0] == again[d0][1][0] > 0
        assert all(p.exitcode is None for p in pool.procs)
    finally:
        pool.stop()
        run.tmp.cleanup()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids1]), max_new_tokens=2, do_sample=False)[0, len(ids1):].tolist()
    assert [tok1, tok1b] == ref
