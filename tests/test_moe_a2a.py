"""Decode dispatch/combine (kernels/moe_a2a.py) on the CPU: the torch backend (the fixed-slot, capturable rewrite)
against the CPU emulation of the DP-EP plan for edge routings and both payloads; the engine's peer-a2a MoE path
(engine/real/model.py ``_moe_dp_ep_peer``, driven here by the torch backend) against the existing all-to-all path
and the unsharded experts, with a batch that needs agreed chunks; and, where CuTe DSL is importable, the compiled
kernels' parameter lists and flag protocol in the PTX."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from rackbed.engine.real.launch import spawn_local  # noqa: E402
from rackbed.kernels import moe_a2a  # noqa: E402
from rackbed.kernels.moe_reference import route  # noqa: E402

D, K, E, TM = 512, 4, 8, 32  # fp8 rows need D % 512 == 0 (16-byte rows)


def _routing(kind, T, rank, rng):
    if kind == "one":
        return np.tile(np.arange(K), (T, 1)), np.full((T, K), 0.25)
    if kind == "last":  # everything on the last rank's experts
        return np.tile(np.arange(E - K, E), (T, 1)), np.full((T, K), 0.25)
    r = route(T, E, K, dist=kind, zipf_s=1.2, rng=rng)
    return np.asarray(r.topk_ids).reshape(T, K), np.asarray(r.topk_weights).reshape(T, K)


def _backend_rank(rank, world):
    """Torch backend vs emulate, several routings (a rank with no tokens, all tokens on one rank), both payloads."""
    res = []
    for payload in ("bf16", "fp8"):
        a2a = moe_a2a.PeerMoeAllToAll(None, max_tokens=TM, hidden=D, top_k=K, n_experts=E, payload=payload,
                                      backend="torch")
        a2a.device = torch.device("cpu")
        lay = a2a.lay
        for case, (kind, Ts) in enumerate([("uniform", (5, 32)), ("zipf", (32, 0)), ("one", (7, 3)),
                                           ("last", (0, 0)), ("zipf", (1, 17))]):
            rng = np.random.default_rng(100 * case + rank)
            T = Ts[rank]
            ids, w = _routing(kind, T, rank, rng)
            xb = torch.randn(T, D).to(torch.bfloat16)
            x = xb if payload == "bf16" else moe_a2a.pack_fp8_rows(xb)
            out = a2a.alloc_outputs()
            out["x"].fill_(7)
            out["ids"].fill_(-5)
            a2a.dispatch(x, torch.tensor(ids, dtype=torch.int32).reshape(T, K),
                         torch.tensor(w, dtype=torch.float32).reshape(T, K), out)
            xs_np = x.view(torch.int16).numpy() if payload == "bf16" else x.numpy()
            allin = [None] * world
            dist.all_gather_object(allin, (xs_np, ids, w))
            y = (torch.arange(world * TM, dtype=torch.float32)[:, None] * 0.5 + rank
                 + torch.linspace(0, 1, D)[None, :]).to(torch.bfloat16)

            recv, _ = moe_a2a.emulate([a[0].astype(np.float64) for a in allin], [a[1] for a in allin],
                                      [a[2] for a in allin], lay, lambda j, xr, ir, wr: np.zeros_like(xr))
            mine = recv[rank]
            ok = out["counts"].tolist() == mine["counts"].tolist()
            gx = (out["x"].view(torch.int16) if payload == "bf16" else out["x"]).numpy().astype(np.float64)
            for s in range(world):
                lo, c = s * TM, int(mine["counts"][s])
                ok = ok and np.array_equal(gx[lo:lo + c], mine["x"][lo:lo + c])
                ok = ok and np.array_equal(out["ids"][lo:lo + c].numpy(), mine["ids"][lo:lo + c])
                ok = ok and bool((out["ids"][lo + c:lo + TM] == -1).all())
                ok = ok and bool((out["weights"][lo + c:lo + TM] == 0).all())
                ok = ok and np.allclose(out["weights"][lo:lo + c].numpy(), mine["w"][lo:lo + c], rtol=1e-6)
            # combine: every rank returns y (its slot rows); token t gets the fp32 sum over its destinations
            ys = [None] * world
            dist.all_gather_object(ys, y)
            res_t = torch.full((T, D), float("nan"), dtype=torch.bfloat16)
            a2a.combine(y, res_t, T)
            goes = moe_a2a.destinations(ids, world, E // world)
            before = np.cumsum(goes, 0) - goes
            want = torch.zeros(T, D)
            for t in range(T):
                for j in range(world):
                    if goes[t, j]:
                        want[t] += ys[j][rank * TM + before[t, j]].float()
            ok_c = torch.equal(res_t, want.to(torch.bfloat16))
            res.append((payload, kind, T, bool(ok), bool(ok_c)))
        a2a.dispatch_send(x, torch.tensor(ids, dtype=torch.int32).reshape(T, K),
                          torch.tensor(w, dtype=torch.float32).reshape(T, K))
        with pytest.raises(ValueError, match="last dispatch"):  # combine must answer the last dispatch's tokens
            a2a.combine_recv(torch.empty(T + 1, D, dtype=torch.bfloat16), T + 1)
    return res


@pytest.mark.slow
def test_torch_backend_matches_emulation_on_edge_routings():
    for rank_res in spawn_local(_backend_rank, 2, backend="gloo"):
        for payload, kind, T, ok_d, ok_c in rank_res:
            assert ok_d, (payload, kind, T, "dispatch")
            assert ok_c, (payload, kind, T, "combine")


def _engine_rank(rank, world):
    """The engine's peer path (torch backend injected, max_tokens 32) vs its all-to-all path vs unsharded."""
    from rackbed.engine.real.comm import Comm
    from rackbed.engine.real.model import Shard, ShardedQwen3Moe, TorchModelConfig

    cfg = TorchModelConfig(hidden=128, n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=32, n_experts=8, top_k=2,
                           moe_intermediate=64, vocab=64, rope_theta=10000.0)
    group = dist.new_group(list(range(world)))
    m = ShardedQwen3Moe.random(cfg, Shard(attn_tp=1, ep=world, ep_rank=rank), Comm(ep_group=group), seed=5,
                               dtype=torch.bfloat16)
    full = ShardedQwen3Moe.random(cfg, Shard(), Comm(), seed=5, dtype=torch.bfloat16)
    B = [40, 3][rank]  # rank 0 needs two chunks of 32; rank 1 must follow with an empty second chunk
    h = torch.randn(B, cfg.hidden, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    a2a = moe_a2a.PeerMoeAllToAll(group, max_tokens=32, hidden=cfg.hidden, top_k=cfg.top_k,
                                  n_experts=cfg.n_experts, backend="torch")
    a2a.device = torch.device("cpu")
    errs = []
    m._a2a_out, m._a2a_chunks = a2a.alloc_outputs(), 1  # what _peer_a2a sets up (chunks agreed at layer 0)
    for li in range(cfg.n_layers):
        w = m.layers[li]
        topi, topw = m._route(w, h)
        m._a2a = a2a
        peer = m._moe_dp_ep(w, h, topi, topw)
        chunks = m._a2a_chunks
        m._a2a = False  # the existing all_to_all path
        old = m._moe_dp_ep(w, h, topi, topw)
        ref = full._local_experts(full.layers[li], h, topi, topw)
        scale = ref.float().abs().max().item()
        errs.append(((peer.float() - ref.float()).abs().max().item() / scale,
                     (old.float() - ref.float()).abs().max().item() / scale, chunks))
    return errs


@pytest.mark.slow
def test_engine_peer_path_matches_all_to_all_path_and_unsharded():
    for rank_errs in spawn_local(_engine_rank, 2, backend="gloo"):
        for peer_err, old_err, chunks in rank_errs:
            assert chunks == 2
            assert peer_err < 2e-2, (peer_err, old_err)  # bf16 rounding of the weighted expert sums
            assert peer_err <= old_err * 1.5 + 1e-3, (peer_err, old_err)


# -------------------------------------------------------------------------------------- compiled kernels (no GPU)


def _cute():
    try:
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
        from rackbed.kernels import moe_a2a_cute

        return moe_a2a_cute
    except Exception as exc:  # CuTe DSL not installed (CI)
        pytest.skip(f"CuTe DSL unavailable: {exc}")


def test_ptx_param_parser():
    m = _cute()
    ptx = ".visible .entry k(\n\t.param .u64 k_param_0,\n\t.param .u32 k_param_1\n)\n{\n}"
    assert m.ptx_param_bits(ptx) == [64, 32]
    with pytest.raises(ValueError):
        m.ptx_param_bits("no entry")


@pytest.mark.parametrize("payload", ["bf16", "fp8"])
def test_compiled_kernels_parameters_and_flag_protocol(payload):
    """Compile the four kernels for sm_90a on the CPU; the launcher's parameter lists must match the PTX, and the
    PTX must publish with fence.acq_rel.sys + release atomics after bar.sync, wait with ld.acquire.sys under a
    globaltimer bound, and on a timeout store the error word on every rank (two st.relaxed.sys for EP=2)."""
    m = _cute()
    lay = moe_a2a.A2aLayout(2, 128, 4096, 8, 64, moe_a2a.row_bytes_for(4096, payload))
    for kind in m.KINDS:
        try:
            fn = m.compile_jit(kind, 2, lay, 128, 1_500_000_000)
        except Exception as exc:
            pytest.skip(f"cannot compile on this machine: {type(exc).__name__}: {exc}")
        ptx = m._read_artifact(fn.__ptx__, ".ptx").decode()
        assert m.ptx_param_bits(ptx) == [32 if p == "n_tok" else 64 for p in m.PARAMS[kind]], kind
        assert m._read_artifact(fn.__cubin__, ".cubin")[:4] == b"\x7fELF"
        body = ptx[ptx.index(".entry"):]
        if kind.endswith("_send"):
            assert "ld.acquire" not in body and "globaltimer" not in body  # sends never wait
            i_bar, i_fence = body.rindex("bar.sync"), body.index("fence.acq_rel.sys")
            i_atom = body.index("atom.global.sys.release.add")
            assert i_bar < i_fence < i_atom, kind
            assert body.count("atom.global.sys.release.add") == 2  # one per destination, including empty ones
        else:
            assert "ld.acquire.sys.global" in body and "globaltimer" in body and "1500000000" in body
            assert body.count("st.relaxed.sys.global") >= 2  # the error word, here and on the peer
            assert "ld.relaxed.sys.global" in body  # every spin polls the error word
