"""What a replica's unprivileged user may reach on this node, set up before it starts.

Replicas of a workspace run as its uid (processes/replica_users.py). The worker's folders
are root's: the work dir and its `bundles/`, `environments/` and `volumes/` may be passed
through (mode 0711: no listing), `snapshots/` and every record are root's alone. Each
replica is then given, as its own uid, exactly:

- its bundle's folder and its app's Python environment, read-only: a named-user ACL entry
  on the folder, whose owning group and others have no rights (file_grants.py);
- passage (search, not listing) through the folders above them and above the
  interpreter, the standard library and Ember's packages, where others have none (a
  state dir is 0700; a Python under /root);
- a private working area, `replicas/<replica id>/` (mode 0700, its uid's), its HOME and
  TMPDIR, removed when it ends;
- its app's folder of ember.Volume copies, `volumes/<app>/` (its uid's, 0700);
- its workspace's weights cache, `weights/uid-<uid>/` (its uid's, 0700), which no other
  workspace's replicas reach (weights/cache/workspace_caches.py);
- the device nodes of the GPUs it holds, where they are not open to all already.

The control plane's Unix socket is an abstract one (no file, no mode): any local process
may connect, and every channel presents its token, as over TCP.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import site
import sys
from collections.abc import Sequence
from pathlib import Path

import ember
import ember_worker
from ember.wire.labels import split_app_key
from ember_worker.agent.config import AgentConfig
from ember_worker.processes import file_grants, tenant_files
from ember_worker.processes.file_grants import READ, RX, WRITE
from ember_worker.processes.replica_users import RECORD_NAME, ReplicaUser, ReplicaUsers
from ember_worker.resources import GpuDevice
from ember_worker.weights.cache import workspace_caches

log = logging.getLogger("ember.worker")

REPLICAS_DIR = "replicas"  # in the work dir: each replica's private working area
PASSABLE = 0o711  # folders replicas pass through to theirs, without listing them
# The device nodes CUDA opens besides each GPU's own (/dev/nvidia<index>).
NVIDIA_COMMON_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")


def gpu_device_nodes(gpus: Sequence[GpuDevice], dev: Path = Path("/dev")) -> list[Path]:
    """The device nodes a replica holding `gpus` opens (those this node has)."""
    if not gpus:
        return []
    names = [f"nvidia{gpu.index}" for gpu in gpus] + list(NVIDIA_COMMON_NODES)
    return [dev / name for name in names if (dev / name).exists()]


class ReplicaAccess:
    def __init__(self, config: AgentConfig, users: ReplicaUsers) -> None:
        self.config = config
        self.users = users
        self.replicas_dir = config.work_dir / REPLICAS_DIR

    @classmethod
    def for_node(cls, config: AgentConfig) -> ReplicaAccess:
        first, count = config.replica_uids
        return cls(config, ReplicaUsers(config.work_dir / RECORD_NAME, first, count))

    def prepare_node(self) -> None:
        """The work dir's own modes: replicas pass through, never list or read records.
        What an earlier run left in `replicas/` goes (blocking: file system calls)."""
        work = self.config.work_dir
        work.mkdir(parents=True, exist_ok=True)
        os.chmod(work, PASSABLE)
        for name in ("bundles", "environments", "volumes"):
            (work / name).mkdir(exist_ok=True)
            os.chmod(work / name, PASSABLE)
        # Root's alone: snapshot images hold replicas' memory; `images` every
        # workspace's built layers and registry layers unpacked as root (replicas and
        # build steps see them only through mounts root makes).
        for name in ("snapshots", "images"):
            (work / name).mkdir(exist_ok=True)
            os.chmod(work / name, 0o700)
        workspace_caches.prepare_root(self.config.weights_dir)
        shutil.rmtree(self.replicas_dir, ignore_errors=True)
        self.replicas_dir.mkdir()
        os.chmod(self.replicas_dir, PASSABLE)

    def user_for(self, app_key: str) -> ReplicaUser:
        """The user the app's replicas run as: its workspace's."""
        workspace, _ = split_app_key(app_key)
        return self.users.for_workspace(workspace)

    def weights_cache(self, user: ReplicaUser) -> Path:
        """The weights cache of `user`'s workspace (made by `prepare`)."""
        return workspace_caches.workspace_dir(self.config.weights_dir, user.uid)

    def home(self, replica_id: str) -> Path:
        return self.replicas_dir / replica_id

    def prepare(
        self,
        user: ReplicaUser,
        *,
        replica_id: str,
        app_key: str,
        bundle_dir: Path,
        python: str,
    ) -> Path:
        """Open to `user` what the replica needs (blocking: file system calls); return
        its private working area, made now."""
        uid = user.uid
        self.open_bundle(user, bundle_dir, python)
        environment = self.environment_of(python)
        if environment is not None:
            file_grants.grant_passage(environment, uid)
            file_grants.grant(environment, uid, RX, private=True)
        if self.config.ca_cert:
            self._reach(Path(self.config.ca_cert), uid, READ)
        # The SDK keeps an app's copies under its key: per workspace.
        self._own_folder(Path(self.config.volumes_dir) / app_key, user)
        workspace_caches.prepare_workspace(self.config.weights_dir, uid, user.gid)
        home = self.home(replica_id)
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(home)
        self._own_folder(home, user)
        self._own_folder(home / "tmp", user)
        return home

    def open_bundle(
        self, user: ReplicaUser, bundle_dir: Path, python: str = sys.executable
    ) -> None:
        """Let `user` read the bundle and run `python` (blocking): what its app's
        environment's install (run as that user) needs, and then its replicas."""
        for needed in self.runtime_paths(python):
            self._reach(needed, user.uid, RX)
        file_grants.grant_passage(bundle_dir, user.uid)
        file_grants.grant(bundle_dir, user.uid, RX, private=True)

    def grant_gpus(self, user: ReplicaUser, gpus: Sequence[GpuDevice]) -> None:
        """The device nodes of the GPUs a replica holds, where not open to all already
        (the driver's default is 0666; some nodes keep them to a group)."""
        for node in gpu_device_nodes(gpus):
            self._reach(node, user.uid, READ | WRITE)

    def release(self, replica_id: str) -> None:
        """Remove the replica's working area (it has ended; blocking)."""
        shutil.rmtree(self.home(replica_id), ignore_errors=True)

    def runtime_paths(self, python: str) -> list[Path]:
        """What any replica's interpreter reads before it reaches its app: the
        interpreter, the standard library, and Ember's own packages."""
        # An environment's interpreter lies in a tree its workspace's build wrote: never
        # resolved there (a link could name any file of the node's), it is the node's own.
        if self.environment_of(python) is not None:
            python = sys.executable
        paths = [Path(os.path.realpath(python)), Path(sys.base_prefix), Path(sys.prefix)]
        paths += [Path(p) for p in site.getsitepackages() if os.path.isdir(p)]
        paths += [Path(ember_worker.__file__).parent, Path(ember.__file__).parent]
        return list(dict.fromkeys(paths))

    def environment_of(self, python: str) -> Path | None:
        """The app's own environment's folder, where `python` is one of the node's."""
        root = self.config.work_dir / "environments"
        path = Path(python)
        if not path.is_relative_to(root) or path == root:
            return None
        return root / path.relative_to(root).parts[0]

    @staticmethod
    def _reach(path: Path, uid: int, permissions: int) -> None:
        """Passage to `path` and these rights on it, granted only where others lack them."""
        if file_grants.reachable(path, permissions):
            return
        file_grants.grant_passage(path, uid)
        if os.stat(path).st_mode & permissions != permissions:
            file_grants.grant(path, uid, permissions)

    @staticmethod
    def _own_folder(path: Path, user: ReplicaUser) -> None:
        """A folder of the user's own, mode 0700 (made if missing). One another uid owns
        is left as it is (an app of the same name in another workspace: its copies)."""
        file_grants.grant_passage(path, user.uid)
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            owner = os.lstat(path).st_uid  # its folder above is root's: no link swapped in
            if owner not in (0, user.uid):
                log.warning("%s belongs to uid %d, not %d", path, owner, user.uid)
                return
            if owner == 0:
                # Made by a worker before sandboxes, or given to root by a snapshot phase
                # run as uid 0 (CAP_CHOWN) that may have planted links in it: all of it
                # goes to the user, the links themselves, never what they point at.
                tenant_files.chown_tree(path, user.uid, user.gid)
        os.chown(path, user.uid, user.gid, follow_symlinks=False)
        os.chmod(path, 0o700)
