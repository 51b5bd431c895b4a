"""Workloads: seeded synthetic request streams and trace replay, producing ``Request`` objects.

Specs are frozen pydantic models (``extra="forbid"``) with a ``kind`` discriminator, so a scenario YAML can say::

    workload:
      kind: synthetic                     # or: trace, sessions
      arrival: {kind: gamma, rate_per_s: 20, cv: 3}
      prompt: {kind: lognormal, p50: 2000, p90: 8000, max_tokens: 32768}
      output: {kind: uniform, lo: 100, hi: 600}
      duration_s: 600
      seed: 7

A ``sessions`` workload (:class:`Sessions`) generates multi-turn sessions whose prompts grow by the turns before
them, with prefix block ids; its stream is made in :mod:`engine.core.sessions`.

Two forms, one stream: :func:`iter_requests` yields lazily (vectorised numpy in chunks of ``CHUNK`` requests,
``Request`` objects made one at a time), :func:`generate` is exactly ``list(iter_requests(...))``. Requests come
sorted by ``(arrival_s, id)`` with ids ``0..n-1``.

Randomness (synthetic only; a replay is deterministic): the seed (``spec.seed`` unless an int or a numpy
``Generator`` is passed) is split into three independent streams -- arrivals, prompt lengths, output lengths --
so changing a length distribution does not move the arrival times. Draws are made in full chunks of ``CHUNK``
and truncated, so the requests of ``n_requests=N`` are the first N of any longer run with the same seed, and a
``duration_s`` cut is a prefix of the same stream.

Arrivals (synthetic): request 0 arrives at 0.0; request k at the sum of the first k inter-arrival gaps
(``Constant``: exactly ``k / rate_per_s``). With both ``n_requests`` and ``duration_s`` the stream stops at
whichever comes first; requests arriving at ``>= duration_s`` are dropped.

Token counts are always >= 1 (a ``Request`` needs it): a trace row with 0 tokens is raised to 1 and counted
(``n_prompt_zero_to_1`` / ``n_output_zero_to_1`` in :attr:`RequestStream.counters` and in :class:`WorkloadStats`).
Neither the Azure 2023 traces nor the Mooncake conversation trace has such rows (full or trimmed; the smallest
prompt is 2 tokens, the smallest output 1), but other traces may.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Annotated, Any, Literal, NamedTuple

import numpy as np
from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from rackbed.engine.core.request import Request
from rackbed.engine.core.traces import MAX_TOKENS, TRACE_FILES, Trace, TraceFormat, load_trace, resolve_trace
from rackbed.topology.errors import NoBoolNumbers, UserError, from_validation

#: Requests drawn per vectorised step. Part of the definition of a seeded stream: changing it changes outputs.
CHUNK = 4096

_Z90 = 1.2815515655446004  # standard normal 90th percentile

PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
PositiveInt = Annotated[int, Field(ge=1)]

#: bounds that keep a typo from exhausting memory or running for days: ``MAX_TOKENS`` per request
#: (:mod:`engine.core.traces`), and 10 million requests, about an hour at 3,000 requests/s
MAX_REQUESTS = 10_000_000


def _at_most(bound: int, unit: str, why: str):
    def check(v: int) -> int:
        if v > bound:
            raise ValueError(f"at most {bound:,} {unit} ({why}), got {v:,}")
        return v
    return AfterValidator(check)


TokenCount = Annotated[int, Field(ge=1), _at_most(MAX_TOKENS, "tokens", "beyond any supported model's context")]
RequestCount = Annotated[int, Field(ge=1), _at_most(MAX_REQUESTS, "requests", "a generous bound on one run")]


class _Spec(NoBoolNumbers):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------------------------------------------- arrivals


class Poisson(_Spec):
    """Poisson arrivals: exponential inter-arrival gaps with mean ``1 / rate_per_s`` seconds (cv = 1)."""

    kind: Literal["poisson"] = "poisson"
    rate_per_s: PositiveFloat

    def gaps_s(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """(n,) float64 inter-arrival gaps in seconds."""
        return rng.exponential(1.0 / self.rate_per_s, n)


class GammaBursty(_Spec):
    """Bursty arrivals: gamma inter-arrival gaps with mean ``1 / rate_per_s`` s and coefficient of variation ``cv``.

    Shape ``k = 1 / cv**2``, scale ``1 / (rate_per_s * k)``; cv = 1 is Poisson, cv > 1 bursty, cv < 1 smoother.
    """

    kind: Literal["gamma"] = "gamma"
    rate_per_s: PositiveFloat
    cv: PositiveFloat

    def gaps_s(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """(n,) float64 inter-arrival gaps in seconds."""
        shape = 1.0 / (self.cv * self.cv)
        return rng.gamma(shape, 1.0 / (self.rate_per_s * shape), n)


class Constant(_Spec):
    """Evenly spaced arrivals: request k at exactly ``k / rate_per_s`` seconds."""

    kind: Literal["constant"] = "constant"
    rate_per_s: PositiveFloat


class Immediate(_Spec):
    """Every request at time 0: with ``max_concurrency``, a pure closed loop (``--request-rate inf``)."""

    kind: Literal["immediate"] = "immediate"

    def gaps_s(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """(n,) zeros."""
        return np.zeros(n)


Arrival = Annotated[Poisson | GammaBursty | Constant | Immediate, Field(discriminator="kind")]


# ---------------------------------------------------------------------------------------------------- lengths


class Fixed(_Spec):
    """Every request has exactly ``tokens`` tokens."""

    kind: Literal["fixed"] = "fixed"
    tokens: TokenCount

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """(n,) int64 token counts."""
        return np.full(n, self.tokens, dtype=np.int64)


class Uniform(_Spec):
    """Integer token counts uniform on ``[lo, hi]`` (both ends included)."""

    kind: Literal["uniform"] = "uniform"
    lo: TokenCount
    hi: TokenCount

    @model_validator(mode="after")
    def _order(self) -> Uniform:
        if self.hi < self.lo:
            raise ValueError(f"hi must be >= lo, got lo={self.lo} hi={self.hi}")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """(n,) int64 token counts."""
        return rng.integers(self.lo, self.hi, size=n, endpoint=True, dtype=np.int64)


class LogNormal(_Spec):
    """Log-normal token counts, rounded to the nearest integer and clipped to ``[min_tokens, max_tokens]``.

    Give either ``mean`` (of the token count, not of its log) and ``sigma`` (standard deviation of ln tokens):
    ``mu = ln(mean) - sigma**2 / 2``; or the median ``p50`` and 90th percentile ``p90``:
    ``mu = ln(p50)``, ``sigma = ln(p90 / p50) / 1.2816``. Rounding and clipping shift the realised mean slightly.
    """

    kind: Literal["lognormal"] = "lognormal"
    mean: PositiveFloat | None = None
    sigma: NonNegFloat | None = None
    p50: PositiveFloat | None = None
    p90: PositiveFloat | None = None
    min_tokens: TokenCount = 1
    max_tokens: TokenCount | None = None

    @model_validator(mode="after")
    def _params(self) -> LogNormal:
        by_mean = self.mean is not None or self.sigma is not None
        by_pct = self.p50 is not None or self.p90 is not None
        if by_mean == by_pct:
            raise ValueError("give either mean and sigma, or p50 and p90")
        if by_mean and (self.mean is None or self.sigma is None):
            raise ValueError("mean and sigma go together")
        for name in ("mean", "p50", "p90"):
            if (getattr(self, name) or 0) > MAX_TOKENS:
                raise ValueError(f"{name}: at most {MAX_TOKENS:,} tokens (beyond any supported model's context), "
                                 f"got {getattr(self, name):g}")
        if by_pct:
            if self.p50 is None or self.p90 is None:
                raise ValueError("p50 and p90 go together")
            if self.p90 <= self.p50:
                raise ValueError(f"p90 must be > p50, got p50={self.p50} p90={self.p90}")
        if self.max_tokens is not None and self.max_tokens < self.min_tokens:
            raise ValueError(f"max_tokens must be >= min_tokens, got {self.max_tokens} < {self.min_tokens}")
        return self

    @property
    def mu_sigma(self) -> tuple[float, float]:
        """(mu, sigma) of ln(tokens)."""
        if self.p50 is not None and self.p90 is not None:
            return math.log(self.p50), math.log(self.p90 / self.p50) / _Z90
        assert self.mean is not None and self.sigma is not None
        return math.log(self.mean) - 0.5 * self.sigma**2, self.sigma

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """(n,) int64 token counts."""
        mu, sigma = self.mu_sigma
        hi = float(self.max_tokens) if self.max_tokens is not None else 2.0**62
        x = np.clip(np.rint(rng.lognormal(mu, sigma, n)), self.min_tokens, hi)
        return x.astype(np.int64)


class Empirical(_Spec):
    """Token counts drawn uniformly with replacement from observed values.

    The values are either given (``values``) or one column of a trace (``name`` of a shipped trace or ``path``;
    ``column`` = ``"prompt"`` or ``"output"``). A 0 in a trace counts as 1 (see the module docstring).
    """

    kind: Literal["empirical"] = "empirical"
    values: tuple[TokenCount, ...] | None = None
    name: str | None = None
    path: str | None = None
    column: Literal["prompt", "output"] = "prompt"
    format: TraceFormat = "auto"

    @model_validator(mode="after")
    def _source(self) -> Empirical:
        given = [k for k in ("values", "name", "path") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of values, name, path (got {', '.join(given) or 'none'})")
        if self.values is not None and len(self.values) == 0:
            raise ValueError("values must not be empty")
        _check_trace_name(self.name)
        return self

    def pool(self) -> np.ndarray:
        """(m,) int64 values to draw from (loads the trace; raises UserError for a missing/bad file)."""
        if self.values is not None:
            return np.asarray(self.values, dtype=np.int64)
        trace = load_trace(resolve_trace(self.path, self.name), self.format)
        col = trace.prompt_tokens if self.column == "prompt" else trace.output_tokens
        return np.maximum(col, 1)

    def sample(self, rng: np.random.Generator, n: int, pool: np.ndarray | None = None) -> np.ndarray:
        """(n,) int64 token counts (``pool`` = a cached :meth:`pool`)."""
        pool = self.pool() if pool is None else pool
        return pool[rng.integers(0, pool.shape[0], size=n)]


LengthDist = Annotated[Fixed | Uniform | LogNormal | Empirical, Field(discriminator="kind")]


def _check_trace_name(name: str | None) -> None:
    if name is not None and name not in TRACE_FILES:
        raise ValueError(f"unknown trace name {name!r}; known: {', '.join(sorted(TRACE_FILES))}")


# ---------------------------------------------------------------------------------------------------- workloads


class ClosedLoop(NamedTuple):
    """At most ``max_concurrency`` requests in flight (sent, not yet done or rejected), as ``vllm bench serve
    --max-concurrency`` sends them. The next request of the stream is sent when there is room: at its own arrival
    time if ``paced``, else at once (a pure closed loop: the first C at time 0, then one each time one finishes);
    its ``arrival_s`` becomes the send time. With ``until_s``, nothing is sent at or after it. The run loop
    (``engine.loop.runloop``) applies it, for the simulated and the measured clock alike."""

    max_concurrency: int
    paced: bool
    until_s: float | None


class _Workload(_Spec):
    """Fields every workload kind has: the closed loop (:class:`ClosedLoop`)."""

    #: closed loop: at most this many requests in flight (None: open loop, every request at its arrival time)
    max_concurrency: PositiveInt | None = None
    #: with max_concurrency: send each request no earlier than its arrival time (else as soon as there is room)
    paced: bool = False

    def closed_loop(self) -> ClosedLoop | None:
        """The run loop's :class:`ClosedLoop` (None for an open loop); ``duration_s`` also ends the sending."""
        if self.max_concurrency is None:
            return None
        return ClosedLoop(self.max_concurrency, self.paced, getattr(self, "duration_s", None))


class Synthetic(_Workload):
    """Generated requests: arrivals from ``arrival``, lengths from ``prompt`` / ``output``.

    Stops after ``n_requests`` or at ``duration_s`` (arrivals ``>= duration_s`` dropped), whichever is first;
    at least one is required.
    """

    kind: Literal["synthetic"] = "synthetic"
    arrival: Arrival
    prompt: LengthDist
    output: LengthDist
    n_requests: RequestCount | None = None
    duration_s: PositiveFloat | None = None
    seed: Annotated[int, Field(ge=0)] = 0

    @model_validator(mode="after")
    def _bounded(self) -> Synthetic:
        if self.n_requests is None and self.duration_s is None:
            raise ValueError("give n_requests or duration_s (or both)")
        if isinstance(self.arrival, Immediate) and self.n_requests is None:
            raise ValueError("arrival: immediate needs n_requests (every request arrives at time 0)")
        return self


class TraceReplay(_Workload):
    """Replay a trace file, optionally sped up, windowed, clipped and looped.

    Precisely, with ``a_i`` = seconds of request i since the first request of the file (:class:`Trace`):

    1. Window: keep requests with ``a_i >= start_s``; ``r_i = a_i - start_s`` (trace seconds).
    2. Speed: ``arrival_s = r_i / time_scale``. ``time_scale=2`` halves every gap, i.e. twice the request
       rate; lengths are unchanged. Instead of ``time_scale`` one may give ``rate_per_s``: then
       ``time_scale = rate_per_s * g``, where ``g = (r_last - r_first) / (m - 1)`` is the mean inter-arrival
       gap of the m requests in the window, so the replayed mean gap is exactly ``1 / rate_per_s``.
       Neither given: ``time_scale = 1``.
    3. Loop (``loop: true``): pass k (k = 0, 1, ...) replays the window at ``(r_i + k * P) / time_scale`` with
       period ``P = r_last + g`` (the seam gap is one mean gap plus the lead-in before the first request). Prefix
       block ids of pass k are shifted by ``k * (max_id + 1)`` so a repeat does not hit the prefix cache of the
       pass before. Needs ``duration_s`` or ``max_requests``.
    4. Cut on the replayed clock: drop arrivals ``>= duration_s``; keep at most ``max_requests``.
    5. Lengths: a 0 becomes 1 (counted); then clip to ``max_prompt_tokens`` / ``max_output_tokens`` (counted as
       ``n_prompt_clipped`` / ``n_output_clipped``).

    ``path`` is used as given (relative to the working directory); ``name`` picks a shipped trimmed trace
    (``mooncake``, ``azure-conv``, ``azure-code``; see ``engine/core/data/TRACES.md``).
    """

    kind: Literal["trace"] = "trace"
    path: str | None = None
    name: str | None = None
    format: TraceFormat = "auto"
    time_scale: PositiveFloat | None = None
    rate_per_s: PositiveFloat | None = None
    start_s: NonNegFloat = 0.0
    duration_s: PositiveFloat | None = None
    max_requests: RequestCount | None = None
    max_prompt_tokens: TokenCount | None = None
    max_output_tokens: TokenCount | None = None
    loop: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> TraceReplay:
        if (self.path is None) == (self.name is None):
            raise ValueError("give exactly one of path or name")
        _check_trace_name(self.name)
        if self.time_scale is not None and self.rate_per_s is not None:
            raise ValueError("give time_scale or rate_per_s, not both")
        if self.loop and self.duration_s is None and self.max_requests is None:
            raise ValueError("loop: true needs duration_s or max_requests")
        return self


# ---------------------------------------------------------------------------------------------------- sessions


class FixedTime(_Spec):
    """Exactly ``s`` seconds."""

    kind: Literal["fixed"] = "fixed"
    s: NonNegFloat

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """(n,) float64 seconds."""
        return np.full(n, self.s)


class ExponentialTime(_Spec):
    """Exponentially distributed seconds with mean ``mean_s`` (memoryless: a user who may come back any time)."""

    kind: Literal["exponential"] = "exponential"
    mean_s: PositiveFloat

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """(n,) float64 seconds."""
        return rng.exponential(self.mean_s, n)


class LogNormalTime(_Spec):
    """Log-normal seconds with median ``p50_s`` and 90th percentile ``p90_s`` (a long tail of slow readers)."""

    kind: Literal["lognormal"] = "lognormal"
    p50_s: PositiveFloat
    p90_s: PositiveFloat

    @model_validator(mode="after")
    def _order(self) -> LogNormalTime:
        if self.p90_s <= self.p50_s:
            raise ValueError(f"p90_s must be > p50_s, got p50_s={self.p50_s} p90_s={self.p90_s}")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """(n,) float64 seconds."""
        return rng.lognormal(math.log(self.p50_s), math.log(self.p90_s / self.p50_s) / _Z90, n)


TimeDist = Annotated[FixedTime | ExponentialTime | LogNormalTime, Field(discriminator="kind")]

#: the most turns one session may have: a bound that keeps a typo in ``turns`` from building one endless session
#: (agent runs of a few hundred tool calls fit)
MAX_TURNS = 1000


def _turns_bound(dist: Any) -> int | None:
    """The most turns a ``turns`` distribution can draw; None if unbounded or drawn from a trace column."""
    if isinstance(dist, Fixed):
        return dist.tokens
    if isinstance(dist, Uniform):
        return dist.hi
    if isinstance(dist, LogNormal):
        return dist.max_tokens
    if isinstance(dist, Empirical) and dist.values is not None:
        return max(dist.values)
    return None


class Sessions(_Workload):
    """Multi-turn sessions (chat, or an agent's tool calls) whose prompts grow by the turns before them.

    Sessions arrive by ``arrival`` (its ``rate_per_s`` is sessions per second; poisson, gamma or constant). Each
    session picks one of ``system_prompts`` shared system prompts (uniformly; their lengths are drawn once from
    ``system_prompt``, none without it) and draws ``turns`` turns. Turn k appends ``input`` new tokens (``first_input``
    for the first turn when given: a task, a document; later ``input`` is a user message or a tool's output) and
    generates ``output`` tokens; its prompt is everything before plus the new input::

        prompt_1 = system + input_1        prompt_{k+1} = prompt_k + output_k + input_{k+1}

    Timing (a generator cannot know when a turn completes): turn k+1 arrives ``assumed_ttft_s + (output_k - 1) *
    assumed_tpot_s + think`` after turn k, i.e. after the turn's *assumed* service time and a ``think`` time (a
    user reading and typing; a tool running). When the served system is slower than assumed, the next turn may
    arrive before the previous one is done, which a real client would not do.

    A session ends after its last turn, or before the first turn whose prompt exceeds ``max_prompt_tokens``
    (counted as ``n_sessions_cut``). The stream stops after ``n_requests`` requests (turns) or at ``duration_s``
    (turns arriving later are dropped), whichever is first. Prefix block ids: :mod:`engine.core.sessions`.
    """

    kind: Literal["sessions"] = "sessions"
    arrival: Annotated[Poisson | GammaBursty | Constant, Field(discriminator="kind")]
    turns: LengthDist
    system_prompts: Annotated[int, Field(ge=1, le=100_000)] = 1
    system_prompt: LengthDist | None = None
    first_input: LengthDist | None = None
    input: LengthDist
    output: LengthDist
    think: TimeDist
    assumed_ttft_s: NonNegFloat = 0.5
    assumed_tpot_s: NonNegFloat = 0.03
    max_prompt_tokens: TokenCount | None = None
    n_requests: RequestCount | None = None
    duration_s: PositiveFloat | None = None
    seed: Annotated[int, Field(ge=0)] = 0

    @model_validator(mode="after")
    def _bounded(self) -> Sessions:
        if self.n_requests is None and self.duration_s is None:
            raise ValueError("give n_requests or duration_s (or both)")
        bound = _turns_bound(self.turns)
        if bound is None:
            raise ValueError(f"turns: must be bounded: fixed, uniform, lognormal with max_tokens, or empirical "
                             f"values (at most {MAX_TURNS:,})")
        if bound > MAX_TURNS:
            raise ValueError(f"turns: at most {MAX_TURNS:,} turns per session, got up to {bound:,}")
        return self


WorkloadSpec = Annotated[Synthetic | TraceReplay | Sessions, Field(discriminator="kind")]
_WORKLOAD_ADAPTER: TypeAdapter[Synthetic | TraceReplay | Sessions] = TypeAdapter(WorkloadSpec)


def parse_workload(data: Mapping[str, Any], source: str | None = None) -> Synthetic | TraceReplay | Sessions:
    """Build a workload spec from plain data (e.g. YAML); a bad field -> one-line ``UserError``."""
    try:
        return _WORKLOAD_ADAPTER.validate_python(data)
    except ValidationError as exc:
        raise from_validation(exc, source) from None


# ---------------------------------------------------------------------------------------------------- streams

_COUNTER_KEYS = (
    "n_prompt_zero_to_1",
    "n_output_zero_to_1",
    "n_prompt_clipped",
    "n_output_clipped",
    "n_passes",
)


class RequestStream(Iterator[Request]):
    """Lazy iterator of the requests of a workload spec; ``counters`` grow as requests are produced.

    Counters are updated per chunk (up to ``CHUNK`` requests) when it is made, so they are exact once the stream
    is exhausted (``generate``, ``to_list``, ``describe(stream)``) and may run ahead while it is half-read.

    counters: ``n_prompt_zero_to_1`` / ``n_output_zero_to_1`` (trace zeros raised to 1), ``n_prompt_clipped`` /
    ``n_output_clipped`` (cut to ``max_*_tokens``), ``n_passes`` (trace passes with at least one request produced,
    0 for synthetic); a sessions stream adds ``n_sessions``, ``n_sessions_cut``, ``n_sessions_empty``
    (:func:`engine.core.sessions.iter_session_turns`; they grow request by request).
    Setup (loading traces, checking the window) happens on construction, so errors surface before iterating.
    """

    def __init__(self, spec: Synthetic | TraceReplay | Sessions, rng: np.random.Generator | int | None = None) -> None:
        self.spec = spec
        self.counters: dict[str, int] = dict.fromkeys(_COUNTER_KEYS, 0)
        if isinstance(spec, Synthetic):
            pools = {
                key: (d.pool() if isinstance(d, Empirical) else None)
                for key, d in (("prompt", spec.prompt), ("output", spec.output))
            }
            self._chunks = self._synthetic_chunks(spec, _split_rng(spec.seed if rng is None else rng), pools)
        elif isinstance(spec, TraceReplay):
            self._chunks = self._replay_chunks(spec, _ReplayPlan(spec))
        elif isinstance(spec, Sessions):
            from rackbed.engine.core.sessions import COUNTER_KEYS, iter_session_turns

            self.counters.update(dict.fromkeys(COUNTER_KEYS, 0))
            pools = {key: d.pool() for key in ("turns", "system_prompt", "first_input", "input", "output")
                     if isinstance(d := getattr(spec, key), Empirical)}
            turns = iter_session_turns(spec, rng, pools, self.counters)
            self._chunks = iter([(t.request for t in turns)])
        else:
            raise TypeError(f"not a workload spec: {type(spec).__name__}")
        self._requests: Iterator[Request] = itertools.chain.from_iterable(self._chunks)

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> Request:
        return next(self._requests)

    def to_list(self) -> list[Request]:
        """The remaining requests (same as ``list(self)``, without the per-item ``__next__`` call)."""
        return list(self._requests)

    # Each chunk generator yields iterators of Request; the next request id is len(produced so far).

    def _synthetic_chunks(
        self, spec: Synthetic, rngs: tuple[np.random.Generator, ...], pools: dict[str, np.ndarray | None]
    ) -> Iterator[Iterator[Request]]:
        rng_arr, rng_p, rng_o = rngs
        limit = spec.n_requests if spec.n_requests is not None else math.inf
        next_id = 0
        t_next_s = 0.0
        while next_id < limit:
            # arrivals of requests next_id .. next_id+CHUNK-1
            if isinstance(spec.arrival, Constant):
                arrival_s = np.arange(next_id, next_id + CHUNK, dtype=np.float64) / spec.arrival.rate_per_s
            else:
                gaps_s = spec.arrival.gaps_s(rng_arr, CHUNK)
                arrival_s = np.empty(CHUNK)
                arrival_s[0] = 0.0
                np.cumsum(gaps_s[:-1], out=arrival_s[1:])
                arrival_s += t_next_s
                t_next_s = float(arrival_s[-1] + gaps_s[-1])
            prompt = _sample(spec.prompt, rng_p, CHUNK, pools["prompt"])
            output = _sample(spec.output, rng_o, CHUNK, pools["output"])
            n = CHUNK if limit == math.inf else min(CHUNK, int(limit) - next_id)
            if spec.duration_s is not None:
                n = min(n, int(np.searchsorted(arrival_s, spec.duration_s, side="left")))
            if n > 0:
                yield _make_requests(next_id, arrival_s[:n], prompt[:n], output[:n], None)
            next_id += n
            if n < CHUNK:
                return

    def _replay_chunks(self, spec: TraceReplay, plan: _ReplayPlan) -> Iterator[Iterator[Request]]:
        c = self.counters
        limit = spec.max_requests if spec.max_requests is not None else math.inf
        next_id = 0
        k = 0
        while True:
            for lo in range(0, plan.m, CHUNK):
                hi = min(lo + CHUNK, plan.m)
                if k == 0:
                    arrival_s = plan.r_s[lo:hi] / plan.time_scale
                else:
                    arrival_s = (plan.r_s[lo:hi] + k * plan.period_s) / plan.time_scale
                n = hi - lo
                if limit != math.inf:
                    n = min(n, int(limit) - next_id)
                if spec.duration_s is not None:
                    n = min(n, int(np.searchsorted(arrival_s, spec.duration_s, side="left")))
                prompt = plan.prompt[lo : lo + n]
                output = plan.output[lo : lo + n]
                c["n_prompt_zero_to_1"] += int(np.count_nonzero(prompt == 0))
                c["n_output_zero_to_1"] += int(np.count_nonzero(output == 0))
                prompt = np.maximum(prompt, 1)
                output = np.maximum(output, 1)
                if spec.max_prompt_tokens is not None:
                    c["n_prompt_clipped"] += int(np.count_nonzero(prompt > spec.max_prompt_tokens))
                    prompt = np.minimum(prompt, spec.max_prompt_tokens)
                if spec.max_output_tokens is not None:
                    c["n_output_clipped"] += int(np.count_nonzero(output > spec.max_output_tokens))
                    output = np.minimum(output, spec.max_output_tokens)
                hashes = plan.hashes[lo : lo + n]
                if k > 0 and plan.hash_shift > 0:
                    shift = k * plan.hash_shift
                    hashes = [tuple(h + shift for h in ids) for ids in hashes]
                if n > 0:
                    if lo == 0:
                        c["n_passes"] += 1
                    yield _make_requests(next_id, arrival_s[:n], prompt, output, hashes)
                next_id += n
                if n < hi - lo:
                    return
            if not spec.loop:
                return
            k += 1


class _ReplayPlan:
    """The window of a trace and the derived time scale and loop period (see ``TraceReplay``)."""

    def __init__(self, spec: TraceReplay) -> None:
        path = resolve_trace(spec.path, spec.name)
        trace: Trace = load_trace(path, spec.format)
        first = int(np.searchsorted(trace.arrival_s, spec.start_s, side="left"))
        self.m = len(trace) - first
        if self.m == 0:
            raise UserError(
                f"{path}: start_s={spec.start_s} is past the last request of the trace "
                f"(at {trace.arrival_s[-1]:.3f} s)"
            )
        self.r_s = trace.arrival_s[first:] - spec.start_s if spec.start_s else trace.arrival_s[first:]
        self.prompt = trace.prompt_tokens[first:]
        self.output = trace.output_tokens[first:]
        self.hashes = trace.prefix_hash_ids[first:]
        self.hash_shift = trace.max_hash_id + 1
        span_s = float(self.r_s[-1] - self.r_s[0])
        needs_gap = spec.rate_per_s is not None or spec.loop
        if needs_gap and (self.m < 2 or span_s <= 0):
            what = "rate_per_s" if spec.rate_per_s is not None else "loop"
            raise UserError(f"{path}: {what} needs at least 2 requests at different times after start_s")
        gap_s = span_s / (self.m - 1) if self.m > 1 else 0.0
        if spec.rate_per_s is not None:
            self.time_scale = spec.rate_per_s * gap_s
        else:
            self.time_scale = spec.time_scale if spec.time_scale is not None else 1.0
        self.period_s = float(self.r_s[-1]) + gap_s


def _split_rng(rng: np.random.Generator | int) -> tuple[np.random.Generator, ...]:
    """Three independent generators (arrivals, prompt, output) from a seed or a Generator."""
    if isinstance(rng, np.random.Generator):
        return tuple(rng.spawn(3))
    if isinstance(rng, bool) or not isinstance(rng, int | np.integer) or rng < 0:
        raise UserError(f"seed must be an integer >= 0 or a numpy Generator, got {rng!r}")
    return tuple(np.random.default_rng(s) for s in np.random.SeedSequence(int(rng)).spawn(3))


def _sample(dist: Any, rng: np.random.Generator, n: int, pool: np.ndarray | None) -> np.ndarray:
    if isinstance(dist, Empirical):
        return dist.sample(rng, n, pool)
    return dist.sample(rng, n)


def _make_requests(
    first_id: int,
    arrival_s: np.ndarray,
    prompt: np.ndarray,
    output: np.ndarray,
    hashes: Iterable[tuple[int, ...]] | None,
) -> Iterator[Request]:
    """Requests ``first_id, first_id+1, ...`` from (n,) arrays; numpy values become Python floats/ints."""
    ids = range(first_id, first_id + len(arrival_s))
    a, p, o = arrival_s.tolist(), prompt.tolist(), output.tolist()
    if hashes is None:
        return map(Request, ids, a, p, o)
    return map(Request, ids, a, p, o, hashes)


def iter_requests(
    spec: Synthetic | TraceReplay | Sessions, rng: np.random.Generator | int | None = None
) -> RequestStream:
    """Lazy requests of ``spec``; ``rng`` (seed or Generator) overrides ``spec.seed``; ignored by a replay."""
    return RequestStream(spec, rng)


def generate(spec: Synthetic | TraceReplay | Sessions, rng: np.random.Generator | int | None = None) -> list[Request]:
    """All requests of ``spec``: exactly ``list(iter_requests(spec, rng))``."""
    return iter_requests(spec, rng).to_list()


# ---------------------------------------------------------------------------------------------------- stats


@dataclass(frozen=True)
class WorkloadStats:
    """Summary of a request list. Token percentiles use numpy's default (linear interpolation).

    duration_s:       last arrival - first arrival (0 for fewer than 2 requests).
    mean_rate_per_s:  (count - 1) / duration_s = 1 / mean inter-arrival gap (0 if duration_s is 0).
    input_tokens_per_s / output_tokens_per_s: mean_rate_per_s * mean prompt / output tokens.
    n_*: the stream counters (see ``RequestStream``), 0 when not known.
    An empty list gives all zeros.
    """

    count: int
    duration_s: float
    mean_rate_per_s: float
    prompt_tokens_mean: float
    prompt_tokens_p50: float
    prompt_tokens_p90: float
    prompt_tokens_p99: float
    output_tokens_mean: float
    output_tokens_p50: float
    output_tokens_p90: float
    output_tokens_p99: float
    input_tokens_per_s: float
    output_tokens_per_s: float
    n_prompt_zero_to_1: int = 0
    n_output_zero_to_1: int = 0
    n_prompt_clipped: int = 0
    n_output_clipped: int = 0
    n_passes: int = 0

    @classmethod
    def from_requests(
        cls, requests: Iterable[Request], counters: Mapping[str, int] | None = None
    ) -> WorkloadStats:
        """Stats of ``requests`` (a list, or a ``RequestStream``, which is consumed and supplies counters)."""
        if isinstance(requests, list):
            reqs = requests
        elif isinstance(requests, RequestStream):
            reqs = requests.to_list()
        else:
            reqs = list(requests)
        if counters is None and isinstance(requests, RequestStream):
            counters = requests.counters
        extra = {k: int(v) for k, v in (counters or {}).items() if k in _COUNTER_KEYS}
        n = len(reqs)
        if n == 0:
            zeros = {f: 0.0 for f in cls.__dataclass_fields__ if f not in _COUNTER_KEYS and f != "count"}
            return cls(count=0, **zeros, **extra)
        arrival_s = np.fromiter((r.arrival_s for r in reqs), dtype=np.float64, count=n)
        prompt = np.fromiter((r.prompt_tokens for r in reqs), dtype=np.int64, count=n)
        output = np.fromiter((r.output_tokens for r in reqs), dtype=np.int64, count=n)
        duration_s = float(arrival_s.max() - arrival_s.min())
        rate = (n - 1) / duration_s if duration_s > 0 else 0.0
        pp = np.percentile(prompt, [50, 90, 99])
        op = np.percentile(output, [50, 90, 99])
        return cls(
            count=n,
            duration_s=duration_s,
            mean_rate_per_s=rate,
            prompt_tokens_mean=float(prompt.mean()),
            prompt_tokens_p50=float(pp[0]),
            prompt_tokens_p90=float(pp[1]),
            prompt_tokens_p99=float(pp[2]),
            output_tokens_mean=float(output.mean()),
            output_tokens_p50=float(op[0]),
            output_tokens_p90=float(op[1]),
            output_tokens_p99=float(op[2]),
            input_tokens_per_s=rate * float(prompt.mean()),
            output_tokens_per_s=rate * float(output.mean()),
            **extra,
        )

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def describe(
    requests: Iterable[Request], counters: Mapping[str, int] | None = None
) -> dict[str, float | int]:
    """``WorkloadStats.from_requests(requests, counters).as_dict()``."""
    return WorkloadStats.from_requests(requests, counters).as_dict()
