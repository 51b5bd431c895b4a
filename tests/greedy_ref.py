"""Plain greedy decoding of a real-engine model, the reference speculative decoding is checked against: the first
token of the prefill, then one decode step at a time. A helper module: the tests import it by name under
``pytest`` and ``python -m pytest`` alike."""

from __future__ import annotations

import torch


def page_table(pts):
    """The page lists of a batch as one tensor, short rows padded with their first page."""
    width = max(len(p) for p in pts)
    return torch.tensor([p + [p[0]] * (width - len(p)) for p in pts])


@torch.inference_mode()
def greedy(model, prompts, n, *, page: int, n_pages: int = 64):
    """``n`` greedy tokens per prompt: the prefill's first, then ``n - 1`` decode steps (``page`` tokens a KV
    page, ``n_pages`` pages in the cache)."""
    cache = model.new_cache(n_pages, page)
    pts = [cache.alloc(len(p)) for p in prompts]
    toks = [[t] for t in model.forward_prefill(prompts, cache, pts).argmax(-1).tolist()]
    pos = [len(p) for p in prompts]
    for _ in range(n - 1):
        for i, pt in enumerate(pts):
            cache.grow(pt, pos[i] + 1)
        lo = model.forward_decode(torch.tensor([t[-1] for t in toks]), torch.tensor(pos), cache, page_table(pts))
        for i, t in enumerate(lo.argmax(-1).tolist()):
            toks[i].append(t)
            pos[i] += 1
    return toks
