"""What an operator pays for what replicas hold (`ember server --price`), and what an
endpoint's usage cost at those prices, pure.

    cpu=0.04/h,memory-gib=0.005/h,gpu:H100=2.5/h

A price is per hour unless it says `/s` or `/min`; a resource left out costs nothing."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

PER = {"h": 3600.0, "min": 60.0, "s": 1.0}
_PRICE = re.compile(r"^(?P<amount>\d+(\.\d*)?|\.\d+)(/(?P<per>h|min|s))?$")


@dataclass(frozen=True)
class Prices:
    """Per second: a CPU, a GiB of memory, a GPU of each type."""

    cpu: float = 0.0
    memory_gib: float = 0.0
    gpu: dict[str, float] = field(default_factory=dict)

    @property
    def set(self) -> bool:
        return bool(self.cpu or self.memory_gib or self.gpu)

    def per_second(self, cpu: float, memory_mib: int, gpu_type: str | None, gpus: int) -> float:
        """What a replica holding these costs a second."""
        rate = cpu * self.cpu + memory_mib / 1024 * self.memory_gib
        if gpu_type and gpus:
            rate += gpus * self.gpu.get(gpu_type, 0.0)
        return rate

    def of_usage(
        self, cpu_seconds: float, gib_seconds: float, gpu_seconds: dict[str, float]
    ) -> float:
        """What an endpoint's CPU-, GiB- and GPU-seconds (by type) cost."""
        cost = cpu_seconds * self.cpu + gib_seconds * self.memory_gib
        return cost + sum(
            seconds * self.gpu.get(kind, 0.0) for kind, seconds in gpu_seconds.items()
        )

    def describe(self) -> dict[str, object]:
        """Per hour, as the operator set them."""
        return {
            "cpu_per_hour": self.cpu * 3600,
            "memory_gib_per_hour": self.memory_gib * 3600,
            "gpu_per_hour": {kind: price * 3600 for kind, price in sorted(self.gpu.items())},
        }


def parse_prices(text: str) -> Prices:
    """`cpu=0.04/h,memory-gib=0.005/h,gpu:H100=2.5/h`; ValueError saying what is wrong."""
    cpu = memory = 0.0
    gpu: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        match = _PRICE.match(value.strip())
        if not sep or match is None:
            raise ValueError(
                f"price {item!r}: write RESOURCE=AMOUNT[/h|/min|/s], such as cpu=0.04/h, "
                "memory-gib=0.005/h or gpu:H100=2.5/h"
            )
        per_second = float(match["amount"]) / PER[match["per"] or "h"]
        name = name.strip()
        if name == "cpu":
            cpu = per_second
        elif name == "memory-gib":
            memory = per_second
        elif name.startswith("gpu:") and name[4:]:
            gpu[name[4:]] = per_second
        else:
            raise ValueError(f"price {item!r}: the resources are cpu, memory-gib and gpu:TYPE")
    return Prices(cpu, memory, gpu)
