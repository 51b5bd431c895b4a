"""Probes of the library behaviour behind the calibration's worst held-out rows (``rackbed validate``).

Two questions the quarter-octave measurement (``kernels.measure``) left open:

* ``gemm``: cuBLAS picks a different kernel (tile shape, split-K, stages) as the token count ``m`` changes, and
  the choice is not monotone in ``m`` — a dense GEMM can be faster at m=360 than at m=304. Which kernel runs at
  every ``m``? :func:`kernels.measure.kernel_names` records the kernels each call launches (the CUDA profiler's activity trace,
  one marker kernel between calls), and every multiple of 8 up to 1024 is timed as in ``kernels.measure``, so the
  time can be read against the kernel.
* ``copy``: copies of 512 MiB, 1, 2 and 4 GiB ran at 2.7 TB/s where the √2 sizes beside them ran at 4.2 TB/s.
  Copy / write-only fill / read-only sum at sizes around 512 MiB and 1 GiB, with separate allocations and with
  both operands carved from one allocation.

Usage: ``python -m kernels.probe --out probe.json [--only gemm copy] [--budget-s 200]``. Writes
``{"schema": "rackbed.probe/1", "env": ..., "rows": [...]}``, rewritten after every part.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kernels import measure as M

SCHEMA = "rackbed.probe/1"
#: every token count up to 1024 is mapped to its kernel, then multiples of 64 up to 16384
NAME_M = list(range(1, 1025)) + list(range(1088, 16385, 64))
#: timed token counts: every multiple of 8 up to 1024
TIME_M = list(range(8, 1025, 8))
#: copy probe sizes (MiB)
COPY_MIB = (256, 384, 448, 480, 496, 504, 512, 520, 528, 544, 576, 640, 768, 1024, 1032, 1280, 1536, 2048)


def probe_gemm(device, timer, gen, echo, budget) -> list[dict]:
    import torch

    rows = []
    marker = torch.zeros(1, device=device, dtype=torch.int32)
    mark = lambda: marker.fill_(7)  # noqa: E731
    is_mark = lambda n: "FillFunctor" in n  # noqa: E731
    for name, n, k in M.DENSE_SHAPES:
        w = M._randn((n, k), torch.bfloat16, device, gen)
        wq = (w.float() / (w.float().abs().amax(1, keepdim=True) / 448)).to(torch.float8_e4m3fn)
        sw = (w.float().abs().amax(1) / 448)[None, :].contiguous()
        xmax = M._randn((max(NAME_M), k), torch.bfloat16, device, gen)
        sxmax = (xmax.float().abs().amax(1, keepdim=True) / 448).contiguous()
        xqmax = (xmax.float() / sxmax).to(torch.float8_e4m3fn)
        for fmt in ("bf16", "fp8"):
            if budget.left() < 15:
                rows.append({"probe": "gemm_kernels", "fmt": fmt, "shape": name, "error": "skipped: time budget"})
                continue
            t0 = time.time()

            def call(m, fmt=fmt):
                if fmt == "bf16":
                    x = xmax[:m].contiguous()
                    return lambda: torch.matmul(x, w.t())
                a, sa = xqmax[:m].contiguous(), sxmax[:m].contiguous()
                return lambda: torch._scaled_mm(a, wq.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16)

            ok_m, calls, errs = [], [], {}
            for m in NAME_M:
                try:
                    c = call(m)
                    c()
                    ok_m.append(m)
                    calls.append(c)
                except Exception as exc:  # noqa: BLE001 — recorded
                    errs[m] = f"{type(exc).__name__}: {str(exc)[:120]}"
            torch.cuda.synchronize()
            try:
                names = M.kernel_names(calls, mark, is_mark)
                rows.append({"probe": "gemm_kernels", "op": "dense", "fmt": fmt, "shape": name, "n": n, "k": k,
                             "runs": M.runs_of(ok_m, names), "errors": dict(list(errs.items())[:20]),
                             "n_errors": len(errs)})
            except Exception as exc:  # noqa: BLE001
                rows.append({"probe": "gemm_kernels", "fmt": fmt, "shape": name,
                             "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            del calls
            # timed: every multiple of 8 up to 1024, rotated over fresh inputs as kernels.measure does
            nsets = M._n_sets(n * k * (2 if fmt == "bf16" else 1))
            ws = [w] + [M._randn((n, k), torch.bfloat16, device, gen) for _ in range(nsets - 1)]
            cases = []
            for m in TIME_M:
                if m not in ok_m:
                    continue
                xs = [M._randn((m, k), torch.bfloat16, device, gen) for _ in ws]
                if fmt == "bf16":
                    fns = [(lambda x=x, ww=ww: torch.matmul(x, ww.t())) for x, ww in zip(xs, ws)]
                else:
                    wqs = [(ww.float() / (ww.float().abs().amax(1, keepdim=True) / 448)).to(torch.float8_e4m3fn)
                           for ww in ws]
                    sws = [(ww.float().abs().amax(1) / 448)[None, :].contiguous() for ww in ws]
                    sx = [(x.float().abs().amax(1, keepdim=True) / 448).contiguous() for x in xs]
                    xq = [(x.float() / s).to(torch.float8_e4m3fn) for x, s in zip(xs, sx)]
                    fns = [(lambda a=a, sa=sa, b=b, sb=sb: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb,
                                                                              out_dtype=torch.bfloat16))
                           for a, sa, b, sb in zip(xq, sx, wqs, sws)]
                cases.append(({"probe": "gemm_time", "op": "dense", "fmt": fmt, "shape": name, "m": m, "n": n,
                               "k": k}, fns))
            rows.extend(M.measure_curve(timer, cases, echo, f"probe gemm {fmt} {name}", budget))
            del cases, ws
            torch.cuda.empty_cache()
            echo(f"probe: gemm {fmt} {name}: {time.time() - t0:.1f} s")
    return rows


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
                  [lambda: dst.copy_(src)]),
                 ({"probe": "copy", "op": "copy", "alloc": "one", "mib": mib, "bytes": 2 * nb},
                  [lambda: b.copy_(a)]),
                 ({"probe": "copy", "op": "fill", "alloc": "separate", "mib": mib, "bytes": nb},
                  [lambda: dst.fill_(1.0)]),
                 ({"probe": "copy", "op": "sum", "alloc": "separate", "mib": mib, "bytes": nb},
                  [lambda: torch.sum(src, dtype=torch.float32, out=acc)]),
                 ({"probe": "copy", "op": "copy_u8", "alloc": "separate", "mib": mib, "bytes": 2 * nb},
                  [lambda: dst.view(torch.uint8).copy_(src.view(torch.uint8))])]
        rows.extend(M._rates(r, work=r["bytes"]) for r in M.measure_curve(timer, cases, echo, f"probe copy {mib} MiB",
                                                                         budget))
        del src, dst, one, a, b, cases
        torch.cuda.empty_cache()
    return rows


PARTS = {"gemm": probe_gemm, "copy": probe_copy}


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(prog="python -m kernels.probe", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="probe.json")
    ap.add_argument("--only", nargs="*", choices=list(PARTS), default=list(PARTS))
    ap.add_argument("--budget-s", type=float, default=None)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe: no CUDA GPU found", file=sys.stderr)
        return 2
    echo = lambda *m: print(*m, flush=True)  # noqa: E731
    device = "cuda:0"
    budget = M.Budget(a.budget_s)
    timer = M.Timer(device, rounds=a.rounds)
    gen = torch.Generator(device=device).manual_seed(0)
    doc = {"schema": SCHEMA, "env": M.environment(device), "rows": [], "complete": False}
    out = Path(a.out)
    M._warm_clocks(device)
    for part in a.only:
        t0 = time.time()
        try:
            doc["rows"].extend(PARTS[part](device, timer, gen, echo, budget))
        except Exception as exc:  # noqa: BLE001 — recorded, the other parts still run
            doc["rows"].append({"probe": part, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        echo(f"probe: {part}: {time.time() - t0:.1f} s")
        out.write_text(json.dumps(doc, indent=1))
    doc["complete"] = True
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out} ({len(doc['rows'])} rows)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
