"""A GPU's power draw idle, memory-bound and compute-bound
(``python -m rackbed.kernels.bench.power_draw --out FILE``).

A power model interpolates a GPU's draw between idle, memory-bound and compute-bound levels by what a step
does. This benchmark measures those three levels on the GPU at hand: it samples the board's power with
``nvidia-smi`` (every 100 ms) while the GPU

* idles (nothing launched),
* streams HBM (an elementwise copy of two 4 GiB buffers, over and over: the memory-bound level), and
* multiplies bf16 matrices (8192^3 GEMMs: the compute-bound level),

each phase for ``--seconds`` after a 2 s settle, and records per phase the mean / median / p90 / max draw with
the achieved TB/s or TFLOP/s. ``sample(...)`` is also used to record the draw beside real runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

from rackbed.topology.outputs import add_force, entry_file, write_text

FIELDS = "timestamp,power.draw,utilization.gpu,utilization.memory,clocks.sm,clocks.mem,temperature.gpu"


class Sampler:
    """``nvidia-smi`` sampling the board power every ``period_ms`` (kept in memory) until :meth:`stop`."""

    def __init__(self, period_ms: int = 100, gpu: int = 0) -> None:
        self.lines: list[str] = []
        self.t0 = time.time()
        self.proc = subprocess.Popen(["nvidia-smi", "-i", str(gpu), f"--query-gpu={FIELDS}",
                                      "--format=csv,noheader,nounits", f"-lms={period_ms}"], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None  # stdout=PIPE
        for line in self.proc.stdout:  # kept in memory: ~60 bytes a sample
            self.lines.append(line)

    def stop(self) -> list[dict]:
        """Stop sampling -> ``[{"t": seconds since start (host clock at read), "power_w", "util", "util_mem",
        "sm_mhz", "mem_mhz", "temp_c"}]``."""
        self.proc.terminate()
        self.proc.wait()
        self.reader.join(timeout=5)
        out = []
        for line in list(self.lines):
            p = [x.strip() for x in line.split(",")]
            if len(p) < 7:
                continue
            try:
                ts = time.mktime(time.strptime(p[0].split(".")[0], "%Y/%m/%d %H:%M:%S")) + \
                    float("0." + p[0].split(".")[1]) if "." in p[0] else 0.0
                out.append({"t": round(ts - self.t0, 3), "power_w": float(p[1]), "util": float(p[2]),
                            "util_mem": float(p[3]), "sm_mhz": float(p[4]), "mem_mhz": float(p[5]),
                            "temp_c": float(p[6])})
            except ValueError:
                continue
        return out


def summary(samples: list[dict]) -> dict:
    w = sorted(s["power_w"] for s in samples)
    if not w:
        return {"n": 0}
    return {"n": len(w), "mean_w": round(statistics.fmean(w), 1), "p50_w": w[len(w) // 2],
            "p90_w": w[min(len(w) - 1, int(0.9 * len(w)))], "max_w": w[-1],
            "sm_mhz_p50": sorted(s["sm_mhz"] for s in samples)[len(w) // 2]}


def _phase(name: str, body, seconds: float, settle: float = 2.0) -> dict:
    import torch

    t_end = time.time() + settle
    while time.time() < t_end:          # settle: reach the phase's steady draw before sampling it
        body()
        torch.cuda.synchronize()
    s = Sampler()
    t0, n = time.time(), 0
    while time.time() - t0 < seconds:
        body()
        n += 1
        if n % 8 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    dt = time.time() - t0
    return {"phase": name, "seconds": round(dt, 2), "iterations": n, **summary(s.stop())}


def run(seconds: float) -> dict:
    import torch

    dev = torch.device("cuda")
    s = Sampler()
    time.sleep(seconds)
    phases = [{"phase": "idle", "seconds": seconds, **summary(s.stop())}]
    n = 1 << 31                                            # 4 GiB of bf16 per buffer
    buf = {"a": torch.empty(n, dtype=torch.bfloat16, device=dev).normal_()}
    buf["b"] = torch.empty_like(buf["a"])
    ph = _phase("memory_bound_copy", lambda: buf["b"].copy_(buf["a"]), seconds)
    ph["TBps"] = round(2 * n * 2 * ph["iterations"] / ph["seconds"] / 1e12, 3)
    phases.append(ph)
    buf.clear()
    torch.cuda.empty_cache()
    m = 8192
    x = torch.randn(m, m, dtype=torch.bfloat16, device=dev)
    y = torch.randn(m, m, dtype=torch.bfloat16, device=dev)
    z = torch.empty(m, m, dtype=torch.bfloat16, device=dev)
    ph = _phase("compute_bound_gemm_bf16", lambda: torch.matmul(x, y, out=z), seconds)
    ph["TFLOPs"] = round(2 * m ** 3 * ph["iterations"] / ph["seconds"] / 1e12, 1)
    phases.append(ph)
    return {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": "python -m rackbed.kernels.bench.power_draw " + " ".join(sys.argv[1:]),
            "sampling": "nvidia-smi power.draw every 100 ms", "phases": phases}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m rackbed.kernels.bench.power_draw", description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--seconds", type=float, default=12.0)
    add_force(p)
    a = p.parse_args(argv)
    out = entry_file(a.out, force=a.force)
    res = run(a.seconds)
    write_text(out, json.dumps(res, indent=1) + "\n")
    for ph in res["phases"]:
        print(ph)
    return 0


if __name__ == "__main__":
    sys.exit(main())
