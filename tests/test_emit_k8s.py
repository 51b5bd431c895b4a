"""``rackbed emit --engine k8s`` (sim/emit.py): the deployment as plain Kubernetes objects, schema-checked.

``sim/data/k8s_schema.json`` holds the field names, types and required fields of the Kubernetes API types the
objects use, read by ``tools/k8s_schema.py`` from the generated models of the official Kubernetes Python client
at a pinned version. Every emitted object is checked against it (no unknown field, every required one, the
types), its server and router arguments parse with the pinned SGLang / router parsers (tests/test_emit_flags.py),
and the StatefulSets ask for exactly the deployment's GPUs: per group one pod per host it spans with the group's
GPUs there.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import pytest
import yaml
from test_emit_flags import CASES, _case, parse

from rackbed.sim import emit
from rackbed.sim.emit import plan_of

SCHEMA = Path(emit.__file__).resolve().parent / "data" / "k8s_schema.json"


@cache
def _schema() -> dict:
    return json.loads(SCHEMA.read_text())


def check(obj, typ: str, path: str = "") -> None:
    """``obj`` is a valid ``typ`` (a schema type name, ``List[...]``, ``Dict[str, ...]`` or a scalar)."""
    types = _schema()["types"]
    if typ == "object":
        return
    if typ in ("str", "datetime"):
        assert isinstance(obj, str), f"{path}: {obj!r} is not a string"
        return
    if typ == "int":
        assert isinstance(obj, int) and not isinstance(obj, bool), f"{path}: {obj!r} is not an integer"
        return
    if typ == "bool":
        assert isinstance(obj, bool), f"{path}: {obj!r} is not a boolean"
        return
    m = re.fullmatch(r"List\[(.+)\]", typ)
    if m:
        assert isinstance(obj, list), f"{path}: not a list"
        for i, x in enumerate(obj):
            check(x, m.group(1), f"{path}[{i}]")
        return
    m = re.fullmatch(r"Dict\[str, (.+)\]", typ)
    if m:
        assert isinstance(obj, dict) and all(isinstance(k, str) for k in obj), f"{path}: not a string map"
        for k, v in obj.items():
            check(v, m.group(1), f"{path}.{k}")
        return
    fields = types[typ]["fields"]
    assert isinstance(obj, dict), f"{path}: {typ} is an object"
    for k, v in obj.items():
        assert k in fields, f"{path}: {typ} has no field {k!r}"
        check(v, fields[k]["type"], f"{path}.{k}")
    for k, f in fields.items():
        assert not f["required"] or k in obj, f"{path}: {typ} requires {k!r}"


def check_item(item: dict) -> None:
    root = _schema()["roots"][f"{item['apiVersion']} {item['kind']}"]
    check(item, root, f"{item['kind']}/{item['metadata']['name']}")


def _items(key: str) -> list[dict]:
    _, files = _case(key)
    doc = yaml.safe_load(files["k8s"]["k8s.yaml"])
    assert (doc["apiVersion"], doc["kind"]) == ("v1", "List")
    return doc["items"]


def test_schema_provenance_and_a_bad_object_fails():
    prov = _schema()["provenance"]
    assert prov["package"] == "kubernetes" and re.fullmatch(r"[0-9a-f]{64}", prov["sha256"])
    sts = next(i for i in _items("nvl72-default") if i["kind"] == "StatefulSet")
    check_item(sts)
    bad = json.loads(json.dumps(sts))
    bad["spec"]["replica"] = bad["spec"].pop("replicas")  # a misspelt field
    with pytest.raises(AssertionError, match="no field 'replica'"):
        check_item(bad)
    bad = json.loads(json.dumps(sts))
    del bad["spec"]["selector"]
    with pytest.raises(AssertionError, match="requires 'selector'"):
        check_item(bad)
    bad = json.loads(json.dumps(sts))
    bad["spec"]["replicas"] = "2"
    with pytest.raises(AssertionError, match="not an integer"):
        check_item(bad)


@pytest.mark.parametrize("key", sorted(CASES))
def test_k8s_objects_are_valid_parse_and_hold_the_placement(key):
    sc, _ = _case(key)
    pl = plan_of(sc)
    items = _items(key)
    for it in items:
        check_item(it)
    names = [(i["kind"], i["metadata"]["name"]) for i in items]
    assert len(names) == len(set(names))
    groups = {f"rackbed-{emit.dns_label(g.id)}": g for g in (*pl.prefill, *pl.decode, *pl.aggregated)}
    sets = [i for i in items if i["kind"] == "StatefulSet"]
    assert sorted(s["metadata"]["name"] for s in sets) == sorted(groups)
    ports = []
    for s in sets:
        g = groups[s["metadata"]["name"]]
        assert s["spec"]["replicas"] == len(g.hosts)
        (c,) = s["spec"]["template"]["spec"]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == str(g.gpus_per_host)
        assert c["command"] == ["python3", "-m", "sglang.launch_server"]
        ns = parse("sglang.launch_server", [a.replace(emit.POD_INDEX, "0") for a in c["args"]])
        assert ns.tp_size == g.n_gpus
        ports.append(ns.port)
    assert len(ports) == len(set(ports))  # host network: every server its own port
    assert sum(s["spec"]["replicas"] * int(s["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "nvidia.com/gpu"]) for s in sets) == sum(g.n_gpus for g in groups.values())
    (router,) = [i for i in items if i["kind"] == "Deployment"]
    (c,) = router["spec"]["template"]["spec"]["containers"]
    ns = parse("sglang_router.launch_router", c["args"])
    if pl.is_aggregated:
        assert len(ns.worker_urls) == len(pl.aggregated)
    else:
        assert len(ns.prefill) == len(pl.prefill) and len(ns.decode) == len(pl.decode)
