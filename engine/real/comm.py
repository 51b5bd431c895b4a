"""Collectives the torch engine needs, behind one small object.

``Comm`` wraps torch.distributed process groups (gloo on CPU, NCCL on GPUs). On GPUs the TP all-reduce can be
served by the peer-memory kernels of ``kernels.allreduce`` (``use_peer_allreduce``); every call site stays the same.
A ``Comm()`` with no groups is the single-rank case: every collective is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rackbed.engine.real.profiling import scoped


@dataclass
class Comm:
    tp_group: object | None = None   # attention TP group (prefill); None = size 1
    ep_group: object | None = None   # expert group; None = size 1
    tp_allreduce_impl: object | None = None  # optional callable(tensor) -> tensor replacing dist.all_reduce

    @staticmethod
    def _size(group) -> int:
        return 1 if group is None else dist.get_world_size(group)

    @property
    def tp_size(self) -> int:
        return self._size(self.tp_group)

    @property
    def ep_size(self) -> int:
        return self._size(self.ep_group)

    @scoped("allreduce_s")
    def tp_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        if self.tp_allreduce_impl is not None:
            return self.tp_allreduce_impl(x)
        dist.all_reduce(x, group=self.tp_group)
        return x

    @scoped("allreduce_s")
    def ep_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The prefill MoE combine: sum of every rank's local-expert contributions."""
        if self.ep_size == 1:
            return x
        if self.tp_allreduce_impl is not None and self.ep_group is self.tp_group:
            return self.tp_allreduce_impl(x)
        dist.all_reduce(x, group=self.ep_group)
        return x

    @scoped("a2a_s")
    def ep_exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """Rows this rank will receive from each peer, given the rows it sends to each (``[ep]`` int64)."""
        recv = torch.empty_like(send_counts)
        dist.all_to_all_single(recv, send_counts.contiguous(), group=self.ep_group)
        return recv

    @scoped("a2a_s")
    def ep_all_to_all(self, x: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        """Rows of ``x`` (grouped by destination rank) to their ranks; returns the rows received, by source."""
        out = torch.empty((int(recv_counts.sum()), *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv_counts.tolist(),
                               input_split_sizes=send_counts.tolist(), group=self.ep_group)
        return out
