"""The one Hugging Face reader (``engine.core.model_hf.read_hf_config``): its per-family defaults table is
transformers' config-class defaults, a config.json missing any subset of keys reads as the full config does
(what ``save_pretrained`` relies on), and the torch engine's config derives from the same reading."""

from __future__ import annotations

import json

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from rackbed.engine.core.model_hf import HF_DEFAULTS, read_hf_config
from rackbed.topology.errors import UserError

transformers = pytest.importorskip("transformers")

from torch_config_cases import CONFIG_CLASS, MODEL_TYPE, TINY_ALL  # noqa: E402

CLASSES = {**CONFIG_CLASS, "qwen3_next": "Qwen3NextConfig"}
#: keys transformers keeps inside ``rope_parameters``
ROPE_KEYS = ("rope_theta", "partial_rotary_factor")
#: keys of the table a transformers class does not have: DeepSeek's own config code has moe_layer_freq 1; the
#: Qwen3-Next / Qwen3.5 classes state layer_types (every 4th layer full: checked below) and leave MTP out
NOT_IN_TRANSFORMERS = {("deepseek_v3", "moe_layer_freq"), ("qwen3_next", "full_attention_interval"),
                       ("qwen3_next", "mtp_num_hidden_layers"), ("qwen3_5_moe", "full_attention_interval"),
                       ("qwen3_5_moe", "mtp_num_hidden_layers")}


@pytest.mark.parametrize("family", sorted(CLASSES))
def test_defaults_table_is_transformers_defaults(family):
    d = getattr(transformers, CLASSES[family])().to_dict()
    for key, want in HF_DEFAULTS[family].items():
        if key in ROPE_KEYS:
            got = d["rope_parameters"][key]
        elif key == "head_dim" and want is None:      # hidden // heads, left to the reader
            continue
        elif (family, key) in NOT_IN_TRANSFORMERS:
            assert key not in d
            continue
        elif key == "num_experts":
            got = d.get("num_experts", d.get("num_local_experts"))
        else:
            got = d[key]
        assert got == want, (family, key, got, want)
    if "full_attention_interval" in HF_DEFAULTS[family]:
        every = HF_DEFAULTS[family]["full_attention_interval"]
        assert d["layer_types"] == ["linear_attention" if (i + 1) % every else "full_attention"
                                    for i in range(d["num_hidden_layers"])]


def test_kimi_k2_reads_as_deepseek_v3():
    a = read_hf_config({"model_type": "kimi_k2", **TINY_ALL["deepseek_v3"]}, "k.json")
    b = read_hf_config({"model_type": "deepseek_v3", **TINY_ALL["deepseek_v3"]}, "k.json")
    assert a.family == "deepseek_v3" and a.model_type == "kimi_k2"
    assert (a.spec, a.rope_scaling, a.n_group, a.routed_scaling) == (b.spec, b.rope_scaling, b.n_group,
                                                                      b.routed_scaling)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(TINY_ALL))
@given(data=st.data())
def test_omitted_keys_read_as_transformers_fills_them(family, data):
    """A config.json missing any subset of the keys the full config (``to_dict``: every key explicit) states
    gives the same reading and the same TorchModelConfig as that config object with transformers' defaults."""
    from rackbed.engine.real.config import TorchModelConfig

    hc = getattr(transformers, CONFIG_CLASS[family])(**TINY_ALL[family])
    full = json.loads(hc.to_json_string(use_diff=False))
    keys = sorted(k for k in full if k != "model_type")
    drop = data.draw(st.sets(st.sampled_from(keys)))
    partial = {k: v for k, v in full.items() if k not in drop}
    # the class's own defaults fill what was dropped (as loading the saved config.json does)
    try:
        oracle = transformers.AutoConfig.for_model(MODEL_TYPE[family],
                                                   **{k: v for k, v in partial.items() if k != "model_type"})
    except Exception:       # transformers refuses the mix (e.g. 2 layer_types for its default 36 layers)
        assume(False)
    a, b = read_hf_config(partial, "c.json"), read_hf_config(oracle.to_dict(), "c.json")
    assert a == b and a.spec == b.spec
    assert _outcome(TorchModelConfig.from_hf, partial) == _outcome(TorchModelConfig.from_hf, oracle)


def _outcome(f, x):
    """``f(x)``, or the error it raises (a default can make a tiny model all dense, which the engine
    refuses)."""
    try:
        return f(x)
    except ValueError as e:
        return str(e)


def test_bad_runtime_values_are_one_line_user_errors():
    base = {"model_type": "deepseek_v3", **TINY_ALL["deepseek_v3"]}
    for over, key in (({"rope_parameters": {"rope_type": "default", "rope_theta": "big"}}, "rope_theta"),
                      ({"rms_norm_eps": -1.0}, "rms_norm_eps"), ({"routed_scaling_factor": "x"},
                                                                 "routed_scaling_factor"),
                      ({"rope_parameters": [1]}, "rope_parameters"), ({"n_group": "4"}, "n_group")):
        with pytest.raises(UserError, match=f"c.json: {key}") as e:
            read_hf_config({**base, **over}, "c.json")
        assert "\n" not in str(e.value)
