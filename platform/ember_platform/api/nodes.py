"""Worker nodes (`ember node drain | uncordon`): a drained node takes no new replicas
and its replicas move elsewhere; uncordoned, it takes replicas again. A GPU fenced for
its health is uncordoned alone (`ember node uncordon NODE --gpu N`)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ember.wire import messages as wire
from ember_platform.core.cluster import Cluster
from ember_platform.edge.errors import HttpError
from ember_platform.security.tokens import Scope, TokenRegistry

MAX_GPU_DIGITS = 4  # a node's GPUs are counted in tens


class NodesApi:
    def __init__(self, tokens: TokenRegistry, cluster: Cluster) -> None:
        self.tokens = tokens
        self.cluster = cluster

    async def drain_node(self, request: Request) -> Response:
        self.tokens.require(request.headers.get("authorization"), Scope.ADMIN)
        name = self._node_name(request)
        return JSONResponse(
            {"node": name, "draining_replicas": self.cluster.roster.drain_node(name)}
        )

    async def uncordon_node(self, request: Request) -> Response:
        self.tokens.require(request.headers.get("authorization"), Scope.ADMIN)
        name = request.path_params["name"]
        if not self.cluster.roster.uncordon_node(name):
            raise HttpError(409, "not_draining", f"node {name} is not draining")
        return JSONResponse({"node": name})

    async def uncordon_gpu(self, request: Request) -> Response:
        self.tokens.require(request.headers.get("authorization"), Scope.ADMIN)
        name = self._node_name(request)
        given = request.path_params["index"]
        if not (given.isdigit() and given.isascii() and len(given) <= MAX_GPU_DIGITS):
            raise HttpError(
                400, "invalid_request", f"a GPU's index is a number from 0, not {given[:20]!r}"
            )
        index = int(given)
        workers = [w for w in self.cluster.workers.values() if w.name == name]
        fenced = [w for w in workers if any(g.fenced and g.index == index for g in w.gpu_health)]
        if not fenced:
            gpus = sorted({g.index for w in workers for g in w.gpu_health if g.fenced})
            listed = ", ".join(map(str, gpus)) or "none"
            raise HttpError(
                409, "not_fenced", f"GPU {index} of node {name} is not fenced (fenced: {listed})"
            )
        for worker in fenced:
            worker.send(wire.UncordonGpu(index=index))
        return JSONResponse({"node": name, "gpu": index})

    def _node_name(self, request: Request) -> str:
        name = request.path_params["name"]
        if not any(w.name == name for w in self.cluster.workers.values()):
            known = ", ".join(sorted({w.name for w in self.cluster.workers.values()})) or "none"
            raise HttpError(404, "not_found", f"no worker node named {name} (nodes: {known})")
        return name
