"""``rackbed bench kernels``: a registry of kernel benchmark suites, run on the local GPUs (the command is the entry;
this module has no ``__main__``, so the kernels do not import the CLI).

A suite is a function ``run(cfg: BenchConfig) -> dict`` registered with ``@register_suite(name, ...)``; the dict
holds at least ``rows`` (one per measurement, each with ``impl``, ``size_bytes``, ``graph``, ``median_us``) and
``meta`` (device, driver, versions, date). ``run_suites`` runs the chosen suites, prints each suite's table
(``table(result)``) and writes one JSON file ``{"suites": {name: result}}``. A suite in another module
registers on import; ``load_suites`` imports those modules (:mod:`kernels.bench.moe`, which imports
:mod:`kernels.bench.moe_prefill`).

Suites:
  allreduce   peer-memory all-reduce (kernels/allreduce.py) vs NCCL and torch symm_mem, bf16 (+ fp32),
              8 KiB .. 128 MiB, with and without CUDA graphs; needs >= 2 GPUs (one process per GPU).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

from rackbed.kernels.allreduce_schedule import sizes_from_args
from rackbed.topology.errors import UserError


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What to run: sizes in bytes, dtypes by name, repeats per point, whether to run the correctness check."""

    sizes: tuple[int, ...]
    dtypes: tuple[str, ...] = ("bf16",)
    reps: int = 15
    check: bool = True
    impls: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    description: str
    run: Callable[[BenchConfig], dict]
    table: Callable[[dict], str]
    min_gpus: int = 1


SUITES: dict[str, Suite] = {}


def register_suite(name: str, description: str, table: Callable[[dict], str], min_gpus: int = 1):
    """Decorator: register ``run(cfg) -> dict`` as suite ``name``."""

    def deco(fn: Callable[[BenchConfig], dict]):
        if name in SUITES:
            raise ValueError(f"bench: suite {name!r} registered twice")
        SUITES[name] = Suite(name, description, fn, table, min_gpus)
        return fn

    return deco


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def _size(nb: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nb >= div and nb % div == 0:
            return f"{nb // div}{unit}"
    return f"{nb}B"


def allreduce_table(res: dict) -> str:
    """One line per (dtype, size, graph): NCCL, symm two-shot, peer (auto) µs, its ratios, and the bound."""
    rows = res.get("rows", [])
    by = {(r["impl"], r["dtype"], r["size_bytes"], r["graph"]): r for r in rows}
    keys = sorted({(r["dtype"], r["graph"], r["size_bytes"]) for r in rows})
    lines = [f"{'dtype':5s} {'graph':5s} {'size':>8s} {'nccl_us':>8s} {'symm2_us':>8s} {'peer_us':>8s} "
             f"{'algo':8s} {'x_nccl':>6s} {'x_symm2':>7s} {'bound_us':>8s} {'%bound':>6s}"]
    for dt, g, nb in keys:
        n, s, p = by.get(("nccl", dt, nb, g)), by.get(("symm_two_shot", dt, nb, g)), by.get(("peer_auto", dt, nb, g))
        lines.append(
            f"{dt:5s} {('yes' if g else 'no'):5s} {_size(nb):>8s} {_fmt(n and n['median_us']):>8s} "
            f"{_fmt(s and s['median_us']):>8s} {_fmt(p and p['median_us']):>8s} {(p['algo'] if p else '-'):8s} "
            f"{_fmt(p and p['ratio_vs_nccl'], '.2f'):>6s} {_fmt(p and p['ratio_vs_symm_two_shot'], '.2f'):>7s} "
            f"{_fmt(p and p['bound_us']):>8s} {_fmt(p and p['frac_of_bound'] and 100 * p['frac_of_bound'], '.0f'):>6s}")
    bw = res.get("bandwidth", {})
    peer = res.get("peer", {})
    lines.append(f"p2p copy GB/s per direction: one way {_fmt(bw.get('p2p_copy_uni_GBps_per_dir'))}, both ways "
                 f"{_fmt(bw.get('p2p_copy_bi_GBps_per_dir'))}; HBM copy {_fmt(bw.get('hbm_copy_GBps_rw'), '.0f')} "
                 f"GB/s (r+w); peer backend {peer.get('backend')} ({peer.get('exchange')}); "
                 f"checks_ok={res.get('checks_ok')}; errors={len(res.get('errors', []))}")
    return "\n".join(lines)


@register_suite("allreduce", "peer-memory all-reduce vs NCCL and torch symm_mem", allreduce_table, min_gpus=2)
def run_allreduce(cfg: BenchConfig) -> dict:
    """Spawn one process per local GPU (all of them) and return rank 0's result dict."""
    import torch
    import torch.multiprocessing as mp

    from rackbed.kernels.bench import allreduce as allreduce_bench

    world = torch.cuda.device_count()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "allreduce.json")
        wcfg = {"sizes": list(cfg.sizes), "dtypes": list(cfg.dtypes), "reps": cfg.reps, "check": cfg.check,
                "impls": list(cfg.impls)}
        mp.spawn(allreduce_bench.worker, args=(world, _free_port(), wcfg, path), nprocs=world, join=True)
        with open(path) as f:
            return json.load(f)


def load_suites() -> None:
    """Import modules that register more suites (the MoE kernels: moe_gemm, moe_a2a, moe_prefill_gemm)."""
    import importlib

    if "moe_gemm" not in SUITES:
        importlib.import_module("rackbed.kernels.bench.moe")


def run_suites(names: list[str], cfg: BenchConfig, out: str | Path | None = None, echo=print) -> dict:
    """Run ``names`` (validated against SUITES), print their tables, write JSON to ``out`` when given."""
    load_suites()
    for n in names:
        if n not in SUITES:
            raise UserError(f"bench: unknown suite {n!r}; choose from {sorted(SUITES)}")
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[k] = v  # inherited by every process spawned below; never NVLink multicast
    import torch

    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    results = {}
    for n in names:
        suite = SUITES[n]
        if n_gpus < suite.min_gpus:
            raise UserError(f"bench: suite {n!r} needs {suite.min_gpus} GPUs, found {n_gpus}")
        results[n] = suite.run(cfg)
        echo(f"== {n}: {suite.description}")
        echo(suite.table(results[n]))
    doc = {"suites": results}
    if out:
        from rackbed.topology.outputs import write_text

        Path(out).parent.mkdir(parents=True, exist_ok=True)
        write_text(out, json.dumps(doc, indent=1))
        echo(f"wrote {out}")
    return doc


def config_from_args(sizes: list[str] | None, dtypes: list[str] | None, reps: int, check: bool,
                     impls: list[str] | None = None) -> BenchConfig:
    """Validate CLI-level arguments into a BenchConfig (one-line UserError on a bad value)."""
    from rackbed.kernels.allreduce_schedule import DTYPES

    dts = tuple(dtypes or ("bf16",))
    for d in dts:
        if d not in DTYPES:
            raise UserError(f"bench: --dtypes entry {d!r} must be one of {sorted(DTYPES)}")
    if reps < 1:
        raise UserError(f"bench: --reps={reps} must be >= 1")
    return BenchConfig(sizes=tuple(sizes_from_args(sizes)), dtypes=dts, reps=reps, check=check,
                       impls=tuple(impls or ()))

