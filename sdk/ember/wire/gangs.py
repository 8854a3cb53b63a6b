"""A gang member's place, as the control plane tells its worker in `start_replica`."""

from __future__ import annotations

from typing import Annotated

import msgspec


class GangMember(msgspec.Struct, frozen=True, kw_only=True):
    """A member's place in a replica that spans several nodes: its rank, its peers, and
    the ports the gang's members listen on (member r: `ports_each` from `first_port` +
    r * `ports_each`; rank 0's first is MASTER_PORT)."""

    gang_id: Annotated[str, msgspec.Meta(max_length=40)]
    rank: Annotated[int, msgspec.Meta(ge=0, le=1023)]
    size: Annotated[int, msgspec.Meta(ge=2, le=1024)]
    master_addr: Annotated[str, msgspec.Meta(max_length=255)]
    first_port: Annotated[int, msgspec.Meta(ge=1024, le=65535)]
    ports_each: Annotated[int, msgspec.Meta(ge=2, le=1024)]

    def ports_of(self, rank: int) -> tuple[int, int]:
        """(first, last) of the ports member `rank` listens on."""
        first = self.first_port + rank * self.ports_each
        return first, first + self.ports_each - 1
