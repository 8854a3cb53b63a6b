"""The `ember replica exec` commands running on this node, by id: started beside their
replica on the control plane's `exec`, steered by what their caller sends (`exec_input`,
`exec_resize`, `exec_kill`), and ended with their replica."""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from typing import Any

from ember_worker.agent.replica_exec import ExecContext, ExecRun, Send, exit_message


@dataclass(frozen=True)
class _Running:
    replica_id: str
    run: ExecRun
    task: asyncio.Task[None]


class ExecRuns:
    def __init__(self, node: str, send: Send) -> None:
        self.node = node  # this worker's name, for the errors callers see
        self.send = send
        self.running: dict[str, _Running] = {}

    def start(
        self, command: dict[str, Any], context: ExecContext | None, *, starting: bool = False
    ) -> dict[str, Any] | None:
        """Run the command beside its replica (at once, so that input sent right after
        finds it). A replica without a `context` is still `starting` or does not run
        here: then the end to send its caller, saying why."""
        exec_id = str(command["exec_id"])
        replica_id = str(command["replica_id"])
        if context is None:
            why = (
                f"replica {replica_id} is still starting: try again once it is ready"
                if starting
                else f"replica {replica_id} is not running on worker {self.node}"
            )
            return exit_message(exec_id, None, why)
        timeout = command.get("timeout")
        stdin = command.get("stdin")
        size = command.get("terminal")
        run = ExecRun(
            exec_id,
            context,
            [str(arg) for arg in command["command"]],
            float(timeout) if isinstance(timeout, int | float) else None,
            self.send,
            stdin=base64.b64decode(stdin) if isinstance(stdin, str) else None,
            interactive=bool(command.get("interactive")),
            terminal_size=(int(size[0]), int(size[1])) if isinstance(size, list) else None,
        )
        task = asyncio.ensure_future(run.run())
        self.running[exec_id] = _Running(replica_id, run, task)
        task.add_done_callback(lambda _: self.running.pop(exec_id, None))
        return None

    def steer(self, command: dict[str, Any]) -> None:
        """What the caller of a running command sends: input, a new terminal size, or
        (gone) the end of the command."""
        running = self.running.get(str(command["exec_id"]))
        if running is None:
            return
        kind = command["type"]
        if kind == "exec_kill":
            running.task.cancel()
        elif kind == "exec_resize":
            running.run.resize(int(command.get("rows") or 24), int(command.get("cols") or 80))
        elif isinstance(command.get("data"), str):
            running.run.feed(base64.b64decode(command["data"]))
        elif command.get("eof"):
            running.run.end_input()

    async def end_for(self, replica_id: str) -> None:
        """Commands run beside a replica that has ended end with it."""
        for exec_id, running in list(self.running.items()):
            if running.replica_id != replica_id:
                continue
            running.task.cancel()
            await asyncio.gather(running.task, return_exceptions=True)
            why = f"replica {replica_id} ended, and the command with it"
            await self.send(exit_message(exec_id, None, why))
