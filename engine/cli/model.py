"""``rackbed model``: model presets and their derived quantities.

    rackbed model list                                      preset names with total / active parameters
    rackbed model show NAME|config.json [--context N] [--json]
                                                            parameters, weight bytes per format, KV bytes per
                                                            token, linear-attention state, FLOPs per token

NAME is a preset (``engine.core.model.PRESET_NAMES``) or a Hugging Face config.json (qwen3_moe, qwen3_next,
qwen3_5_moe). Mistakes raise ``ValueError``; ``engine.cli.main`` prints them in one line and exits 2.
"""

from __future__ import annotations

import argparse
import json


def register(subparsers) -> None:
    p = subparsers.add_parser("model", help="model presets and derived quantities (params, bytes, FLOPs, KV)")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
    sub = p.add_subparsers(dest="model_command", metavar="ACTION")

    q = sub.add_parser("list", help="list model presets")
    q.set_defaults(func=cmd_list)

    q = sub.add_parser("show", help="derived quantities of a model")
    q.add_argument("model", metavar="NAME|config.json",
                   help="preset (e.g. qwen3-235b-a22b) or HF config.json")
    q.add_argument("--context", type=int, default=6000,
                   help="prompt length for prefill / context for decode FLOPs (tokens, default 6000)")
    q.add_argument("--json", action="store_true", help="print the quantities as JSON")
    q.set_defaults(func=cmd_show)


def cmd_list(args: argparse.Namespace) -> int:
    from rackbed.engine.core.model import PRESET_NAMES, get_model

    for name in PRESET_NAMES:
        m = get_model(name)
        print(f"{name:20s} {m.total_params() / 1e9:8.2f} B total  {m.active_params() / 1e9:6.2f} B active  "
              f"{m.n_layers} layers ({m.n_full_layers} full, {m.n_linear_layers} linear)")
    return 0


def model_summary(model, context_len: int = 6000) -> dict:
    """Every derived quantity ``rackbed model show`` prints, as plain data (counts, bytes, FLOPs/token)."""
    from rackbed.engine.core.formats import FORMAT_NAMES

    if context_len < 1:
        raise ValueError(f"--context must be >= 1 token, got {context_len}")
    m = model
    return {
        "name": m.name,
        "source": m.source,
        "architecture": {
            "hidden": m.hidden, "n_layers": m.n_layers, "n_full_layers": m.n_full_layers,
            "n_linear_layers": m.n_linear_layers, "n_moe_layers": m.n_moe_layers,
            "n_dense_layers": m.n_dense_layers, "attention": f"{m.n_q_heads} q / {m.n_kv_heads} kv heads x "
            f"{m.head_dim}" + (", gated" if m.gated_attn else "") + (", qk-norm" if m.qk_norm else ""),
            "linear_attention": (f"{m.linear_n_k_heads} k / {m.linear_n_v_heads} v heads x "
                                 f"{m.linear_head_dim}, conv {m.linear_conv}") if m.n_linear_layers else None,
            "moe": (f"{m.n_experts} experts top-{m.top_k} x {m.moe_intermediate}"
                    + (f" + {m.n_shared_experts} shared x {m.shared_intermediate}"
                       if m.n_shared_experts else ""))
            if m.n_experts else None,
            "vocab": m.vocab, "tie_embeddings": m.tie_embeddings, "n_mtp_layers": m.n_mtp_layers,
        },
        "params": {
            "total": m.total_params(), "active": m.active_params(),
            "total_with_mtp": m.total_params(include_mtp=True),
            "active_with_mtp": m.active_params(include_mtp=True),
            "breakdown": m.params_breakdown(include_mtp=True),
            "per_expert": m.params_expert(),
            "attention_layer_full": m.params_attention_layer("full"),
            "attention_layer_linear": m.params_attention_layer("linear") if m.n_linear_layers else 0,
            "moe_layer": m.params_moe_layer() if m.n_experts else 0,
        },
        "weight_bytes": {f: m.weight_bytes(f) for f in FORMAT_NAMES},
        "kv_bytes_per_token": {"bf16": m.kv_bytes_per_token(2), "fp8": m.kv_bytes_per_token(1)},
        "linear_state_bytes_per_seq": {"bf16": m.linear_state_bytes_per_seq(2),
                                       "fp32_state": m.linear_state_bytes_per_seq(4, conv_elem_bytes=2)},
        "context_len": context_len,
        "flops_per_token": {
            "prefill": m.flops_breakdown("prefill", context_len),
            "decode": m.flops_breakdown("decode", context_len),
        },
    }


def _si(x: float, unit: str) -> str:
    for div, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:,.3f} {prefix}{unit}"
    return f"{x:,.0f} {unit}"


def cmd_show(args: argparse.Namespace) -> int:
    from rackbed.engine.core.model import get_model

    s = model_summary(get_model(args.model), args.context)
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    a, p = s["architecture"], s["params"]
    t = Table(title=f"model {s['name']}", caption=s["source"] or None)
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_column("note")
    t.add_row("layers", str(a["n_layers"]),
              f"{a['n_full_layers']} full attention, {a['n_linear_layers']} Gated DeltaNet; "
              f"{a['n_moe_layers']} MoE, {a['n_dense_layers']} dense MLP; {a['n_mtp_layers']} MTP")
    t.add_row("hidden / vocab", f"{a['hidden']} / {a['vocab']}",
              "tied embeddings" if a["tie_embeddings"] else "")
    t.add_row("attention", a["attention"], "")
    if a["linear_attention"]:
        t.add_row("linear attention", a["linear_attention"], "")
    if a["moe"]:
        t.add_row("MoE", a["moe"], "")
    t.add_section()
    t.add_row("params total", _si(p["total"], ""), f"with MTP {_si(p['total_with_mtp'], '')}")
    t.add_row("params active / token", _si(p["active"], ""), f"with MTP {_si(p['active_with_mtp'], '')}")
    for k, v in p["breakdown"].items():
        if v:
            t.add_row(f"  {k}", _si(v, ""), "")
    t.add_section()
    for f, b in s["weight_bytes"].items():
        t.add_row(f"weights {f}", _si(b, "B"), "matmul weights in format, rest bf16; MTP excluded")
    t.add_section()
    kv = s["kv_bytes_per_token"]
    t.add_row("KV per token", f"{kv['bf16']:,} B", f"bf16; fp8 {kv['fp8']:,} B")
    ls = s["linear_state_bytes_per_seq"]
    if ls["bf16"]:
        t.add_row("linear state per seq", _si(ls["bf16"], "B"),
                  f"bf16; fp32 state {_si(ls['fp32_state'], 'B')}")
    t.add_section()
    ctx = s["context_len"]
    for phase, note in (("prefill", f"{ctx}-token prompt, per token"), ("decode", f"at context {ctx}")):
        br = s["flops_per_token"][phase]
        t.add_row(f"FLOPs/token {phase}", _si(sum(br.values()), "FLOP"), note)
        for k, v in br.items():
            if v:
                t.add_row(f"  {k}", _si(v, "FLOP"), "")
    Console(width=140).print(t)
    return 0
