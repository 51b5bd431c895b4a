"""Speculative decoding with the model's MTP module as the draft: one decode step of a decoder rank's batch.

A step of a sequence whose KV holds positions ``0 .. L-1`` and whose next input token ``t_L`` is known:

1. **Draft** (``k`` forwards of the MTP module, ``ShardedMoeLM.forward_mtp``). The first forward runs the module at
   the positions whose module KV is still missing — the ones the previous step accepted, ``L-n .. L-1``, fed the
   target's hidden state there and the token that followed — and its last row proposes ``d1``. Each further
   forward applies the module recurrently, as DeepSeek-V3 and EAGLE-style MTP do: its own output hidden state and
   the draft just proposed, one position on, propose the next draft.
2. **Verify**: one forward of the target over ``[t_L, d1 .. dk]`` at positions ``L .. L+k`` (``k + 1`` rows of the
   sequence in the batch: their KV is written to the paged cache before any row attends, row ``i`` attends to
   positions ``<= L+i``), giving the target's greedy token ``g_i`` after each row.
3. **Accept** the longest prefix of drafts equal to the target's tokens (``d_{i+1} == g_i``): ``a`` drafts, so the
   step emits ``g_0 .. g_a`` (``1 + a`` tokens, exactly what ``1 + a`` plain greedy steps would emit) and the
   sequence's length grows by ``1 + a``. The KV written for rejected positions is overwritten by later steps (no
   row ever attends past its own position). The hidden states of the accepted rows are kept for the next step's
   first draft forward.

A sequence that has just joined the rank (its KV came from a prefiller, or an aggregated rank's own prefill) has no
target hidden state yet: its first step verifies ``[t_L]`` alone (no drafts) and keeps that row's hidden state.
The prefill wrote the module's KV of the prompt (``ShardedMoeLM.forward_prefill``), and the KV transfer ships it
with the other layers (layer ``n_layers`` of the cache).

Every rank of an EP group runs the same number of forwards per step (``k`` drafts, then the verify), with or
without rows of its own, so the expert all-to-all of each forward is matched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def draft_room(cache, seqs, k: int) -> list[int]:
    """Drafts each sequence can verify this step: ``k``, or fewer when the cache cannot hold its ``k`` extra
    positions (its pages are grown for ``length + 1`` at least, which the caller's allocator guarantees); 0 for a
    sequence without a target hidden state (just joined). The caller holds the page allocator's lock."""
    S = cache.page_tokens
    out = []
    for s in seqs:
        if s.mtp_h is None:
            cache.grow(s.pages, s.length + 1)
            out.append(0)
            continue
        try:
            cache.grow(s.pages, s.length + 1 + k)
            room = k
        except MemoryError:
            cache.grow(s.pages, s.length + 1)
            room = min(k, len(s.pages) * S - s.length - 1)
        out.append(room)
    return out


def _rows_table(tables: torch.Tensor, seq_of_row: list[int], dev) -> torch.Tensor:
    if not seq_of_row:
        return torch.zeros(0, max(tables.shape[1], 1), dtype=torch.long, device=dev)
    return tables[torch.tensor(seq_of_row, device=dev)]


@torch.inference_mode()
def mtp_step(model, cache, seqs, rooms: list[int], k: int, *, verify=None,
             draft_hook: Callable | None = None) -> list[list[int]]:
    """One speculative step of ``seqs`` (objects with ``pages``, ``length``, ``last_token``, ``tokens``,
    ``mtp_h`` / ``mtp_next``: the worker's ``_Seq``) with ``rooms[i]`` drafts each (:func:`draft_room`; ``k``
    draft forwards are run). ``verify(tokens, positions, page_table)`` -> ``(logits, hidden)``: the target's
    forward (default ``model.forward_decode(..., hidden=True)``; a CUDA-graph runner on GPUs). ``draft_hook(seq,
    j, proposed) -> token`` replaces draft ``j`` (1-based) of a sequence (tests: a draft made to agree). Updates
    each sequence and returns the tokens each one emits (``1 + accepted``)."""
    dev = cache.storage.device
    D = model.cfg.hidden
    B = len(seqs)
    sync = model.shard.ep > 1          # every rank of the expert group runs every forward
    if B:
        width = max(len(s.pages) for s in seqs)
        tables = torch.tensor([s.pages + [s.pages[0]] * (width - len(s.pages)) for s in seqs], device=dev)
    else:
        tables = torch.zeros(0, 1, dtype=torch.long, device=dev)
    drafts: list[list[int]] = [[] for _ in seqs]
    # draft 1: the module at the positions whose module KV is missing (the last accepted ones), last row proposes
    rows_seq, toks, hs, pos, last_row = [], [], [], [], {}
    for i, s in enumerate(seqs):
        if s.mtp_h is None:
            continue
        n = s.mtp_h.shape[0]
        rows_seq += [i] * n
        toks += s.mtp_next
        hs.append(s.mtp_h)
        pos += range(s.length - n, s.length)
        last_row[i] = len(rows_seq) - 1
    g_prev: dict[int, torch.Tensor] = {}
    if k and (rows_seq or sync):
        logits, g = model.forward_mtp(torch.tensor(toks, dtype=torch.long, device=dev),
                                      torch.cat(hs) if hs else torch.zeros(0, D, device=dev,
                                                                          dtype=model.glob["embed"].dtype),
                                      torch.tensor(pos, dtype=torch.long, device=dev), cache,
                                      _rows_table(tables, rows_seq, dev))
        best = logits.argmax(-1).tolist()
        for i, r in last_row.items():
            if rooms[i] >= 1:
                d = best[r]
                drafts[i].append(draft_hook(seqs[i], 1, d) if draft_hook else d)
                g_prev[i] = g[r]
    # drafts 2..k: the module applied recurrently, one position on, fed its own output hidden state
    for j in range(2, k + 1):
        live = [i for i in g_prev if rooms[i] >= j]
        if not live and not sync:
            break
        logits, g = model.forward_mtp(
            torch.tensor([drafts[i][-1] for i in live], dtype=torch.long, device=dev),
            torch.stack([g_prev[i] for i in live]) if live else torch.zeros(0, D, device=dev,
                                                                          dtype=model.glob["embed"].dtype),
            torch.tensor([seqs[i].length + j - 2 for i in live], dtype=torch.long, device=dev), cache,
            _rows_table(tables, live, dev))
        best = logits.argmax(-1).tolist()
        g_prev = {}
        for r, i in enumerate(live):
            drafts[i].append(draft_hook(seqs[i], j, best[r]) if draft_hook else best[r])
            g_prev[i] = g[r]
    # verify: [last token, d1 .. dk] of every sequence at positions L .. L+k
    rows_seq, toks, pos, first = [], [], [], []
    for i, s in enumerate(seqs):
        first.append(len(rows_seq))
        row = [s.last_token] + drafts[i]
        rows_seq += [i] * len(row)
        toks += row
        pos += range(s.length, s.length + len(row))
    vt = torch.tensor(toks, dtype=torch.long, device=dev)
    vp = torch.tensor(pos, dtype=torch.long, device=dev)
    vtab = _rows_table(tables, rows_seq, dev)
    if verify is None:
        logits, hid = model.forward_decode(vt, vp, cache, vtab, hidden=True)
    else:
        logits, hid = verify(vt, vp, vtab)
    best = logits.argmax(-1).tolist()
    out = []
    for i, s in enumerate(seqs):
        f, d = first[i], drafts[i]
        g = best[f:f + len(d) + 1]
        a = 0
        while a < len(d) and d[a] == g[a]:
            a += 1
        s.tokens.append(s.last_token)
        s.tokens += d[:a]
        s.length += 1 + a
        s.last_token = g[a]
        s.mtp_h = hid[f:f + a + 1].clone()
        s.mtp_next = g[:a + 1]
        out.append(g[:a + 1])
    return out
