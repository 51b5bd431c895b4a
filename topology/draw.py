"""Draw a topology to an image file with matplotlib (Agg backend; no display needed).

Layout, top to bottom: NVLink switches, GPUs (grouped by host, hosts left to right), CPUs, NICs, fabric
switches. Edges are coloured by link kind; node colour by node kind.
"""

from __future__ import annotations

from pathlib import Path

from rackbed.topology.graph import Topology

_ROW = {"nvsw": 4.0, "gpu": 3.0, "cpu": 2.0, "nic": 1.2, "ibsw": 0.4, "spine": -0.4}
_NODE_COLOR = {"gpu": "#76b900", "nvsw": "#1f77b4", "cpu": "#9467bd", "nic": "#ff7f0e", "ibsw": "#d62728"}
_LINK_COLOR = {"nvlink": "#1f77b4", "c2c": "#9467bd", "pcie": "#7f7f7f", "ib": "#d62728", "efa": "#e377c2",
               "ethernet": "#8c564b"}


def layout(t: Topology) -> dict[str, tuple[float, float]]:
    """Node id -> (x, y). Hosts get equal-width columns; a switch whose links all lead into one host (HGX
    NVSwitches) sits in that host's column; other switches spread over the width, fabric spines below
    leaves."""
    hosts = sorted({h for n in t.nodes() if (h := t.host_of_node(n)) is not None})
    col = {h: k for k, h in enumerate(hosts)}
    g = t.graph
    per_host: dict[tuple[int, str], list[str]] = {}
    free: dict[str, list[str]] = {}
    for n in t.nodes():
        h = t.host_of_node(n)
        if h is None:
            near = {t.host_of_node(x) for x in g.neighbors(n)}
            h = near.pop() if len(near) == 1 and None not in near else None
        kind = t.kind(n)
        if kind == "ibsw" and not any(t.kind(x) == "nic" for x in g.neighbors(n)):
            kind = "spine"
        if h is None:
            free.setdefault(kind, []).append(n)
        else:
            per_host.setdefault((h, kind), []).append(n)
    width = max(1, len(hosts))
    pos: dict[str, tuple[float, float]] = {}
    for (h, kind), ids in per_host.items():
        for k, n in enumerate(ids):
            pos[n] = (col[h] + (k + 0.5) / len(ids) * 0.9, _ROW[kind])
    for kind, ids in free.items():
        for k, n in enumerate(ids):
            pos[n] = ((k + 0.5) / len(ids) * width, _ROW[kind])
    return pos


def draw(t: Topology, out: str | Path, dpi: int = 120) -> Path:
    """Render ``t`` to ``out`` (format from the suffix, e.g. .png / .svg / .pdf); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import LineCollection
    from matplotlib.lines import Line2D

    out = Path(out)
    pos = layout(t)
    width = max(1, len({t.host_of(i) for i in t.gpu_ids}))
    fig, ax = plt.subplots(figsize=(min(40, 4 + 1.6 * width), 6))
    try:
        by_kind: dict[str, list] = {}
        for u, v, link in t.links():
            by_kind.setdefault(link.kind, []).append((pos[u], pos[v]))
        for kind, segs in by_kind.items():
            alpha = 0.25 if len(segs) > 200 else 0.6
            ax.add_collection(LineCollection(segs, colors=_LINK_COLOR[kind], linewidths=0.6, alpha=alpha,
                                             zorder=1))
        for kind, color in _NODE_COLOR.items():
            ids = t.nodes(kind)
            if not ids:
                continue
            xs, ys = zip(*(pos[n] for n in ids))
            ax.scatter(xs, ys, s=30 if len(ids) > 40 else 80, c=color, zorder=2,
                       edgecolors="black", linewidths=0.3)
        c = t.counts()
        labels = {"gpu": "GPU", "nvsw": "NVSwitch", "cpu": "CPU", "nic": "NIC", "ibsw": "fabric switch"}
        handles = [Line2D([], [], marker="o", ls="", color=_NODE_COLOR[k], label=f"{labels[k]} ({c[k]})")
                   for k in _NODE_COLOR if c[k]]
        handles += [Line2D([], [], color=_LINK_COLOR[k], label=k) for k in by_kind]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
        ax.set_title(f"{t.name}: {c['gpu']} GPUs, {len(t.nvlink_domains())} NVLink domain(s)")
        ax.set_xlim(-0.1, width + 0.1)
        ax.set_ylim(-0.8, 4.5)
        ax.set_yticks([_ROW[k] for k in _NODE_COLOR], [labels[k] for k in _NODE_COLOR])
        ax.set_xticks([])
        ax.spines[["top", "right", "bottom"]].set_visible(False)
        fig.tight_layout()
        from rackbed.topology.outputs import replacing

        with replacing(out, "wb") as f:
            fig.savefig(f, dpi=dpi, format=Path(out).suffix.lstrip(".").lower() or "png")
    finally:
        plt.close(fig)
    return out
