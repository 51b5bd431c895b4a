"""The routed-expert block of a Qwen3-MoE layer without host synchronisation (CUDA-graph capturable).

    from rackbed.kernels.moe_block import moe_block
    y = moe_block(h, logits, gate_up, down, top_k, swiglu=grouped_swiglu)   # what the engine's static decode runs

``engine/real/model.py``'s graph-captured decode step (``forward_decode_static``, one expert group) runs these
functions, and ``kernels/bench/measure.py`` (bench ``moe_block``) times them, whole and part by part, so the
measured block is the engine's own. Parts, in order (shapes: T tokens, D hidden, E experts, k = top_k, F expert
width):

* :func:`route` — softmax over the router logits ``[T, E]`` (fp32), top-k, optional renormalisation (Qwen3-MoE's
  ``norm_topk_prob``); the router GEMM ``h @ router.T`` that makes the logits is the caller's;
* :func:`permute` — sort the ``T * k`` (token, expert) pairs by expert (stable ``argsort``), count rows per expert
  (``scatter_add_``) and gather the rows ``h[tok]`` into expert order;
* the grouped SwiGLU experts (``swiglu(xs, gate_up, down, counts)``: ``kernels.grouped_gemm.grouped_swiglu``, two
  ``torch._grouped_mm`` calls on CUDA bf16);
* :func:`unpermute` — scale each row by its routing weight and sum the ``k`` rows of a token (``index_add_``).

Every shape depends on ``T`` alone (no data-dependent size, no ``.item()``), so the block can be captured once per
batch size. Imports torch only.
"""

from __future__ import annotations


def route(logits, top_k: int, norm_topk_prob: bool = True, dtype=None):
    """``(topi [T, k] int64, topw [T, k])``: top-k of the softmax of ``logits [T, E]`` (in fp32), renormalised to
    sum to 1 when ``norm_topk_prob``; ``topw`` in ``dtype`` (default: the logits' dtype)."""
    import torch

    probs = torch.softmax(logits.float(), dim=-1)
    topw, topi = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        topw = topw / topw.sum(-1, keepdim=True)
    return topi, topw.to(dtype or logits.dtype)


def permute(h, topi, n_experts: int):
    """``(order, tok, counts, xs)``: the ``T * k`` pairs sorted by expert (``order``, stable), each sorted row's
    token (``tok``), rows per expert (``counts [E]`` int64) and the rows ``xs = h[tok] [T * k, D]``."""
    import torch

    k = topi.shape[1]
    ids = topi.reshape(-1)
    order = torch.argsort(ids, stable=True)
    tok = order // k
    counts = torch.zeros(n_experts, dtype=torch.int64, device=h.device).scatter_add_(0, ids, torch.ones_like(ids))
    return order, tok, counts, h[tok]


def unpermute(y, tok, order, topw, h):
    """``[T, D]``: the expert outputs ``y [T * k, D]`` (expert order) weighted by their routing weights and summed
    per token (``h`` gives the output's shape, dtype and device)."""
    import torch

    return torch.zeros_like(h).index_add_(0, tok, y * topw.reshape(-1)[order, None])


def moe_block(h, logits, gate_up, down, top_k: int, *, swiglu, norm_topk_prob: bool = True):
    """The routed experts of one MoE layer on one expert group holding all ``E`` experts: :func:`route`,
    :func:`permute`, ``swiglu`` (``(xs, gate_up [E, 2F, D], down [E, D, F], counts) -> [T * k, D]``),
    :func:`unpermute`. ``h [T, D]``, ``logits [T, E]``; returns ``[T, D]`` in ``h``'s dtype."""
    topi, topw = route(logits, top_k, norm_topk_prob, h.dtype)
    order, tok, counts, xs = permute(h, topi, gate_up.shape[0])
    return unpermute(swiglu(xs, gate_up, down, counts), tok, order, topw, h)
