"""``rackbed formats``: the accuracy / size trade-off of the numeric formats.

    rackbed formats [--rows R --cols C] [--seed S] [--df DF] [--role weight|activation] [--all] [--json]

For every format (``engine.core.formats``) prints bytes per element (scales included) for weights and
activations, and the relative error ||x - dq(q(x))||_2 / ||x||_2 of a round trip on a seeded Gaussian N(0, 1)
matrix and on a heavy-tailed Student-t matrix (``--df`` degrees of freedom, default 3) — the trade-off the
write-up discusses: the 8-bit formats sit near 2.6-3.5 % (MXFP8 pays 1/32 B of scales per element and, with
the OCP scale rule, some top-binade clipping), the 4-bit formats halve the bytes again at 3-5x the error
(NVFP4's finer 16-element E4M3 scales beat MXFP4's power-of-two 32-element scales, most visibly on heavy
tails).
"""

from __future__ import annotations

import argparse
import json


def register(subparsers) -> None:
    p = subparsers.add_parser("formats",
                              help="accuracy vs bytes/element of the numeric formats (bf16 ... nvfp4)")
    p.add_argument("--rows", type=int, default=128, help="rows of the test matrices (default 128)")
    p.add_argument("--cols", type=int, default=2048, help="columns (the blocked axis; default 2048)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed (default 0)")
    p.add_argument("--df", type=float, default=3.0, help="Student-t degrees of freedom (default 3)")
    p.add_argument("--role", choices=("weight", "activation"), default="weight",
                   help="quantize as weights or activations (fp8_block tiles differ; default weight)")
    p.add_argument("--all", action="store_true", help="also the E5M2 / E3M2 variants")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(func=cmd_formats)


def format_rows(rows: int = 128, cols: int = 2048, seed: int = 0, df: float = 3.0, role: str = "weight",
                include_extra: bool = False) -> list[dict]:
    """One dict per format: name, description, element_bits, bytes_per_elem_weight, bytes_per_elem_activation,
    rel_err_gaussian, rel_err_student_t. Inputs are drawn from ``numpy.random.default_rng(seed)``."""
    import numpy as np

    from rackbed.engine.core.formats import EXTRA_FORMAT_NAMES, FORMAT_NAMES, get_format, relative_error

    if rows < 1 or cols < 1:
        raise ValueError(f"--rows and --cols must be >= 1, got {rows} x {cols}")
    if not df > 0:
        raise ValueError(f"--df must be > 0, got {df}")
    rng = np.random.default_rng(seed)
    gauss = rng.standard_normal((rows, cols))
    heavy = rng.standard_t(df, size=(rows, cols))
    names = FORMAT_NAMES + (EXTRA_FORMAT_NAMES if include_extra else ())
    out = []
    for name in names:
        f = get_format(name)
        out.append(dict(
            name=name, description=f.description, element_bits=f.element_bits,
            bytes_per_elem_weight=f.bytes_per_element("weight"),
            bytes_per_elem_activation=f.bytes_per_element("activation"),
            rel_err_gaussian=relative_error(gauss, f, role),
            rel_err_student_t=relative_error(heavy, f, role),
        ))
    return out


def cmd_formats(args: argparse.Namespace) -> int:
    rows = format_rows(args.rows, args.cols, args.seed, args.df, args.role, args.all)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"numeric formats: round-trip relative error ({args.role}s, {args.rows}x{args.cols}, "
                        f"seed {args.seed})")
    for col, just in [("format", "left"), ("elements / scales", "left"), ("bits", "right"),
                      ("B/elem weight", "right"), ("B/elem act", "right"), ("rel err N(0,1)", "right"),
                      (f"rel err t(df={args.df:g})", "right")]:
        table.add_column(col, justify=just)
    for r in rows:
        table.add_row(r["name"], r["description"], str(r["element_bits"]),
                      f"{r['bytes_per_elem_weight']:.4f}", f"{r['bytes_per_elem_activation']:.4f}",
                      f"{100 * r['rel_err_gaussian']:.3f} %", f"{100 * r['rel_err_student_t']:.3f} %")
    table.caption = ("rel err = ||x - dq(q(x))||2 / ||x||2. MX scales follow OCP (floor(log2 amax) - emax), "
                     "so a block's largest values can clip at the element max "
                     "(mxfp8_ceil in --all avoids that).")
    Console(width=140).print(table)
    return 0
