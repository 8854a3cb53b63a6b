"""What an owner that stops in order does for the synchronous calls it holds, when another
process of the platform takes over: they are answered at once with a 503
`control_plane_stopping`, which the SDK sends again by itself for calls that may run
twice, rather than wait on a queue no replica will serve again (the replicas' channels
close with this process) until the HTTPS server's graceful stop runs out. Spawned calls
stay queued in the store for the next owner."""

from __future__ import annotations

import asyncio

from ember_platform.core.cluster import Cluster
from ember_platform.runtime.inputs import Outcome

EVERY_S = 0.05
STOPPING = Outcome.error(
    503,
    "control_plane_stopping",
    "the control-plane process holding this call stopped before it ran to its end (it may "
    "have begun); another process of the platform takes the calls now: retry it",
)


async def answer_sync_calls_while_stopping(cluster: Cluster) -> None:
    """Until cancelled: every synchronous input queued (new, or back from a replica that
    went with the channels) ends with STOPPING."""
    while True:
        for runtime in [*cluster.endpoints.values(), *cluster.canaries.values()]:
            for inp in [i for i in runtime.pending if not i.is_async]:
                runtime.pending.remove(inp)
                cluster.input_lifecycle.finish(inp, STOPPING)
        await asyncio.sleep(EVERY_S)
