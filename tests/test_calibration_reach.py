"""Every curve a shipped calibration holds is read by the simulator.

For every entry of every shipped calibration table (``calibration/*.json|yaml`` with ``entries``) the test calls the
cost-model function that prices its kind, with arguments built from the entry's key the way the simulator builds
them, at the entry's measured sizes, and checks that the measured value comes back (not the first-principles
estimate). A curve stored under a key no lookup asks for (an all-reduce ``algo`` spelled as another tool spells
it, a format or payload name the cost functions never produce) fails here.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from rackbed.sim.calibration.files import CALIBRATION_DIR, load_calibration_file
from rackbed.sim.costs import attention, collective, gemm, mla, moe_block, moe_comm
from rackbed.sim.costs.calibration import KEY_ALIASES, KINDS, CalibrationTable, canonical_key, host_step_s
from rackbed.topology.presets import PRESETS, preset
from rackbed.topology.yamlio import is_json_name, read_text

#: a key value no shipped entry pins, for the fields a fallback entry leaves out
UNPINNED = 11111
DS_MLA = SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)


def _tables() -> list[Path]:
    out = []
    d = Path(CALIBRATION_DIR)
    for f in sorted(d.glob("*.yaml")) + sorted(d.glob("*.json")) + sorted(d.glob("*.json.gz")):
        if "entries" in _raw(f):
            out.append(f)
    return out


@lru_cache(maxsize=None)   # each file once: parsed at collection (parametrize) and again by tests
def _raw(f: Path) -> dict:
    text = read_text(f)   # a .gz file decompressed
    return json.loads(text) if is_json_name(f) else yaml.load(text, Loader=YAML_LOADER)


#: libyaml's loader where PyYAML has it (what the simulator reads calibrations with): h200.yaml is 1.4 MB
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@lru_cache(maxsize=8)
def _load(f: Path) -> CalibrationTable:
    return load_calibration_file(f)


@lru_cache(maxsize=8)
def _topology(gpu_name: str):
    """The largest preset built from ``gpu_name`` GPUs (the widest NVLink domain to put groups in)."""
    best = None
    for name in PRESETS:
        t = preset(name)
        if t.gpu_spec(0).name == gpu_name and (best is None or t.n_gpus > best.n_gpus):
            best = t
    assert best is not None, f"no topology preset has {gpu_name} GPUs"
    return best


def _xs(e) -> list[float]:
    """One measured size per curve (the middle one): the key decides whether a curve is reached, not the size."""
    pts = e.points
    return [pts[len(pts) // 2][0]]


# ---------------------------------------------------------------------------------------------- one driver per kind
# each returns the value the simulator's lookup path gives for (entry's key, x), in the entry's unit


def _gemm(calib, e, x):
    gpu = _topology(e.gpu).gpu_spec(0)
    n, k = int(e.key.get("n", UNPINNED)), int(e.key.get("k", UNPINNED))  # a fallback entry: a shape none pins
    c = gemm.gemm_time(gpu, int(x), n, k, e.key["fmt"], calib=calib)
    return 2.0 * int(x) * n * k / c.total_s / 1e12


def _moe(calib, e, x):
    gpu = _topology(e.gpu).gpu_spec(0)
    k = e.key
    model = SimpleNamespace(hidden=k["hidden"], moe_intermediate=k["inter"], top_k=k["top_k"],
                            n_experts=k["n_experts"])
    s = moe_block.moe_block_s(calib, gpu, model, k["fmt"], k["tp"], k["ep"], x)
    return None if s is None else s * 1e6


def _allreduce(calib, e, x):
    topo = _topology(e.gpu)
    c = collective.allreduce_time(topo, list(range(e.key["n_ranks"])), x, algo=e.key["algo"], calib=calib)
    return c.total_s * 1e6 if c.calibrated else None


_BPE = {"bf16": 2.0, "fp8": 1.0, "fp4": 0.5}
_KV_BYTES = {"bf16": 2.0, "fp8": 1.0}


def _a2a(calib, e, x):
    topo = _topology(e.gpu)
    g = collective.group_links(topo, list(range(e.key["n_ranks"])))
    bpe = _BPE[e.key["payload"]]
    hidden = 7168
    s = moe_comm._a2a_measured(calib, g, e.key["op"], x / (hidden * bpe), hidden, bpe)
    return None if s is None else s * 1e6


def _flash(calib, e, x):
    gpu = _topology(e.gpu).gpu_spec(0)
    k = e.key
    return attention.flash_rate(calib, gpu, x, k.get("head_dim", UNPINNED), k.get("n_q_heads", UNPINNED),
                                k.get("n_kv_heads", UNPINNED), 1.0, k.get("window", 0))


def _decode_attn(calib, e, x):
    gpu = _topology(e.gpu).gpu_spec(0)
    k = e.key
    kv = attention.kv_format(_KV_BYTES[k.get("kv", "bf16")])
    return attention.decode_attn_rate(calib, gpu, x, float(k["seq_heads"]), k.get("head_dim", UNPINNED),
                                      k.get("n_q_heads", UNPINNED), k.get("n_kv_heads", UNPINNED), kv,
                                      k.get("window", 0))


def _mla_att(e):
    assert e.key["dims"] == mla.mla_dims(DS_MLA), f"MLA dims {e.key['dims']} of no model rackbed prices"
    return DS_MLA


def _mla_prefill(calib, e, x):
    gpu = _topology(e.gpu).gpu_spec(0)
    kv = attention.kv_format(_KV_BYTES[e.key["kv"]])
    return mla.mla_prefill_rate(calib, gpu, _mla_att(e), x, e.key["n_heads"], float(e.key["seqs"]), kv)


def _mla_decode(calib, e, x):
    gpu = _topology(e.gpu).gpu_spec(0)
    kv = attention.kv_format(_KV_BYTES[e.key["kv"]])
    return mla.mla_decode_rate(calib, gpu, _mla_att(e), x, float(e.key["seqs"]), e.key["n_heads"], kv)


def _mla_bmm(calib, e, x):
    gpu = _topology(e.gpu).gpu_spec(0)
    fmt = {"bf16": mla.bmm_format("bf16"), "fp8": mla.bmm_format("fp8_block")}[e.key["fmt"]]
    s = mla.mla_bmm_s(calib, gpu, _mla_att(e), x, e.key["op"], e.key["n_heads"], fmt)
    return None if s is None else s * 1e6


def _hbm(calib, e, x):
    return gemm.hbm_rate_Bps(_topology(e.gpu).gpu_spec(0), x, calib) / 1e9


def _p2p(calib, e, x):
    topo = _topology(e.gpu)
    pair = next(((0, b) for b in range(1, topo.n_gpus) if topo.route_kind(0, b) == e.key["route"]), None)
    assert pair is not None, f"no GPU pair of {e.gpu} routed over {e.key['route']}"
    c = collective.p2p_copy_time(topo, *pair, x, calib=calib)
    return c.total_s * 1e6 if c.calibrated else None


def _gather_scatter(calib, e, x):
    topo = _topology(e.gpu)
    c = moe_comm._gather_scatter(e.kind, topo, list(range(e.key["n_ranks"])), x, e.key["payload"], calib)
    return None if c.calibrated_s is None else c.calibrated_s * 1e6


def _step(calib, e, x):
    return host_step_s(calib, _topology(e.gpu).gpu_spec(0), e.key["phase"], x) * 1e6


DRIVERS = {
    "gemm_tflops": _gemm, "moe_us": _moe, "allreduce_us": _allreduce, "a2a_us": _a2a, "flash_tflops": _flash,
    "decode_attn_GBps": _decode_attn, "mla_prefill_tflops": _mla_prefill, "mla_decode_GBps": _mla_decode,
    "mla_bmm_us": _mla_bmm, "hbm_GBps": _hbm, "p2p_us": _p2p, "step_us": _step,
    "allgather_us": _gather_scatter, "reducescatter_us": _gather_scatter,
}


@pytest.mark.slow
def test_tables_found():
    names = {f.name for f in _tables()}
    assert {"h200.yaml", "h200-trtllm.json.gz", "gb200-trtllm.json.gz", "b200-trtllm.json.gz", "gb300-trtllm.json.gz",
            "b300-trtllm.json.gz", "h100-trtllm.json.gz", "h800-trtllm.json.gz"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("f", _tables(), ids=lambda f: f.name)
def test_every_shipped_curve_is_read(f):
    calib = _load(f)
    missing_driver = sorted({e.kind for e in calib.entries} - set(DRIVERS))
    assert not missing_driver, f"{f.name}: kinds no lookup path reads: {missing_driver}"
    unread = []
    ll = calib.interpolation == "log-log"
    for e in calib.entries:
        for x in _xs(e):
            x = max(round(x), 1) if e.kind == "gemm_tflops" else x  # a GEMM's M is a whole number of tokens
            y = e.extend(x, ll) if e.kind.endswith("_us") else e.interpolate(x, ll)
            got = DRIVERS[e.kind](calib, e, x)
            if got is None or not math.isclose(got, y, rel_tol=1e-6):
                unread.append(f"{e.kind} {e.key} x={x:g}: measured {y:g}, the lookup gave {got}")
                break
    assert not unread, f"{f.name}: {len(unread)} of {len(calib.entries)} curves unread, e.g.\n" + \
        "\n".join(unread[:10])


@pytest.mark.parametrize("f", _tables(), ids=lambda f: f.name)
def test_shipped_keys_are_canonical(f):
    """The files hold the names the cost functions query, not a tool's other spelling (the loader maps those, but a
    file written by the importer must not need it)."""
    for e in _raw(f)["entries"]:
        assert canonical_key(e["kind"], e.get("key", {})) == e.get("key", {}), (f.name, e["kind"], e.get("key"))
        assert set(e.get("key", {})) <= set(KINDS[e["kind"]])
    algos = {e["key"]["algo"] for e in _raw(f)["entries"] if e["kind"] == "allreduce_us"}
    assert algos <= set(collective.ALGOS), algos


def test_alias_spellings_still_read():
    """A file holding TensorRT-LLM's ``oneshot`` / ``twoshot`` names (written before the importer used rackbed's)
    is read as ``one_shot`` / ``two_shot``."""
    for (kind, field), names in KEY_ALIASES.items():
        assert kind == "allreduce_us" and field == "algo"
        for alias, canon in names.items():
            t = CalibrationTable.model_validate({"entries": [
                {"kind": kind, "gpu": "H200-SXM", "key": {field: alias, "n_ranks": 2},
                 "points": [[1024, 3.0], [1 << 20, 9.0]]}]})
            assert t.entries[0].key[field] == canon
            c = collective.allreduce_time(preset("hgx-h200"), [0, 1], 1 << 20, algo=canon, calib=t)
            assert c.calibrated and c.total_s == pytest.approx(9e-6)


@pytest.mark.parametrize("gpu_file", ["h200-trtllm.json.gz", "b200-trtllm.json.gz", "gb200-trtllm.json.gz",
                                      "gb300-trtllm.json.gz", "b300-trtllm.json.gz", "h100-trtllm.json.gz"])
@pytest.mark.parametrize("n", [2, 4])
def test_tp_allreduce_priced_from_measured_curves(gpu_file, n):
    """TP2 / TP4 all-reduces under the trtllm stack (algo auto) come from the measured curves (the stack's custom
    all-reduce or NCCL, whichever is faster), at decode and prefill sizes alike; no estimate undercuts them."""
    calib = _load(Path(CALIBRATION_DIR) / gpu_file)
    topo = _topology(calib.entries[0].gpu)
    gpus = list(range(n))
    for n_bytes in (7168 * 2, 7168 * 2 * 64, 7168 * 2 * 4096, 7168 * 2 * 16384):
        c = collective.allreduce_time(topo, gpus, n_bytes, calib=calib)
        assert c.calibrated, (gpu_file, n, n_bytes, c.algo)
        measured = [calib.lookup("allreduce_us", topo.gpu_spec(0).name, n_bytes, algo=a, n_ranks=n)
                    for a in collective.ALGOS]
        assert c.total_s * 1e6 == pytest.approx(min(m for m in measured if m is not None))


def test_h800_collectives_are_h100s_scaled_to_its_nvlink():
    """H800's all-reduces are H100's measured curves times the model's hgx-h800 / hgx-h100 time at the same size
    (no H800 table exists); its GEMMs are H100's measured curves."""
    from rackbed.sim.costs import gemm

    h800 = _load(Path(CALIBRATION_DIR) / "h800-trtllm.json.gz")
    h100 = _load(Path(CALIBRATION_DIR) / "h100-trtllm.json.gz")
    t800, t100 = preset("hgx-h800"), preset("hgx-h100")
    for n in (2, 4, 8):
        for n_bytes in (1 << 14, 1 << 20, 1 << 24):
            c = collective.allreduce_time(t800, list(range(n)), n_bytes, algo="ring", calib=h800)
            m100 = h100.lookup("allreduce_us", "H100-SXM", n_bytes, algo="ring", n_ranks=n) * 1e-6
            r = (collective.allreduce_time(t800, list(range(n)), n_bytes, algo="ring").total_s
                 / collective.allreduce_time(t100, list(range(n)), n_bytes, algo="ring").total_s)
            assert c.calibrated and c.total_s == pytest.approx(m100 * r, rel=0.02), (n, n_bytes)
    g800 = gemm.gemm_time(t800.gpu_spec(0), 256, 4096, 4096, "fp8", calib=h800)
    g100 = gemm.gemm_time(t100.gpu_spec(0), 256, 4096, 4096, "fp8", calib=h100)
    assert g800.calibrated and g800.total_s == pytest.approx(g100.total_s, rel=1e-12)


def test_unmeasured_group_size_scales_the_nearest_measured():
    """GB200's tables measure all-reduces at 2 and 4 GPUs: TP8 takes the TP4 curves scaled by the model's TP8 / TP4
    ratio (so a measured TP4 is not compared with a first-principles TP8), and no NVLS estimate competes."""
    calib = _load(Path(CALIBRATION_DIR) / "gb200-trtllm.json.gz")
    topo = _topology("B200-GB200")
    g8 = collective.group_links(topo, list(range(8)))
    assert collective.auto_names(g8, "auto", calib) == ["one_shot", "two_shot", "ring"]
    for n_bytes in (7168 * 2 * 64, 7168 * 2 * 4096):
        for algo in ("one_shot", "two_shot", "ring"):
            c8 = collective.allreduce_time(topo, list(range(8)), n_bytes, algo=algo, calib=calib)
            m4 = calib.lookup("allreduce_us", "B200-GB200", n_bytes, algo=algo, n_ranks=4) * 1e-6
            e8 = collective.allreduce_time(topo, list(range(8)), n_bytes, algo=algo).total_s
            e4 = collective.allreduce_time(topo, list(range(4)), n_bytes, algo=algo).total_s
            assert c8.calibrated and c8.total_s == pytest.approx(m4 * e8 / e4)
    # a calibration without the stack's own all-reduce (rackbed's h200.yaml: NCCL at 2 GPUs) scales nothing
    h200 = _load(Path(CALIBRATION_DIR) / "h200.yaml")
    c = collective.allreduce_time(preset("hgx-h200"), list(range(4)), 1 << 20, algo="ring", calib=h200)
    assert not c.calibrated
