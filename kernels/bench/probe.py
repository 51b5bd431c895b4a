"""Probes of the library behaviour behind the calibration's worst held-out rows (``rackbed validate``).

* ``copy``: copies of 512 MiB, 1, 2 and 4 GiB ran at 2.7 TB/s where the √2 sizes beside them ran at 4.2 TB/s.
  Copy (bf16 and bytes) / write-only fill / read-only sum at sizes around 512 MiB and 1 GiB, with separate
  allocations and with both operands carved from one allocation.

The dense-GEMM probe of ``results/h200x2/probe/probe_v1.json`` (kernel maps, every multiple of 8 timed; commit
a8f4c61) is what ``kernels.bench.measure`` now does itself (``DENSE_M``, ``gemm_kernels`` rows): run
``python -m rackbed.kernels.bench.measure --only gemm``.

Usage: ``python -m rackbed.kernels.bench.probe --out probe.json [--budget-s 200]``. Writes
``{"schema": "rackbed.probe/1", "env": ..., "rows": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from rackbed.kernels.bench import measure as M
from rackbed.topology.outputs import entry_file, write_text

SCHEMA = "rackbed.probe/1"
#: copy probe sizes (MiB)
COPY_MIB = (256, 384, 448, 480, 496, 504, 512, 520, 528, 544, 576, 640, 768, 1024, 1032, 1280, 1536, 2048)


def probe_copy(device, timer, gen, echo, budget) -> list[dict]:
    import torch

    rows = []
    for mib in COPY_MIB:
        if budget.left() < 10:
            rows.append({"probe": "copy", "mib": mib, "error": "skipped: time budget"})
            break
        nb = mib * 2**20
        n = nb // 2
        src = M._randn((n,), torch.bfloat16, device, gen)
        dst = torch.empty_like(src)
        one = torch.empty(2 * n + 4096, dtype=torch.bfloat16, device=device)  # both operands in one allocation
        a, b = one[:n], one[n + 4096:]
        a.copy_(src)
        acc = torch.empty((), dtype=torch.float32, device=device)
        cases = [({"probe": "copy", "op": "copy", "alloc": "separate", "mib": mib, "bytes": 2 * nb},
                  [lambda d=dst, s=src: d.copy_(s)]),
                 ({"probe": "copy", "op": "copy", "alloc": "one", "mib": mib, "bytes": 2 * nb},
                  [lambda d=b, s=a: d.copy_(s)]),
                 ({"probe": "copy", "op": "fill", "alloc": "separate", "mib": mib, "bytes": nb},
                  [lambda d=dst: d.fill_(1.0)]),
                 ({"probe": "copy", "op": "sum", "alloc": "separate", "mib": mib, "bytes": nb},
                  [lambda o=acc, s=src: o.copy_(torch.sum(s, dtype=torch.float32))]),
                 ({"probe": "copy", "op": "copy_u8", "alloc": "separate", "mib": mib, "bytes": 2 * nb},
                  [lambda d=dst, s=src: d.view(torch.uint8).copy_(s.view(torch.uint8))])]
        rows.extend(M._rates(r, work=r["bytes"]) for r in M.measure_curve(timer, cases, echo, f"probe copy {mib} MiB",
                                                                         budget))
        del src, dst, one, a, b, cases
        torch.cuda.empty_cache()
    return rows


PARTS = {"copy": probe_copy}


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(prog="python -m rackbed.kernels.bench.probe", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="probe.json")
    ap.add_argument("--force", action="store_true", help="replace an existing --out file")
    ap.add_argument("--only", nargs="*", choices=list(PARTS), default=list(PARTS))
    ap.add_argument("--budget-s", type=float, default=None)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args(argv)
    out = entry_file(a.out, force=a.force)  # before the probes, not after them
    if not torch.cuda.is_available():
        print("probe: no CUDA GPU found", file=sys.stderr)
        return 2
    echo = lambda *m: print(*m, flush=True)
    device = "cuda:0"
    budget = M.Budget(a.budget_s)
    timer = M.Timer(device, rounds=a.rounds)
    gen = torch.Generator(device=device).manual_seed(0)
    doc = {"schema": SCHEMA, "env": M.environment(device), "rows": [], "complete": False}
    M._warm_clocks(device)
    for part in a.only:
        t0 = time.time()
        try:
            doc["rows"].extend(PARTS[part](device, timer, gen, echo, budget))
        except Exception as exc:  # noqa: BLE001 — recorded, the other parts still run
            doc["rows"].append({"probe": part, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        echo(f"probe: {part}: {time.time() - t0:.1f} s")
        write_text(out, json.dumps(doc, indent=1))
    doc["complete"] = True
    write_text(out, json.dumps(doc, indent=1))
    print(f"wrote {out} ({len(doc['rows'])} rows)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
