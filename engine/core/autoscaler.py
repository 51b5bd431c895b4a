"""Autoscaling policy: how many prefiller and decoder groups a pool of GPUs should run right now.

Pure: :func:`decide` maps an :class:`Observation` to :class:`ScaleTargets`; the scheduler applies the targets
(allocates GPUs from the pool, starts workers that serve after ``scale_up_delay_s``, drains workers it removes).

- Prefillers (the write-up: "the number of prefiller replicas is scaled to the total rate of input tokens so
  requests do not queue"): ``ceil(input_tokens_per_s × headroom / per-replica capacity)``, plus one replica per
  ``backlog_s`` of queued prompt tokens so that a backlog built up before a scale-up drains.
- Decoders ("scaled to keep each one's batch under a threshold"): enough groups that the requests holding
  decoder KV (decoding, queued, in flight) give a mean per-rank batch of at most ``decode_batch_threshold``.
  Scale down only when the mean batch with one group fewer stays below ``scale_down_frac`` × threshold
  (hysteresis, so the policy does not oscillate).
Both are clamped to ``[min_*, max_*]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rackbed.topology.errors import UserError


@dataclass(frozen=True)
class AutoscalerConfig:
    """Policy knobs (seconds, tokens/s, requests per rank)."""

    interval_s: float = 5.0
    scale_up_delay_s: float = 30.0
    prefill_headroom: float = 1.2
    backlog_s: float = 10.0
    decode_batch_threshold: float = 48.0
    scale_down_frac: float = 0.5
    min_prefillers: int = 1
    max_prefillers: int | None = None
    min_decoders: int = 1
    max_decoders: int | None = None

    def __post_init__(self) -> None:
        for name in ("interval_s", "prefill_headroom", "backlog_s", "decode_batch_threshold"):
            if not getattr(self, name) > 0:
                raise UserError(f"autoscaler.{name}: must be > 0, got {getattr(self, name)}")
        if self.scale_up_delay_s < 0:
            raise UserError(f"autoscaler.scale_up_delay_s: must be >= 0, got {self.scale_up_delay_s}")
        if not 0 <= self.scale_down_frac <= 1:
            raise UserError(f"autoscaler.scale_down_frac: must be in [0, 1], got {self.scale_down_frac}")
        for name in ("min_prefillers", "min_decoders"):
            if getattr(self, name) < 0:
                raise UserError(f"autoscaler.{name}: must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class Observation:
    """What the scheduler measured over the last interval.

    input_tokens_per_s:      prompt tokens arrived per second over the last interval.
    queued_prefill_tokens:   prompt tokens routed to prefillers and not yet prefilled.
    prefill_capacity_tokens_per_s: one prefiller replica's sustained prefill rate (full token-budget batches).
    n_prefillers / n_decoders: groups serving or starting (draining ones excluded).
    decode_requests:         requests holding decoder KV (decoding + queued for decode + KV in flight + waiting).
    ranks_per_decoder:       DP ranks per decoder group.
    """

    now_s: float
    input_tokens_per_s: float
    queued_prefill_tokens: int
    prefill_capacity_tokens_per_s: float
    n_prefillers: int
    n_decoders: int
    decode_requests: int
    ranks_per_decoder: int


@dataclass(frozen=True)
class ScaleTargets:
    prefillers: int
    decoders: int


def _clamp(x: int, lo: int, hi: int | None) -> int:
    x = max(x, lo)
    return min(x, hi) if hi is not None else x


def decide(cfg: AutoscalerConfig, obs: Observation) -> ScaleTargets:
    """Target group counts for the observation (see module docstring for the rules)."""
    cap = max(obs.prefill_capacity_tokens_per_s, 1e-9)
    want_p = math.ceil(obs.input_tokens_per_s * cfg.prefill_headroom / cap - 1e-9)
    want_p += math.ceil(obs.queued_prefill_tokens / (cap * cfg.backlog_s) - 1e-9)
    want_p = max(want_p, obs.n_prefillers - 1) if want_p < obs.n_prefillers else want_p  # scale down one at a time

    per_group = cfg.decode_batch_threshold * obs.ranks_per_decoder
    want_d = math.ceil(obs.decode_requests / per_group - 1e-9)
    if want_d < obs.n_decoders:
        fewer = obs.n_decoders - 1
        mean_if_fewer = obs.decode_requests / max(fewer * obs.ranks_per_decoder, 1)
        want_d = fewer if fewer >= 1 and mean_if_fewer < cfg.scale_down_frac * cfg.decode_batch_threshold \
            else obs.n_decoders
    return ScaleTargets(prefillers=_clamp(want_p, cfg.min_prefillers, cfg.max_prefillers),
                        decoders=_clamp(want_d, cfg.min_decoders, cfg.max_decoders))
