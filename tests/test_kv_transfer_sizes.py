"""What the simulator ships per KV transfer: whole sequence for full / MLA layers (the latent once), only the
window for sliding-window layers; the chunk count of the resharding plan for latent and windowed models."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sim_driver_models import small_deployment

from rackbed.engine.core.deployment import kv_transfer_sizes
from rackbed.engine.core.kv import KvLayout, transfer_stats
from rackbed.engine.core.model import PRESET_NAMES, get_model
from rackbed.sim import scenario as S


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_sizes_match_the_model(name):
    """Without sliding layers the per-token bytes are ModelSpec.kv_bytes_per_token (Qwen runs unchanged); with
    them the bytes of any prompt are ModelSpec.kv_bytes_per_seq (windows capped), DeltaNet state aside."""
    m = get_model(name)
    per_tok, windows = kv_transfer_sizes(m, 2)
    if "sliding" not in m.layer_types:
        assert (per_tok, windows) == (m.kv_bytes_per_token(2), ())
    else:
        assert windows == ((m.sliding_window, m.n_layers_of("sliding") * m.mixer("sliding").kv_bytes_per_token(2)),)
    if name.startswith(("deepseek", "kimi")):  # the latent, once (not per TP replica)
        assert per_tok == m.n_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * 2


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 200_000), st.sampled_from(["gpt-oss-120b", "qwen3-235b-a22b", "deepseek-v3"]))
def test_transfer_bytes_are_the_sequence_kv(tokens, name):
    m = get_model(name)
    per_tok, windows = kv_transfer_sizes(m, 2)
    dep = small_deployment()
    dep = type(dep)(**{**dep.__dict__, "kv_bytes_per_token": per_tok, "kv_window_bytes": windows})
    assert dep.kv_transfer_bytes(tokens) == m.kv_bytes_per_seq(tokens, 2)


def test_gpt_oss_scenario_ships_windows_and_counts_chunks():
    """A gpt-oss-120b deployment (TP-4 prefill -> DP decode, 64-token pages): bytes per transfer cap the sliding
    layers at the window; kv_chunks equals the plan's chunks for sequences past the window ending mid-page."""
    d = yaml.safe_load((S.Path(__file__).resolve().parents[1] / "scenarios" / "nvl72-default.yaml").read_text())
    d.update(model="gpt-oss-120b", weight_format="mxfp4", mtp={"draft_k": 0})
    d["prefill"].update(replicas=1)
    d["decode"].update(replicas=1, ep=8)
    b = S.build(S.parse_scenario(d))
    dep = b.deployment
    assert dep.kv_transfer_bytes(6000) == (18 * 6000 + 18 * 128) * 2 * 8 * 64 * 2
    src, dst = KvLayout.for_plan(b.prefill_plan, b.model, 1), KvLayout.for_plan(b.decode_plan, b.model, 1)
    pf, dc = dep.prefillers[0], dep.decoders[0]
    for tokens in (1000, 6000, 20_000):  # ends mid-page: exact
        assert b.cost_model.kv_chunks(pf, dc, tokens) == transfer_stats(src, dst, tokens).n_chunks
    exact = transfer_stats(src, dst, 20_032).n_chunks  # page-aligned: partial pages merge, 576 fewer chunks
    assert exact < b.cost_model.kv_chunks(pf, dc, 20_032) <= exact * 1.02
