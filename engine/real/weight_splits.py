"""How each weight kind of a decoder layer is split over a rank's parallel groups, as data (``SPLITS``), and
the one function that slices a layer's full weights by it (``shard_weights``).

Both weight paths use it: seeded random weights (``model.random_layer_weights``, ``families.random_layer``)
and a Hugging Face state dict (``model.hf_layer_weights``, ``families.hf_layer``) produce a layer's full,
unsharded tensors under the same names; ``shard_weights`` then keeps what one ``Shard`` holds. A ``Split``
names the group (``over``), the dimension split and the extent of one unit of that group along it:

* ``q_heads``: the rank's query heads in its attention TP group (``Shard.q_heads``; MLA: its heads);
* ``kv_heads``: the KV heads its query heads read (``Shard.kv_heads``: split while tp <= KV heads,
  replicated on tp / KV heads ranks beyond);
* ``experts``: its experts in the EP group (``Shard.experts``);
* ``ffn``: its 1/tp slice of a dense SwiGLU's width F (the dense MLP and the shared expert under prefill TP: a
  partial sum the TP all-reduce completes); a fused ``[2F, D]`` gate/up (``halves=2``) takes the slice of each
  half;
* ``whole``: every rank holds it whole (norms, router, the MLA latent projections, MTP glue);
* ``one_rank``: whole, and the layer runs on one attention rank only (Gated DeltaNet: ``attn_tp`` must be 1).

Sliced tensors are copies (the full ones can be freed); whole ones are the full tensors themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Split:
    """``over``: the group (module docstring); ``dim``: the dimension split; ``width``: the TorchModelConfig
    fields whose sum is one unit's extent along ``dim`` (a head's rows; empty: 1); ``halves``: fused halves
    along ``dim`` each split the same way (a gate/up pair: 2)."""

    over: str
    dim: int = 0
    width: tuple[str, ...] = ()
    halves: int = 1


WHOLE = Split("whole")
_HEAD = ("head_dim",)

#: GQA ("full" and "sliding" layers): q/k/v/o by heads (o along its input), biases and sinks with their heads;
#: Qwen3.5's output gate (``gate_proj``) by query heads like q
_GQA = {
    "q_proj": Split("q_heads", 0, _HEAD), "k_proj": Split("kv_heads", 0, _HEAD),
    "v_proj": Split("kv_heads", 0, _HEAD), "o_proj": Split("q_heads", 1, _HEAD),
    "gate_proj": Split("q_heads", 0, _HEAD),
    "q_bias": Split("q_heads", 0, _HEAD), "k_bias": Split("kv_heads", 0, _HEAD),
    "v_bias": Split("kv_heads", 0, _HEAD), "sinks": Split("q_heads", 0),
    "o_bias": WHOLE, "q_norm": WHOLE, "k_norm": WHOLE,
}
#: MLA: the latent down-projections and their norms whole (every rank needs the latent), the up-projections by
#: heads (q: nope + rope rows per head; kv_b: nope + v rows per head), o along its input (v per head)
_MLA = {
    "q_a": WHOLE, "q_a_norm": WHOLE, "kv_a": WHOLE, "kv_a_norm": WHOLE,
    "q_b": Split("q_heads", 0, _HEAD), "q_proj": Split("q_heads", 0, _HEAD),
    "kv_b": Split("q_heads", 0, ("qk_nope_head_dim", "v_head_dim")),
    "o_proj": Split("q_heads", 1, ("v_head_dim",)),
}
#: Gated DeltaNet ("linear" layers, ``layers_gdn.shapes``)
_GDN = {k: Split("one_rank") for k in ("lin_in", "conv", "dt_bias", "A_log", "lin_norm", "out_proj")}
#: every layer: norms, routing, routed experts (EP), dense MLP and shared expert (TP F slices), the MTP
#: module's own pieces
_COMMON = {
    "input_norm": WHOLE, "post_norm": WHOLE,
    "router": WHOLE, "router_bias": WHOLE, "e_bias": WHOLE, "shared_gate": WHOLE,
    "gate_up": Split("experts"), "down": Split("experts"), "gate_up_bias": Split("experts"),
    "down_bias": Split("experts"),
    "mlp_gate_up": Split("ffn", 0, halves=2), "mlp_down": Split("ffn", 1),
    "shared_gate_up": Split("ffn", 0, halves=2), "shared_down": Split("ffn", 1),
    "enorm": WHOLE, "hnorm": WHOLE, "eh_proj": WHOLE, "head_norm": WHOLE,
}

#: layer kind (``TorchModelConfig.kind``) -> weight name -> how it is split
SPLITS: dict[str, dict[str, Split]] = {
    "full": _GQA | _COMMON, "sliding": _GQA | _COMMON, "mla": _MLA | _COMMON, "linear": _GDN | _COMMON,
}


def _units(split: Split, cfg, shard) -> range:
    if split.over == "q_heads":
        return shard.q_heads(cfg)
    if split.over == "kv_heads":
        return shard.kv_heads(cfg)
    return shard.experts(cfg)


def split_of(cfg, li: int, name: str) -> Split:
    """How weight ``name`` of layer ``li`` is split (a name the table lacks is an error, not a silent
    copy)."""
    table = SPLITS[cfg.kind(li)]
    if name not in table:
        raise KeyError(f"layer {li} ({cfg.kind(li)}): weight {name!r} has no entry in weight_splits.SPLITS")
    return table[name]


def take(t: torch.Tensor, split: Split, cfg, shard) -> torch.Tensor:
    """The part of the full tensor ``t`` that ``shard`` holds under ``split``."""
    if split.over in ("whole", "one_rank"):
        if split.over == "one_rank" and shard.attn_tp != 1:
            raise ValueError(f"Gated DeltaNet layers run on one attention rank (attn_tp={shard.attn_tp})")
        return t
    if split.over == "ffn":
        n, tp, r = t.shape[split.dim] // split.halves, shard.attn_tp, shard.attn_rank
        if n % tp:
            raise ValueError(f"tp={tp} does not divide the MLP width {n}")
        a, b = r * n // tp, (r + 1) * n // tp
    else:
        u = _units(split, cfg, shard)
        w = sum(getattr(cfg, f) for f in split.width) if split.width else 1
        n, a, b = t.shape[split.dim] // split.halves, u.start * w, u.stop * w
    parts = [t.narrow(split.dim, h * n + a, b - a) for h in range(split.halves)]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, split.dim)).clone()


def shard_weights(full: dict[str, torch.Tensor], cfg, shard, li: int) -> dict[str, torch.Tensor]:
    """Layer ``li``'s full weights sliced to what ``shard`` holds, every name by its ``SPLITS`` entry."""
    return {name: take(t, split_of(cfg, li, name), cfg, shard) for name, t in full.items()}
