"""How the agent words a replica's end: exit codes, signals, and the OOM killer."""

from __future__ import annotations

import signal
from pathlib import Path

from ember_worker.processes.exits import describe_exit, oom_kill_count

KILLED = -signal.SIGKILL


def test_oom_kill_count_reads_the_kernel_counter(tmp_path: Path) -> None:
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 1000\noom_kill 7\npgfault 12\n")
    assert oom_kill_count(vmstat) == 7
    vmstat.write_text("nr_free_pages 1000\n")  # an old kernel does not count them
    assert oom_kill_count(vmstat) is None
    assert oom_kill_count(tmp_path / "missing") is None
    assert oom_kill_count() is not None  # this machine's kernel (4.13 or newer) counts them


def describe(
    returncode: int,
    *,
    killed_by_agent: bool = False,
    oom_kills_before: int | None = 3,
    oom_kills_after: int | None = 3,
    stderr_tail: str | None = None,
) -> str:
    return describe_exit(
        returncode,
        killed_by_agent=killed_by_agent,
        oom_kills_before=oom_kills_before,
        oom_kills_after=oom_kills_after,
        stderr_tail=stderr_tail,
    )


def test_a_sigkill_the_agent_did_not_send_while_the_oom_killer_ran_is_named() -> None:
    text = describe(KILLED, oom_kills_after=4)
    assert text.startswith("killed by the kernel's OOM killer (SIGKILL)")
    assert "give it more memory=" in text
    text = describe_exit(
        KILLED,
        killed_by_agent=False,
        oom_kills_before=3,
        oom_kills_after=4,
        stderr_tail=None,
        memory_mib=512,
    )
    assert "the endpoint asks for memory=512 (MiB): give it more memory=" in text


def test_an_oom_kill_in_the_replicas_own_cgroup_names_its_memory_limit() -> None:
    text = describe_exit(
        KILLED,
        killed_by_agent=False,
        oom_kills_before=None,  # the node-wide count is not needed for it
        oom_kills_after=None,
        stderr_tail=None,
        memory_mib=512,
        over_limit_mib=1024,
    )
    assert text == (
        "killed by the kernel's OOM killer (SIGKILL): it went over its endpoint's "
        "memory_limit=1024 (MiB); raise memory_limit= or make it use less"
    )
    # The agent's own SIGKILL stays its own, whatever the cgroup saw before.
    text = describe_exit(
        KILLED,
        killed_by_agent=True,
        oom_kills_before=3,
        oom_kills_after=3,
        stderr_tail=None,
        over_limit_mib=1024,
    )
    assert text == "killed by signal SIGKILL"


def test_other_ends_are_told_as_they_are() -> None:
    # The agent's own SIGKILL, even while some OOM kill happened elsewhere.
    assert describe(KILLED, killed_by_agent=True, oom_kills_after=4) == "killed by signal SIGKILL"
    # No OOM kill meanwhile, or no counter to tell.
    assert describe(KILLED) == "killed by signal SIGKILL"
    assert describe(KILLED, oom_kills_before=None, oom_kills_after=None) == (
        "killed by signal SIGKILL"
    )
    assert describe(-signal.SIGSEGV, oom_kills_after=9) == "killed by signal SIGSEGV"
    assert describe(3, stderr_tail="ValueError: bad") == "exit code 3: ValueError: bad"
    assert describe(0, stderr_tail="a warning") == "exit code 0"


def test_only_a_line_written_just_before_the_exit_says_why() -> None:
    from ember_worker.agent.running_replica import LAST_WORDS_SECONDS, RunningReplica

    record = RunningReplica("r-1", "app", "model")
    assert record.last_words(100.0) is None
    record.stderr_tail.append((99.5, "ValueError: bad"))
    assert record.last_words(100.0) == "ValueError: bad"
    # Written long before it ended (a warning at load time): not its cause.
    assert record.last_words(99.5 + LAST_WORDS_SECONDS + 1) is None
    # The runtime's notes of what went well are never the cause; its others may be.
    for note in (
        "ember: restored from a snapshot in 0.099 s; reseeded random",
        "ember: input in-1 cancelled",
        "ember: Models.load: loaded model 'acme' in 0.20 s",
    ):
        record.stderr_tail.append((100.0, note))
        assert record.last_words(100.0) is None, note
    failed = "ember: replica failed to start: RuntimeError: weights missing"
    record.stderr_tail.append((100.0, failed))
    assert record.last_words(100.0) == failed


def test_a_leaving_node_waits_for_running_replicas_not_ones_still_launching() -> None:
    from ember_worker.agent.running_replica import RunningReplica, running

    launching = RunningReplica("r-1", "app", "model")  # its bundle or restore under way
    serving = RunningReplica("r-2", "app", "model")
    serving.process = object()  # type: ignore[assignment]  # a process stands there
    assert running([launching, serving]) == [serving]
    assert running([launching]) == []
