"""The `ember replica exec` commands (and `ember profile` runs) on this node, by id:
started beside their replica on the control plane's `exec`, steered by what their caller
sends (`exec_input`, `exec_resize`, `exec_kill`), and ended with their replica."""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass

from ember.wire import messages as wire
from ember_worker.agent.replica_exec import ExecContext, ExecRun, Send
from ember_worker.agent.replicas.profiling import ProfileRun


@dataclass(frozen=True)
class _Running:
    replica_id: str
    run: ExecRun | ProfileRun
    task: asyncio.Task[None]


class ExecRuns:
    def __init__(self, node: str, send: Send) -> None:
        self.node = node  # this worker's name, for the errors callers see
        self.send = send
        self.running: dict[str, _Running] = {}
        # Replicas being killed: a command of theirs that ends meanwhile (killed with its
        # replica's namespace, before the replica's own exit is seen) ended with them.
        self.ending: set[str] = set()

    def replica_ending(self, replica_id: str) -> None:
        """The replica is being killed: its commands' ends say so, whichever comes first."""
        self.ending.add(replica_id)

    def _send_for(self, replica_id: str) -> Send:
        async def send(message: wire.ExecOutput | wire.ExecExit) -> None:
            if isinstance(message, wire.ExecExit) and replica_id in self.ending:
                message = wire.ExecExit(exec_id=message.exec_id, error=_ended(replica_id))
            await self.send(message)

        return send

    def start(
        self, command: wire.Exec, context: ExecContext | None, *, starting: bool = False
    ) -> wire.ExecExit | None:
        """Run the command beside its replica (at once, so that input sent right after
        finds it). A replica without a `context` is still `starting` or does not run
        here: then the end to send its caller, saying why."""
        exec_id, replica_id = command.exec_id, command.replica_id
        if context is None:
            why = (
                f"replica {replica_id} is still starting: try again once it is ready"
                if starting
                else f"replica {replica_id} is not running on worker {self.node}"
            )
            return wire.ExecExit(exec_id=exec_id, error=why)
        run: ExecRun | ProfileRun
        send = self._send_for(replica_id)
        if command.profile is not None:  # `ember profile`: py-spy, run by the agent
            run = ProfileRun(exec_id, context, command.profile, send)
        else:
            run = ExecRun(
                exec_id,
                context,
                command.command,
                command.timeout,
                send,
                stdin=base64.b64decode(command.stdin) if command.stdin is not None else None,
                interactive=command.interactive,
                terminal_size=command.terminal,
            )
        task = asyncio.ensure_future(run.run())
        self.running[exec_id] = _Running(replica_id, run, task)
        task.add_done_callback(lambda _: self.running.pop(exec_id, None))
        return None

    def steer(self, command: wire.ExecInput | wire.ExecResize | wire.ExecKill) -> None:
        """What the caller of a running command sends: input, a new terminal size, or
        (gone) the end of the command."""
        running = self.running.get(command.exec_id)
        if running is None:
            return
        if isinstance(command, wire.ExecKill):
            running.task.cancel()
            return
        if not isinstance(running.run, ExecRun):
            return  # a profile reads no input
        match command:
            case wire.ExecResize():
                running.run.resize(command.rows, command.cols)
            case wire.ExecInput() if command.data is not None:
                running.run.feed(base64.b64decode(command.data))
            case wire.ExecInput() if command.eof:
                running.run.end_input()

    async def end_for(self, replica_id: str) -> None:
        """Commands run beside a replica that has ended end with it."""
        for exec_id, running in list(self.running.items()):
            if running.replica_id != replica_id:
                continue
            running.task.cancel()
            await asyncio.gather(running.task, return_exceptions=True)
            await self.send(wire.ExecExit(exec_id=exec_id, error=_ended(replica_id)))
        self.ending.discard(replica_id)


def _ended(replica_id: str) -> str:
    return f"replica {replica_id} ended, and the command with it"
