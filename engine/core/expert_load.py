"""Expert load as data: how a decode step's routed token copies fall on the experts, how expert slots are placed
over the EP ranks, and the busiest rank a DP-EP step waits for (pure math; numpy with explicit seeds only).

**Routing distributions** (:class:`ExpertLoadSpec`, a scenario's ``decode.expert_load``):

* ``uniform`` — every expert gets the same share. This is the historical assumption of the cost model, and
  :func:`busiest_rank` returns None for it: the caller keeps its uniform-routing expectations unchanged;
* ``power_law`` — the ``i``-th most popular expert of a layer gets a share proportional to ``i ** -alpha``. Which
  expert is the ``i``-th is a seeded random permutation per MoE layer (hot experts differ from layer to layer and
  are not aligned with the contiguous expert numbering a placement uses). Default exponents per model family
  (:data:`POWER_LAW_ALPHA`) follow published fits of per-expert token counts recorded from serving traffic:
  about 1.2 for Qwen3-235B-A22B and about 1.0 for DeepSeek-R1 (DeepSeek-V3's architecture, hence the family
  default); other families use 1.0;
* ``histogram`` — recorded per-expert weights (a list, or a file of one number per line / a JSON list), the same
  for every layer unless the recording has one row per layer.

A token picks ``top_k`` *distinct* experts, so no expert can take more than ``1 / top_k`` of a layer's copies;
shares above that are capped and the excess spread over the others in proportion (:func:`layer_shares`). At the
default exponents the hottest expert of a layer reaches the cap: every token of the step visits it.

**Placement** (:class:`Placement`): ``n_slots = n_experts + redundant`` slots, ``n_slots / ep`` per rank. The
static placement puts slot ``s`` (expert ``s mod n_experts``: the redundant slots copy experts 0, 1, ...) on rank
``s // (n_slots / ep)``. An expert with ``c`` copies splits its tokens evenly over them.

**EPLB** (:func:`eplb_placement`): from observed per-expert loads, (1) give each redundant slot to the expert
whose per-copy load is then the highest (ties: lowest id), (2) pack the copies, heaviest first, onto the least
loaded rank with a free slot that does not hold that expert yet (longest-processing-time packing under the slot
capacity), (3) renumber the ranks to keep as many experts where they were as possible (ranks are
interchangeable, so this moves fewer weights without changing any rank's load), and (4) keep the current
placement instead when the new one would not lower the busiest rank's observed load. Step (4) makes "a rebalance
never raises the observed busiest load" hold by construction.

**Busiest rank** (:func:`busiest_rank`): the expected token copies on the busiest rank of a step and that rank's
per-slot token counts, averaged over the MoE layers and either (``samples = 0``) the closed form — every expert
at its expected count, the busiest rank of those expectations — or ``samples`` seeded Monte Carlo draws of each
layer's routing (multinomial over the shares; deterministic given the seed, cached). With EPLB, the placement of
each layer is computed from one observation window of ``rebalance_steps`` steps (the counts EPLB would have
seen), the steps are then drawn afresh, and the weights moved per rebalance are counted between two consecutive
windows' placements (zero in the closed form: the observed loads do not change).
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from rackbed.topology.errors import UserError

#: power-law exponent of per-expert load by model-name prefix (module docstring); anything else: DEFAULT_ALPHA
POWER_LAW_ALPHA: dict[str, float] = {"qwen3": 1.2, "deepseek": 1.0, "kimi": 1.0}
DEFAULT_ALPHA = 1.0
DISTS = ("uniform", "power_law", "histogram")


def default_alpha(model_name: str) -> float:
    """The family default exponent for a model name (:data:`POWER_LAW_ALPHA`)."""
    name = model_name.lower()
    for prefix, a in POWER_LAW_ALPHA.items():
        if name.startswith(prefix):
            return a
    return DEFAULT_ALPHA


@dataclass(frozen=True, slots=True)
class ExpertLoadSpec:
    """A routing distribution (module docstring). ``weights``: a recorded histogram, one row (all layers) or one
    row per MoE layer; ``alpha`` None: the model family's default; ``samples``: Monte Carlo draws per layer for
    the expected busiest rank (0: closed form); ``seed``: of the layer permutations and the draws."""

    dist: str = "uniform"
    alpha: float | None = None
    weights: tuple[tuple[float, ...], ...] | None = None
    seed: int = 0
    samples: int = 16

    def __post_init__(self) -> None:
        if self.dist not in DISTS:
            raise UserError(f"expert_load.dist: unknown distribution {self.dist!r}; one of {', '.join(DISTS)}")
        if self.dist == "histogram" and not self.weights:
            raise UserError("expert_load.dist: histogram needs weights (a list of per-expert weights, or a file)")
        if self.dist != "histogram" and self.weights is not None:
            raise UserError(f"expert_load.weights: only with dist: histogram, not {self.dist}")
        if self.alpha is not None and (self.dist != "power_law" or not self.alpha >= 0):
            raise UserError(f"expert_load.alpha: {self.alpha} needs dist: power_law and alpha >= 0")
        if self.samples < 0:
            raise UserError(f"expert_load.samples: {self.samples} must be >= 0")
        for row in self.weights or ():
            if any(not w >= 0 for w in row) or not sum(row) > 0:
                raise UserError("expert_load.weights: weights must be >= 0 with a positive sum")

    @property
    def uniform(self) -> bool:
        return self.dist == "uniform"


@dataclass(frozen=True, slots=True)
class EplbSpec:
    """EPLB (module docstring): ``rebalance_steps`` decode steps between rebalances; the weights a rebalance moves
    are priced by the caller (a stall amortised over those steps)."""

    enabled: bool = False
    rebalance_steps: int = 1000

    def __post_init__(self) -> None:
        if self.rebalance_steps < 1:
            raise UserError(f"eplb.rebalance_steps: {self.rebalance_steps} must be >= 1")


def read_histogram(path: str | Path) -> tuple[tuple[float, ...], ...]:
    """Recorded per-expert weights from a file: a JSON list (one row) or list of lists (one row per MoE layer),
    or plain text with one row per line (numbers separated by spaces or commas). One-line errors."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise UserError(f"expert_load.file: cannot read {p}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except ValueError:
        try:
            data = [[float(x) for x in line.replace(",", " ").split()] for line in text.splitlines() if line.strip()]
        except ValueError:
            raise UserError(f"expert_load.file: {p} is neither JSON nor rows of numbers") from None
        if len(data) > 1 and all(len(r) == 1 for r in data):  # one number per line: one row
            data = [r[0] for r in data]
    if isinstance(data, list) and data and all(isinstance(x, (int, float)) for x in data):
        data = [data]
    if not (isinstance(data, list) and data and all(isinstance(r, list) and r and
                                                   all(isinstance(x, (int, float)) for x in r) for r in data)):
        raise UserError(f"expert_load.file: {p} holds no list of per-expert weights")
    return tuple(tuple(float(x) for x in r) for r in data)


def _cap(p: np.ndarray, cap: float) -> np.ndarray:
    """Shares ``p`` (summing to 1) with none above ``cap``: the excess goes to the uncapped ones in proportion."""
    p = p.astype(float).copy()
    for _ in range(len(p)):
        over = p > cap * (1 + 1e-12)
        if not over.any():
            break
        excess = float((p[over] - cap).sum())
        p[over] = cap
        free = p < cap * (1 - 1e-12)
        room = p[free].sum()
        if room <= 0:
            break
        p[free] += excess * p[free] / room
    return p / p.sum()


def layer_shares(spec: ExpertLoadSpec, n_experts: int, top_k: int, n_layers: int) -> np.ndarray:
    """``(n_layers, n_experts)`` shares of each layer's token copies per expert (module docstring)."""
    if spec.dist == "uniform":
        return np.full((n_layers, n_experts), 1.0 / n_experts)
    if spec.dist == "histogram":
        rows = spec.weights or ()
        if any(len(r) != n_experts for r in rows):
            bad = next(len(r) for r in rows if len(r) != n_experts)
            raise UserError(f"expert_load.weights: {bad} weights for a model of {n_experts} experts")
        if len(rows) != 1 and len(rows) < n_layers:
            raise UserError(f"expert_load.weights: {len(rows)} rows; give one (every layer) or one per MoE layer "
                            f"({n_layers})")
        base = np.array(rows, dtype=float)
        # one row: every layer; one per layer: the first n_layers (a pass over fewer layers, e.g. the MTP module's)
        base = np.repeat(base, n_layers, axis=0) if len(rows) == 1 else base[:n_layers]
    else:
        alpha = spec.alpha if spec.alpha is not None else DEFAULT_ALPHA
        ranked = np.arange(1, n_experts + 1, dtype=float) ** -alpha
        rng = np.random.default_rng([spec.seed, 0x5EED])
        base = np.stack([ranked[np.argsort(rng.permutation(n_experts))] for _ in range(n_layers)])
    cap = 1.0 / top_k if top_k else 1.0
    return np.stack([_cap(r / r.sum(), cap) for r in base])


# ------------------------------------------------------------------------------------------------ placement


@dataclass(frozen=True, slots=True)
class Placement:
    """Which expert each slot of each rank holds: ``ranks[r]`` is rank ``r``'s experts, one per slot."""

    ranks: tuple[tuple[int, ...], ...]

    @property
    def ep(self) -> int:
        return len(self.ranks)

    def slot_array(self) -> np.ndarray:
        return np.array(self.ranks, dtype=np.int64)

    def copies(self, n_experts: int) -> np.ndarray:
        return np.bincount(self.slot_array().ravel(), minlength=n_experts)


def static_placement(n_experts: int, n_slots: int, ep: int) -> Placement:
    """Slot ``s`` holds expert ``s mod n_experts``, slots contiguous per rank (module docstring)."""
    if n_slots < n_experts or n_slots % ep:
        raise UserError(f"{n_slots} expert slots over ep={ep}: need n_slots >= {n_experts} experts and ep | n_slots")
    per = n_slots // ep
    return Placement(tuple(tuple(s % n_experts for s in range(r * per, (r + 1) * per)) for r in range(ep)))


def slot_loads(counts: np.ndarray, placement: Placement) -> np.ndarray:
    """Tokens on each slot, ``(..., ep, slots_per_rank)``, from per-expert ``counts`` ``(..., n_experts)``: an
    expert's tokens split evenly over its copies."""
    counts = np.asarray(counts, dtype=float)
    sa = placement.slot_array()
    copies = placement.copies(counts.shape[-1])
    if (copies == 0).any():
        missing = int(np.flatnonzero(copies == 0)[0])
        raise UserError(f"placement holds no copy of expert {missing}")
    return counts[..., sa] / copies[sa]


def rank_loads(counts: np.ndarray, placement: Placement) -> np.ndarray:
    """Tokens on each rank, ``(..., ep)``."""
    return slot_loads(counts, placement).sum(axis=-1)


def _replicas(loads: np.ndarray, n_slots: int) -> np.ndarray:
    n = len(loads)
    copies = np.ones(n, dtype=np.int64)
    heap = [(-float(loads[e]), e) for e in range(n)]
    heapq.heapify(heap)
    for _ in range(n_slots - n):
        _, e = heapq.heappop(heap)
        copies[e] += 1
        heapq.heappush(heap, (-float(loads[e]) / copies[e], e))
    return copies


def _rank_counts(ranks: Sequence[Sequence[int]], n_experts: int) -> np.ndarray:
    """``(ep, n_experts)``: copies of each expert on each rank."""
    return np.stack([np.bincount(np.asarray(r, dtype=np.int64), minlength=n_experts) for r in ranks])


def _align(new: list[list[int]], old: Placement, n_experts: int) -> list[list[int]]:
    """``new`` with its ranks renumbered to keep experts on the ranks that hold them in ``old`` (greedy on the
    overlap: largest first)."""
    ep = len(new)
    a, b = _rank_counts(new, n_experts), _rank_counts(old.ranks, n_experts)
    overlap = np.minimum(a[:, None, :], b[None, :, :]).sum(axis=-1)
    order = np.argsort(-overlap, axis=None, kind="stable")
    taken_i, taken_j, out = set(), set(), [None] * ep
    for flat in order:
        i, j = divmod(int(flat), ep)
        if i not in taken_i and j not in taken_j:
            taken_i.add(i)
            taken_j.add(j)
            out[j] = new[i]
            if len(taken_i) == ep:
                break
    return out  # type: ignore[return-value]


def eplb_placement(loads: Sequence[float], n_slots: int, ep: int, current: Placement | None = None) -> Placement:
    """EPLB's placement for observed per-expert ``loads`` (module docstring): replicate the hottest experts into
    the redundant slots, pack the copies to ranks heaviest first, renumber ranks to match ``current`` (None: the
    static placement) and keep ``current`` unless the busiest rank's observed load drops."""
    loads = np.asarray(loads, dtype=float)
    n = len(loads)
    cur = current if current is not None else static_placement(n, n_slots, ep)
    per = n_slots // ep
    copies = _replicas(loads, n_slots)
    items = sorted(((-(loads[e] / copies[e]), e) for e in range(n) for _ in range(copies[e])))
    # least-loaded rank with a free slot that does not hold the expert yet (else the least-loaded with a free slot):
    # a heap of (load, rank) over the ranks with free slots
    ranks: list[list[int]] = [[] for _ in range(ep)]
    heap = [(0.0, r) for r in range(ep)]
    for neg, e in items:
        skipped, chosen = [], None
        while heap:
            top = heapq.heappop(heap)
            if e in ranks[top[1]]:
                skipped.append(top)
            else:
                chosen = top
                break
        if chosen is None:
            chosen = min(skipped)
            skipped.remove(chosen)
        for x in skipped:
            heapq.heappush(heap, x)
        load, r = chosen
        ranks[r].append(e)
        if len(ranks[r]) < per:
            heapq.heappush(heap, (load - neg, r))
    new = Placement(tuple(tuple(sorted(r)) for r in _align(ranks, cur, n)))
    if rank_loads(loads, new).max() < rank_loads(loads, cur).max() * (1 - 1e-12):
        return new
    return cur


def moved_experts(old: Placement, new: Placement) -> np.ndarray:
    """Experts each rank of ``new`` receives (holds in ``new`` beyond what it held in ``old``), per rank."""
    n = int(max(max(max(r) for r in old.ranks), max(max(r) for r in new.ranks))) + 1
    return np.maximum(_rank_counts(new.ranks, n) - _rank_counts(old.ranks, n), 0).sum(axis=-1)


# ------------------------------------------------------------------------------------------------ busiest rank


@dataclass(frozen=True, slots=True)
class BusiestRank:
    """The busiest rank of a DP-EP step (module docstring), averaged over MoE layers (and draws).

    ``copies``: token copies routed to it; ``mean_copies``: the mean rank's (``tokens * top_k / ep``);
    ``slot_tokens``: its per-slot token counts, heaviest first, averaged and rounded (a summary); ``slot_hist``:
    what its grouped GEMM sees, ``((tokens, slots), ...)`` — how many of its slots hold each (rounded, nonzero)
    token count, averaged over the layers and draws (the form of ``sim.costs.gemm.binomial_histogram``: the
    expected number of activated slots is kept); ``moved_per_rebalance``: the most expert weights (experts, summed
    over the MoE layers) any rank receives in one rebalance (0 without EPLB)."""

    copies: float
    mean_copies: float
    slot_tokens: tuple[int, ...]
    slot_hist: tuple[tuple[int, float], ...] = ()
    moved_per_rebalance: float = 0.0

    @property
    def scale(self) -> float:
        """Busiest over mean rank load (>= 1)."""
        return self.copies / self.mean_copies if self.mean_copies > 0 else 1.0

    def message_scale(self, top_k: int, ep: int) -> float:
        """Busiest over mean rank's *deduplicated* incoming tokens: a token goes once to a rank however many of
        its ``top_k`` experts the rank holds, so a rank holding a share ``f`` of the copies receives a token with
        probability ``1 - (1 - f) ** top_k`` (``f = 1 / ep`` for the mean rank). At most ``1 / (1 - (1 - 1/ep) **
        top_k)``: the busiest rank cannot receive more than every token; exactly 1 when the busiest is the mean."""
        if self.copies == self.mean_copies or ep <= 1:
            return 1.0
        f = min(1.0, self.copies / (self.mean_copies * ep))
        return (1.0 - (1.0 - f) ** top_k) / (1.0 - (1.0 - 1.0 / ep) ** top_k)


def busiest_rank(spec: ExpertLoadSpec, n_experts: int, top_k: int, n_layers: int, ep: int, n_slots: int,
                 tokens: int, eplb: EplbSpec | None = None) -> BusiestRank | None:
    """The expected busiest rank of a step of ``tokens`` tokens (all DP ranks together) over ``n_layers`` MoE
    layers (module docstring); None for uniform routing (the caller's uniform expectations apply)."""
    if spec.uniform or tokens <= 0 or n_layers <= 0 or not n_experts:
        return None
    return _busiest_cached(spec, n_experts, top_k, n_layers, ep, n_slots, int(tokens),
                           eplb if eplb is not None and eplb.enabled else None)


@lru_cache(maxsize=4096)
def _busiest_cached(spec, n_experts, top_k, n_layers, ep, n_slots, tokens, eplb) -> BusiestRank:
    shares = layer_shares(spec, n_experts, top_k, n_layers)
    copies_total = tokens * top_k
    per = n_slots // ep
    static = static_placement(n_experts, n_slots, ep)
    rng = np.random.default_rng([spec.seed, tokens, n_layers, ep, n_slots])
    busiest, slots_sum = 0.0, np.zeros(per)
    hist: dict[int, float] = {}
    moved = np.zeros(ep)
    n_obs = 0
    for layer in range(n_layers):
        p = shares[layer]
        placement = static
        if eplb is not None:
            if spec.samples:
                window = eplb.rebalance_steps * copies_total
                obs_a = rng.multinomial(window, p).astype(float)
                obs_b = rng.multinomial(window, p).astype(float)
                pa = eplb_placement(obs_a, n_slots, ep, static)
                placement = eplb_placement(obs_b, n_slots, ep, pa)
                moved += moved_experts(pa, placement)
            else:
                placement = eplb_placement(p * copies_total, n_slots, ep, static)
        if spec.samples:
            counts = rng.multinomial(copies_total, p, size=spec.samples).astype(float)
        else:
            counts = (p * copies_total)[None, :]
        sl = slot_loads(counts, placement)            # (draws, ep, per)
        rl = sl.sum(axis=-1)                           # (draws, ep)
        top = rl.argmax(axis=-1)
        rows = sl[np.arange(len(top)), top]            # (draws, per)
        busiest += float(rl.max(axis=-1).sum())
        slots_sum += np.sort(rows, axis=-1)[:, ::-1].sum(axis=0)
        ms, ns = np.unique(np.rint(rows).astype(np.int64), return_counts=True)
        for m, c in zip(ms.tolist(), ns.tolist()):
            if m:
                hist[m] = hist.get(m, 0.0) + c
        n_obs += len(top)
    slot_mean = slots_sum / n_obs
    return BusiestRank(copies=busiest / n_obs, mean_copies=copies_total / ep,
                       slot_tokens=tuple(int(round(x)) for x in slot_mean),
                       slot_hist=tuple(sorted((m, c / n_obs) for m, c in hist.items())),
                       moved_per_rebalance=float(moved.max()) if eplb is not None else 0.0)


__all__ = [
    "DEFAULT_ALPHA", "DISTS", "POWER_LAW_ALPHA", "BusiestRank", "EplbSpec", "ExpertLoadSpec", "Placement",
    "busiest_rank", "default_alpha", "eplb_placement", "layer_shares", "moved_experts", "rank_loads",
    "read_histogram", "slot_loads", "static_placement",
]
