"""``TorchModelConfig`` from Hugging Face configs (objects, saved config.json files, dicts with variations,
bare model types) and from the shipped presets equals, field by field, the values recorded in
``tests/data/torch_config_expected.json`` (``tests/torch_config_cases.py`` lists the cases)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from torch_config_cases import EXPECTED, build, cases, fields

_EXPECTED = json.loads(EXPECTED.read_text())


def test_every_case_is_recorded():
    assert sorted(_EXPECTED) == sorted(cases())


@pytest.mark.parametrize("case", cases())
def test_torch_config_equals_recorded_values(case, tmp_path):
    got, want = fields(build(case, tmp_path)), _EXPECTED[case]
    assert got.keys() == want.keys(), case
    diff = {k: (got[k], want[k]) for k in want if got[k] != want[k] or type(got[k]) is not type(want[k])}
    assert not diff, (case, diff)
