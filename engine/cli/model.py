"""``rackbed model``: model presets and their derived quantities.

    rackbed model list                                      preset names with total / active parameters
    rackbed model show NAME|config.json [--context N] [--json]
                                                            parameters, weight bytes per format, KV bytes per
                                                            token, linear-attention state, FLOPs per token

NAME is a preset (``engine.core.model.PRESET_NAMES``) or a Hugging Face config.json (qwen3_moe, qwen3_next,
qwen3_5_moe, deepseek_v3, kimi_k2, gpt_oss, glm4_moe). For a preset, ``show`` also prints the sizes its publisher
states (``PUBLISHED_SIZES``) beside the computed ones. Mistakes raise ``ValueError``; ``engine.cli.main`` prints them in one line and exits 2.
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
              f"{m.n_layers} layers ({_kind_counts(m)})")
    return 0


_KIND_NAMES = {"full": "full attention", "linear": "Gated DeltaNet", "sliding": "sliding-window", "mla": "MLA"}


def _kind_counts(m) -> str:
    return ", ".join(f"{n} {_KIND_NAMES[a.kind]}" for a, n in m.attention_counts())


def _attention(m) -> str:
    """Each softmax token mixer of the model in one phrase."""
    out = []
    for a, _ in m.attention_counts():
        if a.kind == "mla":
            out.append(f"MLA {a.n_heads} heads, q_lora {a.q_lora_rank}, kv_lora {a.kv_lora_rank} + rope "
                       f"{a.qk_rope_head_dim} (latent KV {a.kv_values_per_token()} values/token/layer), "
                       f"qk {a.qk_head_dim} / v {a.v_head_dim}")
        elif a.kind in ("full", "sliding"):
            extra = [x for x, on in ((", gated", a.gated), (", qk-norm", a.qk_norm), (", qkv bias", a.qkv_bias),
                                     (", o bias", a.o_bias), (", sinks", a.learned_sinks)) if on]
            win = f"window {a.window}: " if a.kind == "sliding" else ""
            out.append(f"{win}{a.n_q_heads} q / {a.n_kv_heads} kv heads x {a.head_dim}" + "".join(extra))
    return "; ".join(out)


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
            "n_dense_layers": m.n_dense_layers, "layer_kinds": _kind_counts(m), "attention": _attention(m),
            "linear_attention": (f"{m.linear_n_k_heads} k / {m.linear_n_v_heads} v heads x "
                                 f"{m.linear_head_dim}, conv {m.linear_conv}") if m.n_linear_layers else None,
            "moe": (f"{m.n_experts} experts top-{m.top_k} x {m.moe_intermediate}"
                    + (f" + {m.n_shared_experts} shared x {m.shared_intermediate}"
                       + ("" if m.shared_expert_gate else " (ungated)") if m.n_shared_experts else "")
                    + (", expert biases" if m.expert_bias else "") + (", router bias" if m.router_bias else ""))
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
        "kv_bytes_per_seq_at_context": {"bf16": m.kv_bytes_per_seq(context_len, 2)},
        "published": _published(m),
        "linear_state_bytes_per_seq": {"bf16": m.linear_state_bytes_per_seq(2),
                                       "fp32_state": m.linear_state_bytes_per_seq(4, conv_elem_bytes=2)},
        "context_len": context_len,
        "flops_per_token": {
            "prefill": m.flops_breakdown("prefill", context_len),
            "decode": m.flops_breakdown("decode", context_len),
        },
    }


def _published(m) -> dict | None:
    from rackbed.engine.core.model import PUBLISHED_SIZES

    pub = PUBLISHED_SIZES.get(m.name)
    if pub is None:
        return None
    total, active, note = pub
    return {"total": total, "active": active, "note": note,
            "total_vs_published": m.total_params() / total - 1, "active_vs_published": m.active_params() / active - 1}


def _si(x: float, unit: str) -> str:
    for div, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:,.3f} {prefix}{unit}"
    return f"{x:,.0f} {unit}"


def m_has_sliding(s: dict) -> bool:
    return "sliding-window" in s["architecture"]["layer_kinds"]


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
              f"{a['layer_kinds']}; {a['n_moe_layers']} MoE, {a['n_dense_layers']} dense MLP; {a['n_mtp_layers']} MTP")
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
    pub = s["published"]
    if pub:
        t.add_row("published total / active", f"{_si(pub['total'], '')} / {_si(pub['active'], '')}",
                  f"computed {pub['total_vs_published']:+.2%} / {pub['active_vs_published']:+.2%}; {pub['note']}")
    for k, v in p["breakdown"].items():
        if v:
            t.add_row(f"  {k}", _si(v, ""), "")
    t.add_section()
    for f, b in s["weight_bytes"].items():
        t.add_row(f"weights {f}", _si(b, "B"), "matmul weights in format, rest bf16; MTP excluded")
    t.add_section()
    kv = s["kv_bytes_per_token"]
    t.add_row("KV per token", f"{kv['bf16']:,} B", f"bf16; fp8 {kv['fp8']:,} B"
              + ("; sliding-window layers keep at most their window" if m_has_sliding(s) else ""))
    t.add_row(f"KV per sequence at {s['context_len']:,}", _si(s["kv_bytes_per_seq_at_context"]["bf16"], "B"), "bf16")
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
