"""Maintainer script: the Kubernetes object schemas ``rackbed emit --engine k8s`` writes, as committed data.

The official Kubernetes Python client (``kubernetes`` on PyPI) is generated from the Kubernetes OpenAPI
specification: one model class per API type, with its fields' JSON names (``attribute_map``), their types
(``openapi_types``) and which are required (annotated without ``Optional``). This script downloads the pinned
client wheel (``pip download --no-deps``), reads those three facts of every type reachable from the objects emit
writes (``apps/v1`` StatefulSet and Deployment, ``v1`` Service) with ``ast`` (nothing is imported or copied), and
writes ``sim/data/k8s_schema.json`` with the provenance (package, version, wheel sha256, date, command).
``tests/test_emit_k8s.py`` checks every emitted manifest against it: no unknown field, every required one, the
types.

    python tools/k8s_schema.py [--wheel PATH] [--out sim/data/k8s_schema.json]
"""

from __future__ import annotations

import argparse
import ast
import datetime as _dt
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PIN = ("kubernetes", "37.0.2")
ROOTS = {"apps/v1 StatefulSet": "V1StatefulSet", "apps/v1 Deployment": "V1Deployment", "v1 Service": "V1Service"}
OUT = Path(__file__).resolve().parents[1] / "sim" / "data" / "k8s_schema.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        whl = args.wheel
        if whl is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", tmp,
                            f"{PIN[0]}=={PIN[1]}"], check=True)
            whl = next(Path(tmp).glob("kubernetes-*.whl"))
        with zipfile.ZipFile(whl) as z:
            models = {Path(n).stem: z.read(n).decode() for n in z.namelist()
                      if n.startswith("kubernetes/client/models/") and n.endswith(".py")}
        digest = hashlib.sha256(Path(whl).read_bytes()).hexdigest()
    classes = {}
    for src in models.values():
        for node in ast.parse(src).body:
            if isinstance(node, ast.ClassDef):
                classes[node.name] = node
    types: dict[str, dict] = {}
    todo = list(ROOTS.values())
    while todo:
        name = todo.pop()
        if name in types or name not in classes:
            continue
        types[name] = t = _describe(classes[name])
        for f in t["fields"].values():
            todo += [r for r in re.findall(r"[A-Za-z_]\w*", f["type"]) if r in classes and r not in types]
    manifest = {
        "about": "Kubernetes API types (JSON field names, types, required) read by tools/k8s_schema.py from the "
                 "generated models of the official Python client",
        "provenance": {"package": PIN[0], "version": PIN[1], "wheel": Path(whl).name, "sha256": digest,
                       "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
                       "command": "python tools/k8s_schema.py"},
        "roots": ROOTS,
        "types": dict(sorted(types.items())),
    }
    args.out.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(args.out)
    return 0


def _literal_dict(cls: ast.ClassDef, name: str) -> dict[str, str]:
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return ast.literal_eval(node.value)
    return {}


def _describe(cls: ast.ClassDef) -> dict:
    """``{"fields": {json name: {"type", "required"}}}`` of one model class."""
    otypes, amap = _literal_dict(cls, "openapi_types"), _literal_dict(cls, "attribute_map")
    required = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in otypes:
            if not ast.unparse(node.annotation).startswith("Optional["):
                required.add(node.target.id)
    return {"fields": {amap[k]: {"type": v, "required": k in required} for k, v in otypes.items()}}


if __name__ == "__main__":
    sys.exit(main())
