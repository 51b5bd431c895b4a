"""A request as the workload produces it: what arrives, not what happens to it.

What happens to it (queued, prefilling, KV in flight, decoding, done/rejected) is tracked by the scheduler in
``RequestState``; this object stays immutable so traces, simulations and real runs can share it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Request:
    """One inference request.

    id:              unique, stable across modes (used as a tie-break everywhere).
    arrival_s:       arrival time in seconds from the start of the run.
    prompt_tokens:   input length (tokens to prefill).
    output_tokens:   tokens to generate (including the first, produced by prefill).
    prefix_hash_ids: ids of 512-token prefix blocks (Mooncake); equal ids mean shareable prefix KV. The
                     scheduler's prefix caches key blocks by them (``engine.core.prefix_cache``).
    """

    id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_hash_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"request {self.id}: prompt_tokens must be >= 1, got {self.prompt_tokens}")
        if self.output_tokens < 1:
            raise ValueError(f"request {self.id}: output_tokens must be >= 1, got {self.output_tokens}")
        if self.arrival_s < 0:
            raise ValueError(f"request {self.id}: arrival_s must be >= 0, got {self.arrival_s}")
