"""Layer kinds: what one decoder layer is made of, as frozen data every consumer reads.

A model is a list of ``Layer(attention, ffn)``; layers of one kind are identical, so consumers group by kind and
multiply. Token mixers (``attention``):

=================  ==========================  =====================================  ===========================
kind (tag)         class (module)              cache per request and layer            under attention TP
=================  ==========================  =====================================  ===========================
``full``           ``GqaAttention`` (gqa)      2 * n_kv_heads * head_dim per token    split by KV heads, then
                                                                                      replicated
``sliding``        ``SlidingWindowAttention``  as ``full``, at most ``window`` tokens as ``full``
                   (gqa)
``linear``         ``GdnAttention`` (gdn)      recurrent + conv state, fixed size     split by heads
``mla``            ``MlaAttention`` (mla)      kv_lora_rank + qk_rope_head_dim per    replicated on every rank
                                               token (not split by heads)
=================  ==========================  =====================================  ===========================

Under DP attention every kind is partitioned by request (a rank holds its requests' cache whole). FFN kinds:
``DenseFfn`` and ``MoeFfn`` (ffn). Each kind answers parameter counts, cache bytes, how its cache shards, and the
FLOPs / bytes / GEMM shapes the cost models price (``base.AttentionKind`` lists the interface).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from rackbed.engine.core.layers.base import AttentionKind, split_heads
from rackbed.engine.core.layers.ffn import DenseFfn, MoeFfn
from rackbed.engine.core.layers.gdn import DELTANET_FLOPS_PER_STATE_ELEM, GdnAttention
from rackbed.engine.core.layers.gqa import GqaAttention, SlidingWindowAttention, tp_kv_head_shards
from rackbed.engine.core.layers.mla import MlaAttention

Attention = Annotated[GqaAttention | SlidingWindowAttention | GdnAttention | MlaAttention,
                      Field(discriminator="kind")]
Ffn = Annotated[DenseFfn | MoeFfn, Field(discriminator="kind")]


class Layer(BaseModel):
    """One decoder layer: its token mixer and its feed-forward block."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attention: Attention
    ffn: Ffn


__all__ = ["DELTANET_FLOPS_PER_STATE_ELEM", "Attention", "AttentionKind", "DenseFfn", "Ffn", "GdnAttention",
           "GqaAttention", "Layer", "MlaAttention", "MoeFfn", "SlidingWindowAttention", "split_heads",
           "tp_kv_head_shards"]
