"""MoE routing and the dispatch/combine plans of expert parallelism, with numpy reference implementations.

Shape legend (used on every line below):
    T  = tokens (all ranks together)        k = experts per token (top-k)
    E  = routed experts                     D = hidden size          F = expert intermediate size
    ep = expert-parallel ranks (experts split contiguously: rank r owns experts [expert_starts[r], ..[r+1]))
    dp = data-parallel source ranks of decode (each owns some tokens); Tl = tokens routed to one rank

- :func:`route` draws a :class:`Routing` (top-k distinct experts per token, softmax weights) from a uniform or
  Zipf-skewed expert popularity, or realises given per-expert counts exactly.
- :class:`EpPrefillPlan` — prefill EP (the write-up's TP=4/EP=4 prefillers): the input is replicated on every
  rank, dispatch only *selects* the tokens routed to local experts, each rank accumulates its experts'
  weighted outputs into a full [T, D] partial, and an all-reduce over the ep ranks sums the partials.
- :class:`DpEpDecodePlan` — decode DP+EP: every dp rank owns its tokens; dispatch is a sparse all-to-all sending
  each token once to every ep rank holding at least one of its experts (pplx-kernels / DeepEP deduplicate: a
  token going to two experts on the same rank crosses the fabric once), the ep rank runs its experts and sums
  their weighted outputs per token, combine sends one vector per (token, rank) back and the source sums them.
- :func:`reference_moe_dense` computes the MoE output without any plan (every expert on every token, masked by
  the routing weights); :func:`reference_moe_ep_prefill` and :func:`reference_moe_dp_ep_decode` go through
  dispatch → per-expert GEMM → combine using the plans. Tests require all three to agree.

Experts are SwiGLU: ``y = w_down[e] @ (silu(g) * u)`` with ``[g; u] = w_gate_up[e] @ x`` (gate = first F rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from rackbed.engine.core import collectives
from rackbed.topology.errors import UserError

__all__ = [
    "ACTIVATION_BYTES_PER_ELEMENT_FALLBACK",
    "DpEpDecodePlan",
    "EpPrefillPlan",
    "Routing",
    "activation_bytes_per_element",
    "expected_tokens_per_expert",
    "expert_starts",
    "reference_moe_dense",
    "reference_moe_dp_ep_decode",
    "reference_moe_ep_prefill",
    "route",
]

# Bytes per activation element including block scales, used only while engine.core.formats is missing
# (it is written in parallel; see activation_bytes_per_element). fp8_block: 1 B + one fp32 scale per 128
# elements (1x128 activation blocks, DeepSeek-V3 style); mxfp8/mxfp6/mxfp4: one E8M0 byte per 32 elements (OCP
# MX v1.0); nvfp4: one E4M3 byte per 16 elements (the per-tensor fp32 scale is ignored); fp8: per-tensor scale.
ACTIVATION_BYTES_PER_ELEMENT_FALLBACK: dict[str, float] = {
    "bf16": 2.0,
    "fp8": 1.0,
    "fp8_block": 1.0 + 4 / 128,
    "mxfp8": 1.0 + 1 / 32,
    "mxfp6": 0.75 + 1 / 32,
    "mxfp4": 0.5 + 1 / 32,
    "nvfp4": 0.5 + 1 / 16,
}


def activation_bytes_per_element(fmt: str) -> float:
    """Bytes per activation element of format ``fmt`` including scales.

    Uses ``engine.core.formats.get_format(fmt).bytes_per_element("activation")`` when that module exists
    (imported lazily: it is written in parallel), else :data:`ACTIVATION_BYTES_PER_ELEMENT_FALLBACK`.
    """
    try:
        from rackbed.engine.core import formats
    except ModuleNotFoundError as exc:
        if exc.name != "rackbed.engine.core.formats":
            raise
        formats = None
    if formats is not None and hasattr(formats, "get_format"):
        return float(formats.get_format(fmt).bytes_per_element("activation"))
    if fmt not in ACTIVATION_BYTES_PER_ELEMENT_FALLBACK:
        names = ", ".join(ACTIVATION_BYTES_PER_ELEMENT_FALLBACK)
        raise UserError(f"moe: unknown activation format {fmt!r}; expected one of {names}")
    return ACTIVATION_BYTES_PER_ELEMENT_FALLBACK[fmt]


def expected_tokens_per_expert(n_tokens: int, n_experts: int, top_k: int) -> float:
    """Mean tokens per expert, T·k/E (6000 tokens, top-8 of 128 experts: 375)."""
    return n_tokens * top_k / n_experts


def expert_starts(n_experts: int, ep: int) -> np.ndarray:
    """[ep+1] first expert of each ep rank (contiguous split; the first ``E % ep`` ranks hold one more)."""
    if not 1 <= ep <= n_experts:
        raise UserError(f"moe: ep must be in 1..n_experts={n_experts}, got {ep}")
    sizes = np.full(ep, n_experts // ep, dtype=np.int64)
    sizes[: n_experts % ep] += 1
    return np.concatenate([[0], np.cumsum(sizes)])


# --------------------------------------------------------------------------------------------- routing


@dataclass(frozen=True, eq=False)
class Routing:
    """Which experts each token goes to.

    topk_ids:          [T, k] int64, distinct experts per row.
    topk_weights:      [T, k] float64, each row a softmax (positive, sums to 1).
    tokens_per_expert: [E] int64, occurrences of each expert in topk_ids (sums to T·k).
    Arrays are read-only.
    """

    topk_ids: np.ndarray
    topk_weights: np.ndarray
    tokens_per_expert: np.ndarray

    @classmethod
    def from_ids(cls, topk_ids: np.ndarray, topk_weights: np.ndarray, n_experts: int) -> Routing:
        """Validate a given assignment ([T, k] ids and weights) and count tokens per expert."""
        ids = np.array(topk_ids, dtype=np.int64)  # [T, k]
        w = np.array(topk_weights, dtype=np.float64)  # [T, k]
        if ids.ndim != 2 or w.shape != ids.shape:
            raise UserError(
                f"moe.Routing: topk_ids {ids.shape} and topk_weights {w.shape} must both be [T, k]"
            )
        if ids.size and (ids.min() < 0 or ids.max() >= n_experts):
            raise UserError(f"moe.Routing: expert ids must be in 0..{n_experts - 1}")
        srt = np.sort(ids, axis=1)
        if ids.shape[1] > 1 and (srt[:, 1:] == srt[:, :-1]).any():
            raise UserError(
                "moe.Routing: a token lists the same expert twice (top-k experts must be distinct)"
            )
        counts = np.bincount(ids.ravel(), minlength=n_experts).astype(np.int64)  # [E]
        for a in (ids, w, counts):
            a.setflags(write=False)
        return cls(ids, w, counts)

    @property
    def n_tokens(self) -> int:
        return self.topk_ids.shape[0]

    @property
    def top_k(self) -> int:
        return self.topk_ids.shape[1]

    @property
    def n_experts(self) -> int:
        return self.tokens_per_expert.shape[0]


def _softmax_weights(rng: np.random.Generator, n_tokens: int, top_k: int) -> np.ndarray:
    """[T, k] weights: softmax of standard-normal router logits, sorted descending like a top-k would."""
    logits = -np.sort(-rng.standard_normal((n_tokens, top_k)), axis=1)  # [T, k]
    e = np.exp(logits - logits[:, :1])
    return e / e.sum(axis=1, keepdims=True)


def route(
    n_tokens: int,
    n_experts: int,
    top_k: int,
    *,
    dist: Literal["uniform", "zipf", "counts"] = "uniform",
    zipf_s: float = 1.0,
    counts: Sequence[int] | np.ndarray | None = None,
    rng: np.random.Generator,
) -> Routing:
    """Draw a routing of ``n_tokens`` tokens to ``top_k`` distinct experts out of ``n_experts``.

    dist="uniform": every token picks k distinct experts uniformly at random.
    dist="zipf":    expert e has popularity ∝ 1/(e+1)^zipf_s (expert 0 the hottest); each token draws k distinct
                    experts without replacement with probabilities ∝ popularity (Gumbel-top-k).
    dist="counts":  ``counts[e]`` tokens go to expert e exactly (sum = T·k, each <= T). The sequence of expert
                    ids, each repeated counts[e] times, is laid out column-major over the [T, k] slots, so an
                    expert's <= T consecutive occurrences land on distinct tokens; tokens are then shuffled.
    Weights: softmax of random router logits (descending per row). ``rng`` is the only source of randomness.
    """
    if n_tokens < 0 or n_experts < 1 or not 1 <= top_k <= n_experts:
        raise UserError(
            f"moe.route: need n_tokens >= 0, n_experts >= 1, 1 <= top_k <= n_experts; "
            f"got T={n_tokens}, E={n_experts}, k={top_k}"
        )
    if dist == "uniform":
        keys = rng.random((n_tokens, n_experts))  # [T, E]
        ids = np.argsort(keys, axis=1, kind="stable")[:, :top_k]  # [T, k]
    elif dist == "zipf":
        if zipf_s < 0:
            raise UserError(f"moe.route: zipf_s must be >= 0, got {zipf_s}")
        log_p = -zipf_s * np.log(np.arange(1, n_experts + 1))  # [E]
        keys = log_p + rng.gumbel(size=(n_tokens, n_experts))  # [T, E]
        ids = np.argsort(-keys, axis=1, kind="stable")[:, :top_k]  # [T, k]
    elif dist == "counts":
        if counts is None:
            raise UserError("moe.route: dist='counts' needs counts=[...] (one entry per expert)")
        c = np.asarray(counts, dtype=np.int64)  # [E]
        if c.shape != (n_experts,) or (c < 0).any() or (c > n_tokens).any() or c.sum() != n_tokens * top_k:
            raise UserError(
                f"moe.route: counts must have {n_experts} entries in 0..{n_tokens} summing to T*k="
                f"{n_tokens * top_k}; got {c.size} entries summing to {int(c.sum())}"
            )
        seq = np.repeat(np.arange(n_experts), c)  # [T*k] expert ids, each run <= T long
        ids = seq.reshape(top_k, n_tokens).T  # [T, k]: slot (t, j) = seq[j*T + t]
        ids = ids[rng.permutation(n_tokens)]  # shuffle tokens
        ids = np.take_along_axis(ids, rng.permuted(np.tile(np.arange(top_k), (n_tokens, 1)), axis=1), axis=1)
    else:
        raise UserError(f"moe.route: dist must be 'uniform', 'zipf' or 'counts', got {dist!r}")
    return Routing.from_ids(ids, _softmax_weights(rng, n_tokens, top_k), n_experts)


# --------------------------------------------------------------------------------------------- prefill EP


@dataclass(frozen=True, eq=False)
class EpPrefillPlan:
    """Prefill expert parallelism with the input replicated on all ``ep`` ranks.

    expert_starts:     [ep+1] contiguous expert ranges.
    token_ids:         per rank, [Tl] sorted distinct tokens with at least one expert on that rank.
    expert_token_ids:  per rank, per local expert, [rows] tokens routed to it (ascending) — the GEMM input rows.
    expert_slots:      same layout, the top-k slot (column of topk_ids/weights) of each row.
    gemm_rows:         per rank, [local experts] rows of each local expert's GEMM.
    n_tokens:          T; the combine all-reduce sums a [T, D] partial over the ep ranks
                       (:meth:`combine_allreduce_bytes`).
    """

    ep: int
    n_tokens: int
    expert_starts: np.ndarray
    token_ids: tuple[np.ndarray, ...]
    expert_token_ids: tuple[tuple[np.ndarray, ...], ...]
    expert_slots: tuple[tuple[np.ndarray, ...], ...]
    gemm_rows: tuple[np.ndarray, ...]

    @classmethod
    def build(cls, routing: Routing, ep: int) -> EpPrefillPlan:
        starts = expert_starts(routing.n_experts, ep)
        ids = routing.topk_ids  # [T, k]
        tok_all = np.repeat(np.arange(routing.n_tokens), routing.top_k)  # [T*k] row-major (token, slot)
        slot_all = np.tile(np.arange(routing.top_k), routing.n_tokens)  # [T*k]
        exp_all = ids[tok_all, slot_all]  # [T*k]
        order = np.lexsort((tok_all, exp_all))  # by expert, then token
        tok_s, slot_s, exp_s = tok_all[order], slot_all[order], exp_all[order]
        bounds = np.searchsorted(exp_s, np.arange(routing.n_experts + 1))  # [E+1]
        token_ids, e_tok, e_slot, rows = [], [], [], []
        for r in range(ep):
            lo, hi = int(starts[r]), int(starts[r + 1])
            e_tok.append(tuple(tok_s[bounds[e] : bounds[e + 1]] for e in range(lo, hi)))
            e_slot.append(tuple(slot_s[bounds[e] : bounds[e + 1]] for e in range(lo, hi)))
            rows.append(np.diff(bounds[lo : hi + 1]).astype(np.int64))
            token_ids.append(np.unique(tok_s[bounds[lo] : bounds[hi]]))
        return cls(ep, routing.n_tokens, starts, tuple(token_ids), tuple(e_tok), tuple(e_slot), tuple(rows))

    def combine_allreduce_elems(self, hidden: int) -> int:
        """Elements of the combine all-reduce: the whole [T, D] output."""
        return self.n_tokens * hidden

    def combine_allreduce_bytes(self, hidden: int, elem_bytes: int = 2) -> int:
        """Bytes per rank buffer (B of the all-reduce) for ``elem_bytes`` per element (bf16: 2)."""
        return self.combine_allreduce_elems(hidden) * elem_bytes


# --------------------------------------------------------------------------------------------- decode DP-EP


@dataclass(frozen=True, eq=False)
class DpEpDecodePlan:
    """Decode sparse all-to-all: ``dp`` source ranks own the tokens, ``ep`` ranks own the experts.

    src_rank:        [T] dp rank owning each token.
    tokens:          [dp, ep] distinct tokens src sends to dst (a token with several experts on one dst rank
                     counts ONCE, as pplx-kernels and DeepEP deduplicate). When the dp and ep ranks are the same
                     GPUs (dp == ep) the diagonal is local (no fabric traffic): see :meth:`remote_tokens`.
    send_token_ids:  [src][dst] -> sorted global token ids sent; dst's receive buffer is their concatenation
                     over src (offsets ``recv_offsets[dst]``, [dp+1]).
    expert_rows:     [dst][local expert] -> rows of dst's receive buffer routed to that expert (GEMM input).
    expert_slots:    same layout, the top-k slot of each row (to look up its routing weight).
    recv_tokens:     [ep] tokens each rank receives; send_tokens: [dp] tokens each rank sends.
    max_recv_tokens / max_send_tokens: the maxima (what buffers are sized for).
    """

    ep: int
    dp: int
    expert_starts: np.ndarray
    src_rank: np.ndarray
    tokens: np.ndarray
    send_token_ids: tuple[tuple[np.ndarray, ...], ...]
    recv_offsets: tuple[np.ndarray, ...]
    expert_rows: tuple[tuple[np.ndarray, ...], ...]
    expert_slots: tuple[tuple[np.ndarray, ...], ...]

    @classmethod
    def build(
        cls,
        routing: Routing | Sequence[Routing],
        ep: int,
        dp: int | None = None,
        src_rank: Sequence[int] | np.ndarray | None = None,
    ) -> DpEpDecodePlan:
        """Plan from one routing (tokens of all dp ranks) or a list of per-dp-rank routings.

        With a list, ``dp = len(routings)`` and token ids are numbered rank by rank. With one routing,
        ``src_rank`` ([T] ints in 0..dp-1) says which dp rank owns each token; if omitted, tokens are split
        contiguously over the dp ranks (first ``T % dp`` ranks one more).
        """
        if not isinstance(routing, Routing):
            routings = list(routing)
            if not routings:
                raise UserError("moe.DpEpDecodePlan: empty list of routings")
            if dp is not None and dp != len(routings):
                raise UserError(f"moe.DpEpDecodePlan: dp={dp} but {len(routings)} routings given")
            dp = len(routings)
            e_set = {r.n_experts for r in routings}
            if len(e_set) != 1 or len({r.top_k for r in routings}) != 1:
                raise UserError("moe.DpEpDecodePlan: routings disagree on n_experts or top_k")
            src = np.repeat(np.arange(dp), [r.n_tokens for r in routings])
            routing = Routing.from_ids(
                np.concatenate([r.topk_ids for r in routings]),
                np.concatenate([r.topk_weights for r in routings]),
                e_set.pop(),
            )
            src_rank = src
        if dp is None or dp < 1:
            raise UserError(f"moe.DpEpDecodePlan: dp must be >= 1, got {dp}")
        T = routing.n_tokens
        if src_rank is None:
            sizes = np.full(dp, T // dp)
            sizes[: T % dp] += 1
            src_rank = np.repeat(np.arange(dp), sizes)
        src = np.asarray(src_rank, dtype=np.int64)  # [T]
        if src.shape != (T,) or (T and (src.min() < 0 or src.max() >= dp)):
            raise UserError(f"moe.DpEpDecodePlan: src_rank must be [T={T}] ints in 0..{dp - 1}")
        starts = expert_starts(routing.n_experts, ep)
        owner = np.searchsorted(starts, routing.topk_ids, side="right") - 1  # [T, k] ep rank of each expert
        goes = np.zeros((T, ep), dtype=bool)  # [T, ep] token t needs rank d (deduplicated)
        goes[np.repeat(np.arange(T), routing.top_k), owner.ravel()] = True
        tokens = np.zeros((dp, ep), dtype=np.int64)  # [dp, ep]
        np.add.at(tokens, src, goes.astype(np.int64))

        send_ids = tuple(
            tuple(np.flatnonzero((src == s) & goes[:, d]) for d in range(ep)) for s in range(dp)
        )  # [dp][ep] -> [n] token ids
        recv_offsets, rows_all, slots_all = [], [], []
        for d in range(ep):
            buf = np.concatenate([send_ids[s][d] for s in range(dp)])  # [Tl] receive buffer of rank d
            recv_offsets.append(np.concatenate([[0], np.cumsum([len(send_ids[s][d]) for s in range(dp)])]))
            rows_d, slots_d = [], []
            for e in range(int(starts[d]), int(starts[d + 1])):
                hit = routing.topk_ids[buf] == e  # [Tl, k], at most one True per row
                r_idx, slot = np.nonzero(hit)
                rows_d.append(r_idx)
                slots_d.append(slot)
            rows_all.append(tuple(rows_d))
            slots_all.append(tuple(slots_d))
        for a in (src, tokens, starts):
            a.setflags(write=False)
        return cls(
            ep, dp, starts, src, tokens, send_ids, tuple(recv_offsets), tuple(rows_all), tuple(slots_all)
        )

    @property
    def recv_tokens(self) -> np.ndarray:
        return self.tokens.sum(axis=0)  # [ep]

    @property
    def send_tokens(self) -> np.ndarray:
        return self.tokens.sum(axis=1)  # [dp]

    @property
    def max_recv_tokens(self) -> int:
        return int(self.recv_tokens.max())

    @property
    def max_send_tokens(self) -> int:
        return int(self.send_tokens.max())

    def remote_tokens(self) -> np.ndarray:
        """[dp, ep] tokens that cross the fabric: ``tokens`` with the diagonal zeroed when dp == ep (rank i is
        both dp rank i and ep rank i); equal to ``tokens`` otherwise."""
        out = self.tokens.copy()
        if self.dp == self.ep:
            np.fill_diagonal(out, 0)
        return out

    def dispatch_bytes(self, hidden: int, fmt: str = "bf16") -> np.ndarray:
        """[dp, ep] dispatch payload bytes: tokens × hidden × bytes per element of ``fmt`` (incl. scales).

        Routing metadata (top-k ids and weights, a few bytes per token) is not included.
        """
        return self.tokens * hidden * activation_bytes_per_element(fmt)

    def combine_bytes(self, hidden: int, fmt: str = "bf16") -> np.ndarray:
        """[ep, dp] combine payload bytes: one weighted-sum vector per (token, ep rank) goes back."""
        return self.tokens.T * hidden * activation_bytes_per_element(fmt)


# --------------------------------------------------------------------------------------------- references


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _expert(x: np.ndarray, w_gate_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """SwiGLU expert on [n, D] rows with w_gate_up [2F, D], w_down [D, F] -> [n, D]."""
    F = w_down.shape[1]
    h = x @ w_gate_up.T  # [n, 2F]
    return (_silu(h[:, :F]) * h[:, F:]) @ w_down.T  # [n, D]


def _check_weights(x: np.ndarray, routing: Routing, w_gate_up: np.ndarray, w_down: np.ndarray) -> None:
    T, D = x.shape
    E = routing.n_experts
    if T != routing.n_tokens:
        raise UserError(f"moe: x has {T} tokens, routing {routing.n_tokens}")
    if w_gate_up.ndim != 3 or w_gate_up.shape[0] != E or w_gate_up.shape[2] != D or w_gate_up.shape[1] % 2:
        raise UserError(f"moe: w_gate_up must be [E={E}, 2F, D={D}], got {w_gate_up.shape}")
    if w_down.shape != (E, D, w_gate_up.shape[1] // 2):
        raise UserError(
            f"moe: w_down must be [E={E}, D={D}, F={w_gate_up.shape[1] // 2}], got {w_down.shape}"
        )


def reference_moe_dense(
    x: np.ndarray, routing: Routing, w_gate_up: np.ndarray, w_down: np.ndarray
) -> np.ndarray:
    """[T, D] MoE output computed densely: every expert on every token, combined with a [T, E] weight matrix
    that is zero outside each token's top-k. x [T, D], w_gate_up [E, 2F, D], w_down [E, D, F]."""
    _check_weights(x, routing, w_gate_up, w_down)
    T, E = routing.n_tokens, routing.n_experts
    F = w_down.shape[2]
    h = np.einsum("td,efd->tef", x, w_gate_up)  # [T, E, 2F]
    act = _silu(h[..., :F]) * h[..., F:]  # [T, E, F]
    y = np.einsum("tef,edf->ted", act, w_down)  # [T, E, D]
    dense_w = np.zeros((T, E))  # [T, E]
    np.put_along_axis(dense_w, routing.topk_ids, routing.topk_weights, axis=1)
    return np.einsum("te,ted->td", dense_w, y)  # [T, D]


def reference_moe_ep_prefill(
    x: np.ndarray,
    routing: Routing,
    w_gate_up: np.ndarray,
    w_down: np.ndarray,
    ep: int,
    allreduce: str = "two_shot",
) -> list[np.ndarray]:
    """Prefill EP through the plan: per rank, select routed tokens (x is replicated), run each local expert's
    GEMM on its rows, accumulate weighted outputs into a [T, D] partial, then all-reduce the partials with the
    ``allreduce`` schedule of :mod:`engine.core.collectives`. Returns each rank's [T, D] output."""
    _check_weights(x, routing, w_gate_up, w_down)
    plan = EpPrefillPlan.build(routing, ep)
    T, D = x.shape
    partials = []
    for r in range(ep):
        partial = np.zeros((T, D))  # [T, D] rank r's combine buffer
        e0 = int(plan.expert_starts[r])
        for le, (toks, slots) in enumerate(zip(plan.expert_token_ids[r], plan.expert_slots[r])):
            if not len(toks):
                continue
            rows = x[toks]  # [rows, D] packed GEMM input
            y = _expert(rows, w_gate_up[e0 + le], w_down[e0 + le])  # [rows, D]
            np.add.at(partial, toks, routing.topk_weights[toks, slots][:, None] * y)
        partials.append(partial)
    sched = collectives.schedule(allreduce, ep, plan.combine_allreduce_elems(D), 8)
    return [o.reshape(T, D) for o in collectives.execute(sched, partials)]


def reference_moe_dp_ep_decode(
    x: np.ndarray,
    routing: Routing,
    w_gate_up: np.ndarray,
    w_down: np.ndarray,
    ep: int,
    dp: int,
    src_rank: Sequence[int] | np.ndarray | None = None,
) -> np.ndarray:
    """Decode DP-EP through the plan: dispatch (each src packs its tokens for each dst, deduplicated), per-expert
    GEMM on the receive buffers, local weighted sum per received token, combine (send back, sum at the source).
    x [T, D] holds every dp rank's tokens in global order; returns the [T, D] outputs in that order."""
    _check_weights(x, routing, w_gate_up, w_down)
    plan = DpEpDecodePlan.build(routing, ep, dp, src_rank)
    T, D = x.shape
    # dispatch: rank d's receive buffer is the concatenation of what every src sent it
    recv = [
        np.concatenate([x[plan.send_token_ids[s][d]] for s in range(dp)]).reshape(-1, D) for d in range(ep)
    ]
    recv_ids = [np.concatenate([plan.send_token_ids[s][d] for s in range(dp)]) for d in range(ep)]  # metadata
    # experts + local combine on each ep rank
    result = []
    for d in range(ep):
        acc = np.zeros_like(recv[d])  # [Tl, D]
        e0 = int(plan.expert_starts[d])
        for le, (rows, slots) in enumerate(zip(plan.expert_rows[d], plan.expert_slots[d])):
            if not len(rows):
                continue
            y = _expert(recv[d][rows], w_gate_up[e0 + le], w_down[e0 + le])  # [rows, D]
            w = routing.topk_weights[recv_ids[d][rows], slots]  # [rows] weights travel with the tokens
            np.add.at(acc, rows, w[:, None] * y)
        result.append(acc)
    # combine: rank d returns segment s of its buffer to src s, which sums over d
    out = np.full((T, D), np.nan)  # [T, D]
    got = np.zeros(T, dtype=bool)
    for s in range(dp):
        mine = np.flatnonzero(plan.src_rank == s)
        acc = np.zeros((T, D))
        for d in range(ep):
            a, b = plan.recv_offsets[d][s], plan.recv_offsets[d][s + 1]
            acc[plan.send_token_ids[s][d]] += result[d][a:b]
        out[mine] = acc[mine]
        got[mine] = True
    assert got.all()
    return out
