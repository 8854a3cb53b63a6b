"""What a replica's process is given on this node: its environment (the node's caches,
its endpoint's secrets, never the worker's own tokens), the GPUs it holds and no other,
and how `ember replica exec` runs commands in it."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from ember.state.volume_paths import VOLUMES_DIR_ENV
from ember.wire import messages as wire
from ember_worker.agent.config import AgentConfig
from ember_worker.agent.log_shipping import Note
from ember_worker.agent.replica_exec import ExecContext
from ember_worker.agent.running_replica import RunningReplica
from ember_worker.gpu_slots import VISIBLE_DEVICES_ENV, GpuSlots, visible_devices
from ember_worker.identity import WEIGHTS_CACHE_BYTES_ENV, WEIGHTS_CACHE_DIR_ENV
from ember_worker.processes import sandbox_exec
from ember_worker.processes.process_env import replica_base
from ember_worker.processes.replica_users import ReplicaUser
from ember_worker.processes.sandbox_mounts import SandboxPlan
from ember_worker.resources import GpuDevice

REPLICA_PID_ENV = "EMBER_REPLICA_PID"  # in `ember replica exec` commands


class ReplicaProvisioning:
    def __init__(self, config: AgentConfig, gpu_slots: GpuSlots, note: Note) -> None:
        self.config = config
        self.gpu_slots = gpu_slots
        self.note = note

    def replica_env(self, own: Mapping[str, str], gpus: Sequence[GpuDevice]) -> dict[str, str]:
        """The environment a replica runs with, less its runtime's pipes: its own
        variables (its endpoint's env= and its secrets', from its start command) over
        Ember's base and the node variables the operator hands on (--replica-env), and
        nothing else of the worker's (process_env.py)."""
        env = replica_base(self.config.replica_env)
        env.update(own)
        # One weights cache for every replica on this node (the reader's disk tier).
        env[WEIGHTS_CACHE_DIR_ENV] = str(self.config.weights_dir)
        env[WEIGHTS_CACHE_BYTES_ENV] = str(self.config.weights_cache_bytes)
        env[VOLUMES_DIR_ENV] = self.config.volumes_dir  # also in its identity, for restores
        if self.config.gpus:  # a replica sees the GPUs it holds, and no other
            env[VISIBLE_DEVICES_ENV] = visible_devices(gpus)
        return env

    def exec_context(
        self,
        bundle_dir: Path,
        command: wire.StartReplica,
        gpus: Sequence[GpuDevice],
        cgroup_procs: Sequence[Path],
        python: str,
        pid: int,
        user: ReplicaUser | None = None,
        plan: SandboxPlan | None = None,
        own_env: Mapping[str, str] | None = None,
    ) -> ExecContext:
        """How `ember replica exec` runs commands in the replica: in its folder and
        cgroups, with its environment (`own_env`: its working area and caches, as the
        replica names them) and its app's Python (and pip) first on PATH, the replica's
        PID as this node sees it; inside its sandbox (`plan`) as its `user`."""
        env = self.replica_env(command.env, gpus)
        env.update(own_env or {})
        inside = plan.inside if plan is not None else str
        python_dir = inside(str(Path(python).parent))
        env["PATH"] = os.pathsep.join([python_dir, env.get("PATH", os.defpath)])
        env[REPLICA_PID_ENV] = str(pid)
        enter: list[str] = []
        if user is not None:
            cwd = plan.cwd if plan is not None else None
            enter = sandbox_exec.command_prefix(pid, user.uid, user.gid, cwd)
        return ExecContext(bundle_dir, env, tuple(cgroup_procs), tuple(enter))

    def take_gpus(
        self, record: RunningReplica, command: wire.StartReplica, prefer: Sequence[str] = ()
    ) -> list[GpuDevice]:
        """The GPUs the replica asks for, from this node's free ones (NoFreeGpu if short);
        which ones goes into its log."""
        held = bool(self.gpu_slots.held(record.replica_id))
        gpus = self.gpu_slots.take(record.replica_id, command.gpu_type, command.gpu_count, prefer)
        if gpus and not held:
            names = ", ".join(f"{gpu.kind} #{gpu.index} ({gpu.visible_id})" for gpu in gpus)
            self.note(record, f"holds GPU {names}" if len(gpus) == 1 else f"holds GPUs {names}")
        return gpus
