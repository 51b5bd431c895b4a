"""Listing the shipped calibrations reads only each file's ``meta`` block (``sim.calibration.files._read_meta``):
the block it reads is the one a whole-file parse gives, for the shipped files and for written ones (JSON, gzip
JSON, YAML) with the block anywhere among the members and files read in chunks of any size."""

from __future__ import annotations

import gzip
import json

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.sim.calibration import files as F
from rackbed.topology.yamlio import read_text


def _whole(path) -> dict:
    text = read_text(path)
    data = json.loads(text) if ".json" in path.name else yaml.safe_load(text)
    meta = data.get("meta", {}) if isinstance(data, dict) else {}
    return meta if isinstance(meta, dict) else {}


def test_shipped_files_meta_is_the_whole_file_meta():
    files = [f for f in sorted(F.CALIBRATION_DIR.iterdir()) if f.is_file() and f.suffix != ".md"]
    assert files
    big = 0
    for f in files:
        assert F._read_meta(f) == _whole(f), f.name
        lazy = F._json_meta(f) if ".json" in f.name else F._yaml_meta(f.read_text())
        big += lazy is not None
    assert big >= 2  # the lazy path is taken (the large tables), not only the whole-file fallback


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.text(max_size=12),
                     st.floats(allow_nan=False, allow_infinity=False))
_values = st.recursive(_scalars, lambda c: st.one_of(st.lists(c, max_size=4),
                                                     st.dictionaries(st.text(max_size=6), c, max_size=4)),
                       max_leaves=12)


@settings(max_examples=80, deadline=None)
@given(meta=st.dictionaries(st.text(min_size=1, max_size=8), _values, max_size=5),
       before=st.dictionaries(st.sampled_from(["version", "a", "kernel_fixed_us"]), _values, max_size=3),
       n_entries=st.integers(0, 50), chunk=st.integers(1, 200), gz=st.booleans(), indent=st.sampled_from([None, 1]))
def test_json_meta_in_chunks(tmp_path_factory, meta, before, n_entries, chunk, gz, indent):
    doc = {**before, "meta": meta, "entries": [{"kind": "hbm_GBps", "points": [[1, 2.5]] * 3}] * n_entries}
    text = json.dumps(doc, indent=indent)
    d = tmp_path_factory.mktemp("m")
    f = d / ("t.json.gz" if gz else "t.json")
    f.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    assert F._json_meta(f, chunk) == json.loads(text)["meta"]
    assert F._read_meta(f) == meta


@settings(max_examples=40, deadline=None)
@given(meta=st.dictionaries(st.text(min_size=1, max_size=8), _values, max_size=5), n_entries=st.integers(0, 20))
def test_yaml_meta_as_written(tmp_path_factory, meta, n_entries):
    doc = {"version": 2, "meta": {"gpu": "X", **meta},
           "entries": [{"kind": "hbm_GBps", "gpu": "X", "key": {}, "points": [[1, 2.5], [4, 3.0]]}] * n_entries}
    f = tmp_path_factory.mktemp("y") / "t.yaml"
    F.dump_calibration(doc, f)
    assert F._read_meta(f) == _whole(f) == doc["meta"]


def test_json_without_meta_or_not_an_object(tmp_path):
    for text, want in (('{"entries": [], "version": 2}', {}), ("[1, 2]", {}), ('{"meta": 3}', {}),
                       ('{"meta": {"gpu": "G"}, "entries": [', {"gpu": "G"})):
        f = tmp_path / "x.json"
        f.write_text(text)
        assert F._read_meta(f) == want, text
