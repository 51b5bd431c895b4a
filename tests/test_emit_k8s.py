"""``rackbed emit --engine k8s`` (sim/emit.py): the deployment as plain Kubernetes objects, schema-checked.

``sim/data/k8s_schema.json`` holds the field names, types and required fields of the Kubernetes API types the
objects use, read by ``tools/k8s_schema.py`` from the generated models of the official Kubernetes Python client
at a pinned version. Every emitted object is checked against it (no unknown field, every required one, the
types), its server and router arguments parse with the pinned SGLang / router parsers (tests/test_emit_flags.py),
and the StatefulSets ask for exactly the deployment's GPUs: per group one pod per host it spans with the group's
GPUs there.

``sim/data/dynamo_crd.json`` holds the ``openAPIV3Schema`` of the Dynamo operator's ``DynamoGraphDeployment``
custom resource definition, read by ``tools/dynamo_crd.py`` from the Dynamo repository at one commit (its
provenance names which). Every emitted ``DynamoGraphDeployment`` is checked against it as the API server reads a
structural schema under strict field validation (``kubectl apply``'s default): no field the schema does not
declare (unless it keeps unknown fields), every required one, the types and the enums; its metadata against
``ObjectMeta``.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import pytest
import yaml
from lane import first_in_lane
from test_emit_flags import CASES, _case, parse

from rackbed.sim import emit
from rackbed.sim.emit import plan_of

SCHEMA = Path(emit.__file__).resolve().parent / "data" / "k8s_schema.json"
DYNAMO_CRD = SCHEMA.with_name("dynamo_crd.json")


@cache
def _schema() -> dict:
    return json.loads(SCHEMA.read_text())


@cache
def _crd() -> dict:
    return json.loads(DYNAMO_CRD.read_text())


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


@pytest.mark.parametrize("key", first_in_lane(sorted(CASES)))
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


# ------------------------------------------------------------------------------------------------ Dynamo graph


def check_crd(obj, s: dict, path: str) -> None:
    """``obj`` is valid under the structural schema ``s`` of a custom resource, read as the API server does with
    strict field validation: a field neither in ``properties`` nor covered by ``additionalProperties`` is an error
    unless the schema keeps unknown fields (``x-kubernetes-preserve-unknown-fields``); required fields, the
    types (``int-or-string`` too), enums and ``maxProperties``. CEL rules (``x-kubernetes-validations``) are not
    evaluated."""
    if obj is None and s.get("nullable"):
        return
    if s.get("x-kubernetes-int-or-string"):
        assert isinstance(obj, (int, str)) and not isinstance(obj, bool), f"{path}: {obj!r} is not an int or string"
        return
    t = s.get("type")
    if t == "object":
        assert isinstance(obj, dict) and all(isinstance(k, str) for k in obj), f"{path}: {obj!r} is not an object"
        props, extra = s.get("properties", {}), s.get("additionalProperties")
        for k, v in obj.items():
            if k in props:
                check_crd(v, props[k], f"{path}.{k}")
            elif isinstance(extra, dict):
                check_crd(v, extra, f"{path}.{k}")
            else:
                assert s.get("x-kubernetes-preserve-unknown-fields") or extra is True, f"{path}: no field {k!r}"
        for k in s.get("required", []):
            assert k in obj, f"{path}: requires {k!r}"
        assert len(obj) <= s.get("maxProperties", len(obj)), f"{path}: more than {s['maxProperties']} fields"
    elif t == "array":
        assert isinstance(obj, list), f"{path}: {obj!r} is not a list"
        for i, x in enumerate(obj):
            check_crd(x, s.get("items", {}), f"{path}[{i}]")
    elif t == "string":
        assert isinstance(obj, str), f"{path}: {obj!r} is not a string"
    elif t == "integer":
        assert isinstance(obj, int) and not isinstance(obj, bool), f"{path}: {obj!r} is not an integer"
    elif t == "number":
        assert isinstance(obj, (int, float)) and not isinstance(obj, bool), f"{path}: {obj!r} is not a number"
    elif t == "boolean":
        assert isinstance(obj, bool), f"{path}: {obj!r} is not a boolean"
    else:
        assert t is None and s.get("x-kubernetes-preserve-unknown-fields"), f"{path}: schema type {t!r}"
    if "enum" in s:
        assert obj in s["enum"], f"{path}: {obj!r} is not one of {s['enum']}"


def check_graph(doc: dict) -> None:
    """One emitted ``DynamoGraphDeployment`` against the pinned CRD (its metadata against ``ObjectMeta``)."""
    crd = _crd()
    group, version = doc["apiVersion"].split("/")
    assert (group, doc["kind"]) == (crd["group"], crd["kind"]) and version in crd["versions"]
    check(doc["metadata"], "V1ObjectMeta", "metadata")
    body = {k: v for k, v in doc.items() if k != "metadata"}
    check_crd(body, crd["versions"][version], doc["kind"])


def _graph(key: str) -> dict:
    return yaml.safe_load(_case(key)[1]["dynamo"]["graph.yaml"])


def test_dynamo_crd_provenance_and_a_bad_graph_fails():
    prov = _crd()["provenance"]
    assert re.fullmatch(r"[0-9a-f]{40}", prov["commit"]) and re.fullmatch(r"[0-9a-f]{40}", prov["file_commit"])
    assert prov["path"].endswith("nvidia.com_dynamographdeployments.yaml") and prov["dynamo_version"]
    doc = next(g for g in map(_graph, sorted(CASES)) if any("multinode" in s for s in g["spec"]["services"].values()))
    check_graph(doc)
    worker = next(n for n, s in doc["spec"]["services"].items() if "multinode" in s)

    def bad(edit) -> dict:
        d = json.loads(json.dumps(doc))
        edit(d["spec"]["services"][worker], d)
        return d

    for edit, msg in [
        (lambda w, d: w.__setitem__("componentTyp", w.pop("componentType")), "no field 'componentTyp'"),
        (lambda w, d: w["multinode"].__setitem__("nodeCuont", w["multinode"].pop("nodeCount")), "no field 'nodeCuont'"),
        (lambda w, d: w["extraPodSpec"]["mainContainer"].__setitem__("arg", []), "no field 'arg'"),
        (lambda w, d: w["resources"]["limits"].__setitem__("gpus", "4"), "no field 'gpus'"),
        (lambda w, d: d["spec"].__setitem__("service", d["spec"].pop("services")), "no field 'service'"),
        (lambda w, d: w.__setitem__("replicas", str(w["replicas"])), "not an integer"),
        (lambda w, d: w["resources"]["limits"].__setitem__("gpu", 4), "not a string"),
        (lambda w, d: d["spec"].__setitem__("backendFramework", "sgl"), "is not one of"),
        (lambda w, d: d["metadata"].__setitem__("nmae", "x"), "no field 'nmae'"),
    ]:
        with pytest.raises(AssertionError, match=msg):
            check_graph(bad(edit))


@pytest.mark.parametrize("key", sorted(CASES))
def test_dynamo_graph_is_valid_under_the_crd(key):
    doc = _graph(key)
    check_graph(doc)
    pl = plan_of(_case(key)[0])
    services = doc["spec"]["services"]
    groups = [gs for gs in (pl.prefill, pl.decode, pl.aggregated) if gs]
    workers = [s for s in services.values() if s["componentType"] == "worker"]
    assert sorted(s["replicas"] for s in workers) == sorted(len(gs) for gs in groups)
