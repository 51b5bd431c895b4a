"""Random weights whose MTP drafts the target accepts at a chosen rate (``real.mtp_agree``).

With plain random weights the MTP module's draft almost never equals the target's greedy token, so a timed
run with speculative decoding would accept nothing. The cost of a step does not depend on the weights'
values, only the accepted counts do, so :func:`make_agreeing` reshapes three tensors of a model drawn by
``families.ShardedMoeLM.random`` (every shape, and the layers' own weights at ``init_std``, unchanged) so
that:

* **The target is predictable.** Its greedy token after token ``t`` is ``pi(t)``, for one random cyclic
  permutation ``pi`` of the vocabulary (one cycle: a greedy stream never repeats before ``vocab`` tokens).
  The embedding of ``t`` is ``sigma_e * z_t`` (``z_t`` standard normal, the drawn embedding row over
  ``init_std``), and its scale ``sigma_e`` is ``MARGIN`` times :func:`residual_rms`, an upper estimate of
  what the layers add to the residual stream (every layer normalises its input, so what it adds does not
  grow with the embedding): the last hidden state stays ``~ sigma_e * z_t``. The lm head's row ``pi(t)``
  holds ``z_t``, so the logits after ``t`` peak at ``pi(t)``.
* **The MTP module predicts through a rotation.** Its input is ``eh_proj @ [enorm(embed(u)); hnorm(h)]`` for
  the next token ``u``; ``c * Q`` (``Q`` a random orthogonal ``[D, D]``, ``c`` ``MARGIN`` times the rms of
  everything else its output holds) is added to the embedding half of ``eh_proj``, so the module's hidden
  state is ``~ c * Q enorm(z_u)``. Each lm-head row is the sum of two parts (scaled to ``init_std``): row
  ``v`` is ``z_{pi^-1(v)} + Q z_{rho^-1(v)}`` for a second permutation ``rho`` (``enorm``'s gains, ``1 +
  N(0, 0.1)``, are left out: the lm head is the same with or without the module). The first part makes the
  target pick ``pi(t)`` and the second the MTP module pick ``rho(u)`` (each part is noise to the other path:
  random directions of ``D`` dimensions, ``sqrt(D / 2)`` standard deviations below the peak).
* **Agreement is per token.** ``rho = pi`` on a random set ``G`` of ``round(p * vocab)`` tokens and differs
  from ``pi`` everywhere else (the rest shifted by one along a random order of them), so the draft after
  token ``u`` is accepted exactly when ``u`` is in ``G`` (and every draft before it was). A greedy stream
  walks ``pi``'s cycle over distinct tokens, so each draft position is accepted with probability ``p`` given
  the earlier ones were: the geometric acceptance ``mtp.accept_p: p`` tells the simulator.

The layers' residual contributions perturb both paths; at DeepSeek-V3 width (``D = 7168``) the peak stands
about 60 standard deviations of the other logits above them, so a measured rate is ``p`` up to the sampling
of ``G`` along the tokens visited; tiny test models (``D = 128``) miss a few percent. On a CPU, in bf16, at
DeepSeek-V3 width with 2 layers (one dense, one MoE of 8 experts) and a 16384-token vocabulary, the layers
added an rms of 5.5 against the estimate's 7.9, the target's top logit stood 53 standard deviations above the
mean, every greedy token followed ``pi``, and every step of 8 sequences x 12 steps accepted what ``G``
predicts (0.74 of 156 drafts at p = 0.7). Tied embeddings (lm head = embedding) cannot carry the two parts and
are refused.
"""

from __future__ import annotations

import math

import torch

#: how many times the estimated noise the embedding scale and the MTP module's rotation are
MARGIN = 4.0
#: rows of the vocabulary reshaped at once (bounds the fp32 temporaries at DeepSeek-V3 width to ~0.5 GB)
CHUNK = 16384


def _silu_rms(sigma: float) -> float:
    """rms of ``silu(g)`` for ``g ~ N(0, sigma^2)`` (numerical quadrature on a fixed grid)."""
    x = torch.linspace(-8.0, 8.0, 4001, dtype=torch.float64)
    w = torch.exp(-x * x / 2)
    g = sigma * x
    return float(((torch.nn.functional.silu(g) ** 2 * w).sum() / w.sum()).sqrt())


def branch_rms(cfg, li: int) -> float:
    """An upper estimate of the per-element rms that layer ``li`` (``n_layers``: the MTP module's layer) adds
    to the residual stream for any input, at weights of std ``init_std``: attention as if every head read one
    value row, the routed experts as if one expert took all the (scaled) routing weight, plus the shared
    expert."""
    s, D, H = cfg.init_std, cfg.hidden, cfg.n_q_heads
    if cfg.kind(li) == "mla":
        v = s * math.sqrt(cfg.kv_lora_rank)              # kv_b of the normalised latent
        attn = s * math.sqrt(H * cfg.v_head_dim) * v
    else:
        v = s * math.sqrt(D)
        attn = s * math.sqrt(H * cfg.head_dim) * v
    g = s * math.sqrt(D)                                  # gate / up of the normalised input
    act = _silu_rms(g) * g

    def mlp(width: int) -> float:
        return s * math.sqrt(width) * act

    if cfg.is_dense(li):
        ffn = mlp(cfg.dense_intermediate)
    else:
        ffn = max(cfg.routed_scaling, 1.0) * mlp(cfg.moe_intermediate)
        if cfg.shared_intermediate:
            ffn += mlp(cfg.shared_intermediate)
    return math.sqrt(attn * attn + ffn * ffn)


def residual_rms(cfg) -> float:
    """An upper estimate of the per-element rms all decoder layers add to the residual stream
    (:func:`branch_rms`, summed as independent)."""
    return math.sqrt(sum(branch_rms(cfg, li) ** 2 for li in range(cfg.n_layers)))


def permutations(vocab: int, p: float, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pi, rho, agree)``: the target's next-token map (one cycle over the vocabulary), the MTP module's,
    and the boolean mask of the ``round(p * vocab)`` tokens where they agree. Drawn on the CPU from ``seed``
    (identical on every rank and device)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"mtp_agree: must be in [0, 1], got {p}")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + 999_983)
    order = torch.randperm(vocab, generator=gen)
    pi = torch.empty(vocab, dtype=torch.long)
    pi[order] = torch.roll(order, -1)
    n_agree = round(p * vocab)
    ids = torch.randperm(vocab, generator=gen)
    agree = torch.zeros(vocab, dtype=torch.bool)
    agree[ids[:n_agree]] = True
    rest = ids[n_agree:]                   # disagreeing tokens, in a random order
    rho = pi.clone()
    if rest.numel() >= 2:                  # each takes the next one's target: never its own
        rho[rest] = pi[torch.roll(rest, -1)]
    else:                                  # a single disagreeing token cannot be shifted: it agrees
        agree[rest] = True
    return pi, rho, agree


@torch.no_grad()
def make_agreeing(cfg, glob: dict[str, torch.Tensor], mtp: dict[str, torch.Tensor] | None, p: float,
                  seed: int) -> torch.Tensor:
    """Reshape ``glob``'s ``embed`` / ``lm_head`` and (when given) ``mtp``'s ``eh_proj`` in place (module
    docstring) for agreement ``p``; returns the agreement mask. ``glob`` / ``mtp``: random weights as
    ``families.ShardedMoeLM.random`` draws them (``mtp`` whole: ``eh_proj`` is not sharded)."""
    if cfg.tie_embeddings:
        raise ValueError("mtp_agree: the lm head is the embedding (tie_word_embeddings), which cannot "
                         "carry both next-token maps")
    emb, dtype, dev = glob["embed"], glob["embed"].dtype, glob["embed"].device
    V, D, s = cfg.vocab, cfg.hidden, cfg.init_std
    pi, rho, agree = permutations(V, p, seed)
    pi_inv, rho_inv = torch.argsort(pi).to(dev), torch.argsort(rho).to(dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed * 1_000_003 + 999_979)
    Q, _ = torch.linalg.qr(torch.randn(D, D, generator=gen, device=dev, dtype=torch.float32))
    z = emb.float() / s                                   # the drawn rows, standard normal
    sigma_e = MARGIN * max(residual_rms(cfg), s)
    row_scale = s / math.sqrt(2.0)
    lm = torch.empty(V, D, dtype=dtype, device=dev)
    for a in range(0, V, CHUNK):
        b = min(a + CHUNK, V)
        lm[a:b] = ((z[pi_inv[a:b]] + z[rho_inv[a:b]] @ Q.T) * row_scale).to(dtype)
    glob["embed"] = (z * sigma_e).to(dtype)
    glob["lm_head"] = lm
    if mtp is not None:
        # everything else in the module's output: eh_proj's random halves of the normalised inputs, its layer
        other = math.sqrt(2 * D * s * s + branch_rms(cfg, cfg.n_layers) ** 2)
        eh = mtp["eh_proj"].float()
        eh[:, :D] += MARGIN * other * Q
        mtp["eh_proj"] = eh.to(dtype)
    return agree
