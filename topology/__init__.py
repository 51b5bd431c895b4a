"""What the hardware is: GPU / switch / NIC specs, rack and cluster graphs, presets.

``topology.load(name_or_path)`` returns a :class:`Topology` for a preset (``gb200-nvl72``, ``gb300-nvl72``,
``hgx-h200``, ``hgx-h200-efa``, ``hgx-b200``, ``hgx-b300``, ``hgx-h100``, ``hgx-h800``, ``h200x2``, ``NAME*N``) or
a YAML / JSON topology file.
"""

from rackbed.topology.errors import UserError
from rackbed.topology.graph import Hop, Topology
from rackbed.topology.io import dump, dumps, from_dict, load, load_file, to_dict
from rackbed.topology.presets import PRESETS, build, preset, preset_names
from rackbed.topology.specs import (
    ClusterSpec,
    CpuSpec,
    FabricSpec,
    FormatRates,
    GpuSpec,
    LinkSpec,
    NicSpec,
    NodeSpec,
    RackSpec,
    SwitchSpec,
)

__all__ = [
    "PRESETS",
    "ClusterSpec",
    "CpuSpec",
    "FabricSpec",
    "FormatRates",
    "GpuSpec",
    "Hop",
    "LinkSpec",
    "NicSpec",
    "NodeSpec",
    "RackSpec",
    "SwitchSpec",
    "Topology",
    "UserError",
    "build",
    "dump",
    "dumps",
    "from_dict",
    "load",
    "load_file",
    "preset",
    "preset_names",
    "to_dict",
]
