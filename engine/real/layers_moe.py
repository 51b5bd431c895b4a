"""Routing, experts and dense MLPs of the DeepSeek-V3 / GLM-4.5 / gpt-oss families in torch (as transformers
computes them).

Routing (``route``; ``TorchModelConfig.routing``):

* ``softmax`` (Qwen3-MoE): ``kernels.moe_block.route``.
* ``sigmoid_group`` (DeepSeek-V3, GLM-4.5): fp32 router logits, ``scores = sigmoid``; the choice uses
  ``scores + e_score_correction_bias``: the ``n_group`` groups are ranked by the sum of their top-2 biased scores, the
  top ``topk_group`` groups are kept and the top-k experts picked inside them; the weights are the unbiased scores
  of the chosen experts, renormalised (``norm_topk_prob``, + 1e-20) and times ``routed_scaling_factor``.
* ``topk_softmax`` (gpt-oss): top-k of the biased logits, softmax over those k.

Experts (``experts``): SwiGLU ``silu(g) * u`` or gpt-oss's clamped form ``g = min(g, limit)``, ``u = clip(u, -limit,
limit)``, ``(u + 1) * g * sigmoid(alpha * g)``, with optional gate/up and down biases. Weights are stored the
engine's way: ``gate_up [E, 2F, D]`` (gate rows then up rows), ``down [E, D, F]``; gpt-oss's checkpoint layout
(``[E, D, 2F]`` with gate and up interleaved column by column) is converted on load (``families.hf_layer``).

Dense MLP / shared expert (``mlp``): ``gate_up [2F, D]``, ``down [D, F]`` -- under prefill TP the rank holds an F
slice (partial sums, reduced by the caller).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F_

from rackbed.engine.real.profiling import scoped
from rackbed.kernels.moe_block import route as softmax_route


@scoped("other_s")
def route(w, h: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topi [T, k] int64, topw [T, k])`` in ``h``'s dtype."""
    if cfg.routing == "softmax":
        return softmax_route(h @ w["router"].T, cfg.top_k, cfg.norm_topk_prob, h.dtype)
    if cfg.routing == "topk_softmax":
        logits = h @ w["router"].T + w["router_bias"]
        val, idx = torch.topk(logits, cfg.top_k, dim=-1)
        return idx, torch.softmax(val.float(), dim=1).to(h.dtype)
    logits = h.float() @ w["router"].float().T
    scores = logits.sigmoid()
    choice = scores + w["e_bias"].float()
    T, E, G = h.shape[0], cfg.n_experts, cfg.n_group
    if G > 1:
        gs = choice.view(T, G, E // G).topk(2, dim=-1)[0].sum(-1)
        gi = torch.topk(gs, k=cfg.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(gs).scatter_(1, gi, 1).bool()
        choice = choice.masked_fill(~keep[:, :, None].expand(T, G, E // G).reshape(T, E), float("-inf"))
    topi = torch.topk(choice, k=cfg.top_k, dim=-1, sorted=False)[1]
    topw = scores.gather(1, topi)
    if cfg.norm_topk_prob:
        topw = topw / (topw.sum(-1, keepdim=True) + 1e-20)
    return topi, (topw * cfg.routed_scaling).to(h.dtype)


def glu(gu: torch.Tensor, F: int, cfg) -> torch.Tensor:
    """The activation of ``gu [R, 2F]`` (gate then up)."""
    g, u = gu[:, :F], gu[:, F:]
    if cfg.swiglu_limit <= 0:
        return F_.silu(g) * u
    g = g.clamp(max=cfg.swiglu_limit)
    u = u.clamp(min=-cfg.swiglu_limit, max=cfg.swiglu_limit)
    return (u + 1) * (g * torch.sigmoid(g * cfg.swiglu_alpha))


@scoped("moe_gemm_s")
def experts(w, xs: torch.Tensor, counts: torch.Tensor, cfg) -> torch.Tensor:
    """Local experts on rows ``xs [R, D]`` grouped by local expert (``counts``) -> ``[R, D]``. Plain SwiGLU
    without biases on CUDA goes through ``engine.real.model.grouped_swiglu`` (the grouped-GEMM kernels)."""
    gub, db = w.get("gate_up_bias"), w.get("down_bias")
    if xs.is_cuda and gub is None and cfg.swiglu_limit <= 0:
        from rackbed.engine.real.model import grouped_swiglu

        return grouped_swiglu(xs, w["gate_up"], w["down"], counts)
    F = w["down"].shape[-1]
    if xs.is_cuda and xs.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        # biased / clamped experts (gpt-oss): two grouped GEMMs, each row's biases gathered by its expert; no host
        # synchronisation, so the step can be captured in a CUDA graph
        offs = torch.cumsum(counts, 0).to(torch.int32)
        row_e = torch.repeat_interleave(torch.arange(counts.shape[0], device=xs.device), counts,
                                        output_size=xs.shape[0])
        gu = torch._grouped_mm(xs, w["gate_up"].transpose(1, 2), offs=offs)
        if gub is not None:
            gu = gu + gub[row_e]
        y = torch._grouped_mm(glu(gu, F, cfg).to(xs.dtype), w["down"].transpose(1, 2), offs=offs)
        return y if db is None else y + db[row_e]
    out = torch.empty(xs.shape[0], w["down"].shape[1], dtype=xs.dtype, device=xs.device)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            gu = xs[start:start + n] @ w["gate_up"][e].T
            if gub is not None:
                gu = gu + gub[e]
            y = glu(gu, F, cfg) @ w["down"][e].T
            out[start:start + n] = y if db is None else y + db[e]
            start += n
    return out


@scoped("moe_gemm_s")
def mlp(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Dense SwiGLU (a dense layer's MLP or the ungated shared expert)."""
    F = down.shape[-1]
    gu = h @ gate_up.T
    return (F_.silu(gu[:, :F]) * gu[:, F:]) @ down.T

