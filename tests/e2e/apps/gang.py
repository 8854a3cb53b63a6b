"""Replicas over two nodes. `Pair`: its members form a torch.distributed group over gloo,
rank 0 takes the calls and has every rank add its share with an all-reduce. `Every`:
every rank takes each call (gang_inputs="every_rank") and adds its share likewise.
`Lonely`: rank 0 never joins its group, so rank 1's rendezvous times out and fails the
start."""

import asyncio
import datetime
import os
import threading
from typing import Any

import ember

SHOWN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "EMBER_GANG_PORTS")


@ember.endpoint(nodes=2, cpu=0.5, memory=512, max_replicas=1, snapshot=False, gang_ports=16)
class Pair:
    @ember.enter()
    def join(self) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        self.rank = dist.get_rank()
        if self.rank != 0:  # the others follow rank 0's steps for as long as they live
            threading.Thread(target=self.follow, daemon=True).start()

    def follow(self) -> None:
        while True:
            self.step(0.0)

    def step(self, value: float) -> float:
        """Rank 0's value to every rank, each adding (its rank + 1) times it."""
        import torch
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        share = torch.tensor([box[0] * (self.rank + 1)])
        dist.all_reduce(share)
        return float(share.item())

    @ember.method()
    def total(self, value: float) -> dict[str, Any]:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:  # its network's own
            local_ports = ports.read().split()
        return {
            "sum": self.step(value),
            "env": {key: os.environ.get(key) for key in SHOWN},
            "local_ports": local_ports,
        }

    @ember.method()
    def fail(self) -> None:
        raise ValueError("this call fails; the gang serves on")


@ember.endpoint(
    nodes=2,
    cpu=0.5,
    memory=512,
    max_replicas=1,
    snapshot=False,
    gang_ports=16,
    gang_inputs="every_rank",
)
class Every:
    @ember.enter()
    def join(self) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        self.rank = dist.get_rank()

    @ember.method()
    def total(self, value: float) -> dict[str, Any]:
        """Each rank's (rank + 1) times the value it was given, summed over the ranks."""
        import torch
        import torch.distributed as dist

        share = torch.tensor([value * (self.rank + 1)])
        dist.all_reduce(share)
        return {"sum": float(share.item()), "rank": self.rank}

    @ember.method()
    async def fail_on_rank_1(self) -> str:
        if self.rank == 1:
            raise ValueError("rank 1 cannot")
        await asyncio.sleep(60)  # rank 0 waits for a step its peer never takes
        return "never"


@ember.endpoint(nodes=2, cpu=0.5, memory=512, max_replicas=1, snapshot=False, gang_ports=4)
class Lonely:
    @ember.enter()
    def join(self) -> None:
        if os.environ["RANK"] == "0":
            return  # never joins: its peer waits for it in vain
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=1))

    @ember.method()
    def ping(self) -> str:
        return "pong"
