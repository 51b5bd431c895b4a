"""``rackbed topo``: list, show, check, draw and dump topologies.

    rackbed topo list                         preset names
    rackbed topo show NAME|FILE [--json]      summary table (or the summary as JSON)
    rackbed topo check FILE                   validate a topology file; one line, exit 0 / 2
    rackbed topo draw NAME|FILE --out x.png   picture (matplotlib, Agg)
    rackbed topo dump NAME|FILE [--out F] [--format yaml|json]   the graph-form file (round-trips)

Mistakes (unknown names, bad files, impossible values) raise ``ValueError``; ``engine.cli.main`` prints them in
one line and exits 2.
"""

from __future__ import annotations

import argparse
import json


def register(subparsers) -> None:
    from rackbed.topology.outputs import add_force

    p = subparsers.add_parser("topo", help="show / check / draw a topology (preset name or YAML/JSON file)")
    p.set_defaults(func=lambda args: _help(p))
    sub = p.add_subparsers(dest="topo_command", metavar="ACTION")

    q = sub.add_parser("list", help="list preset topologies")
    q.set_defaults(func=cmd_list)

    q = sub.add_parser("show", help="summary table of a topology")
    q.add_argument("topology", metavar="NAME|FILE", help="preset (e.g. gb200-nvl72, hgx-h200*2) or file")
    q.add_argument("--json", action="store_true", help="print the summary as JSON")
    q.set_defaults(func=cmd_show)

    q = sub.add_parser("check", help="validate a topology file")
    q.add_argument("topology", metavar="FILE")
    q.set_defaults(func=cmd_check)

    q = sub.add_parser("draw", help="draw a topology to an image")
    q.add_argument("topology", metavar="NAME|FILE")
    q.add_argument("--out", required=True, help="output image (.png, .svg, .pdf)")
    add_force(q, "replace an existing --out file")
    q.set_defaults(func=cmd_draw)

    q = sub.add_parser("dump", help="write the topology in the graph file form")
    q.add_argument("topology", metavar="NAME|FILE")
    q.add_argument("--out", help="file to write (default: stdout)")
    add_force(q, "replace an existing --out file")
    q.add_argument("--format", choices=("yaml", "json"), help="default: from --out's suffix, else yaml")
    q.set_defaults(func=cmd_dump)


def _help(p: argparse.ArgumentParser) -> int:
    p.print_help()
    return 2


def cmd_list(args) -> int:
    from rackbed.topology import PRESETS

    for name, spec in PRESETS.items():
        node = spec.rack.node
        print(f"{name:14s} {spec.rack.n_nodes * node.n_gpus:3d} × {node.gpu.name}  ({spec.rack.name})")
    print("NAME*N joins N copies by the preset's scale-out fabric, e.g. hgx-h200*2, gb200-nvl72*2")
    return 0


def _fmt_rate(x) -> str:
    return "unsupported" if x is None else f"{x:g}"


def summary_rows(s: dict) -> list[tuple[str, str]]:
    """(label, value) rows of the human summary, from ``Topology.summary()``."""
    c = s["counts"]
    rows = [("topology", s["name"])]
    for name, m in s["gpu_models"].items():
        rows.append(("GPUs", f"{m['count']} × {name} ({m['arch']}, {m['sm_count']} SMs)"))
        rows.append(("  HBM per GPU", f"{m['hbm_GB']:g} GB at {m['hbm_TBps']:g} TB/s"))
        rates = (f"bf16 {_fmt_rate(m['bf16_tflops'])}, fp8 {_fmt_rate(m['fp8_tflops'])}, "
                 f"mxfp8 {_fmt_rate(m['mxfp8_tflops'])}, nvfp4 {_fmt_rate(m['nvfp4_tflops'])}")
        rows.append(("  dense TFLOP/s", rates))
        rows.append(("  NVLink per GPU", f"{m['nvlink_GBps_per_dir']:g} GB/s per direction"))
    rows.append(("hosts", str(s["hosts"])))
    doms = ", ".join(f"{n} × {size} GPUs" for size, n in s["nvlink_domains"].items())
    rows.append(("NVLink domains", doms))
    nvsw = [f"{n} × {name}" for name, n in s["switches"].items()]
    rows.append(("NVLink switch ASICs", f"{c['nvsw']}, {s['sharp_switches']['nvsw']} with SHARP/NVLS"))
    rows.append(("CPUs", ", ".join(f"{n} × {name}" for name, n in s["cpus"].items()) or "0"))
    nics = [f"{m['count']} × {name} ({m['kind']}, {m['line_rate_Gbps']:g} Gb/s, GPU-initiated RDMA "
            f"{'yes' if m['gpu_initiated_rdma'] else 'no'})" for name, m in s["nics"].items()]
    rows.append(("NICs", "; ".join(nics) or "0"))
    rows.append(("fabric switches", f"{c['ibsw']}, {s['sharp_switches']['ibsw']} with SHARP"))
    rows.append(("switch models", ", ".join(nvsw) or "none"))
    for key, label in (("intra_domain", "P2P in NVLink domain"), ("cross_domain", "P2P across domains")):
        p = s["p2p"].get(key)
        if key in s["p2p"]:
            if p is None:
                rows.append((label, "no path"))
            else:
                a, b = p["gpus"]
                text = (f"GPU {a}→{b} via {p['via']}: {p['GBps_per_dir']:g} GB/s per direction, "
                        f"{p['latency_us']:g} µs, {p['hops']} hops")
                rows.append((label, text))
    return rows


def cmd_show(args) -> int:
    from rackbed.topology import load

    t = load(args.topology)
    s = t.summary()
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"topology {s['name']}", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for label, value in summary_rows(s):
        table.add_row(label, value)
    Console(width=160).print(table)
    return 0


def cmd_check(args) -> int:
    from rackbed.topology import load_file

    t = load_file(args.topology)
    c = t.counts()
    doms = t.nvlink_domains()
    print(f"ok: {args.topology}: {t.name}: {c['gpu']} GPUs on {len(t.hosts)} host(s), {len(doms)} NVLink "
          f"domain(s) of {'/'.join(str(n) for n in sorted({len(d) for d in doms}))} GPUs, {c['nvsw']} NVSwitch, "
          f"{c['cpu']} CPUs, {c['nic']} NICs, {c['ibsw']} fabric switches")
    return 0


def cmd_draw(args) -> int:
    from rackbed.topology import load
    from rackbed.topology.draw import draw
    from rackbed.topology.outputs import prepare_file

    out = draw(load(args.topology), prepare_file(args.out, force=args.force))
    print(f"wrote {out}")
    return 0


def cmd_dump(args) -> int:
    from rackbed.topology import dump, load
    from rackbed.topology.outputs import prepare_file

    t = load(args.topology)
    if args.out:
        prepare_file(args.out, force=args.force)
    text = dump(t, args.out, args.format)
    if args.out:
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0
