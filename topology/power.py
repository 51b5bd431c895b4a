"""Peak power of a set of GPUs per rack, and the rack power limit as a placement constraint.

A deployment draws, in each rack it touches, at most: every GPU it holds at ``GpuPower.compute_bound_w``, the
overhead of every node (host) those GPUs sit in (``NodeSpec.overhead_w``) and the rack's own overhead
(``RackSpec.overhead_w``). :func:`check_rack_power` refuses a deployment whose peak in some rack exceeds that
rack's ``rack_power_kw`` with one line naming the rack, the draw and the limit. It is called once placement is
done (``sim.scenario.build``), on the GPUs the deployment reserves (groups and spare pool).
"""

from __future__ import annotations

from collections.abc import Iterable

from rackbed.topology.errors import UserError
from rackbed.topology.graph import RackPower


def rack_peak_w(topo, gpus: Iterable[int]) -> list[tuple[RackPower, int, float]]:
    """``(RackPower, GPUs held there, peak watts)`` for every rack of ``topo`` that holds one of ``gpus``
    (empty when the topology has no rack layout). GPUs without a power figure count 0 W."""
    held = set(gpus)
    out = []
    for rack in getattr(topo, "racks", ()):
        mine = [g for g in rack.gpus if g in held]
        if not mine:
            continue
        hosts = {topo.host_of(g) for g in mine}
        w = sum(p.compute_bound_w for p in (topo.gpu_spec(g).power for g in mine) if p is not None)
        w += rack.node_overhead_w * len(hosts) + rack.rack_overhead_w
        out.append((rack, len(mine), w))
    return out


def deployment_gpus(dep) -> list[int]:
    """Every GPU a deployment reserves: its groups' and its spare pool's."""
    groups = (*dep.prefillers, *dep.decoders, *dep.aggregated)
    return [g for grp in groups for g in grp.gpus] + list(dep.spare_gpus)


def check_rack_power(dep, topo) -> None:
    """Refuse (one-line UserError) a deployment whose peak draw in a rack exceeds its ``rack_power_kw``."""
    for rack, n, w in rack_peak_w(topo, deployment_gpus(dep)):
        if rack.limit_kw is not None and w > rack.limit_kw * 1e3 * (1 + 1e-12):
            raise UserError(
                f"deployment {dep.name}: {n} GPUs in rack {rack.name} of {topo.name} would draw up to "
                f"{w / 1e3:.1f} kW at peak (GPUs at their power limit plus node and rack overhead), over the "
                f"rack's {rack.limit_kw:g} kW (rack_power_kw)")
