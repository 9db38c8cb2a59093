"""Host topology: which NICs and CPUs each device (GPU or host) should use."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from . import _rust
from .errors import InvalidArgumentError


class UnknownDeviceError(InvalidArgumentError, KeyError):
    """The topology has no device of that name."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


__all__ = ["DeviceTopology", "Topology", "UnknownDeviceError", "detect_topology"]


@dataclass(frozen=True)
class DeviceTopology:
    """One device: ``cuda:N`` or ``host``, its closest NICs, NUMA node and physical cores."""

    device: str
    nics: list[str] = field(default_factory=list)
    numa_node: int | None = None
    cpus: list[int] = field(default_factory=list)
    pci_bus_id: str | None = None


@dataclass(frozen=True)
class Topology:
    devices: list[DeviceTopology]
    nics: list[str]

    def device(self, name: str) -> DeviceTopology:
        """The entry for ``cuda:N`` or ``host``; ``UnknownDeviceError`` (a KeyError) if absent."""
        for d in self.devices:
            if d.device == name:
                return d
        raise UnknownDeviceError(
            f"no device {name!r} in the topology (have {[d.device for d in self.devices]})"
        )


def detect_topology(overrides: Mapping[str, Sequence[str]] | None = None) -> Topology:
    """Reads GPUs, NICs (by PCIe proximity), NUMA nodes and physical cores from sysfs.

    ``overrides`` maps a device (``"host"``, ``"cuda:0"``) to interface names to use instead,
    for containers and software providers (e.g. ``{"host": ["nic0", "nic1"]}``).
    """
    raw: dict[str, Any] = json.loads(_rust.detect_topology_json())
    devices = {
        d["device"]: DeviceTopology(
            device=d["device"],
            nics=list(d["nics"]),
            numa_node=d["numa_node"],
            cpus=list(d["cpus"]),
            pci_bus_id=(d["pci"] or {}).get("bus_id"),
        )
        for d in raw["devices"]
    }
    for name, nics in (overrides or {}).items():
        base = devices.get(name, DeviceTopology(device=name))
        devices[name] = DeviceTopology(name, list(nics), base.numa_node, base.cpus, base.pci_bus_id)
    return Topology(devices=list(devices.values()), nics=[n["name"] for n in raw["nics"]])
