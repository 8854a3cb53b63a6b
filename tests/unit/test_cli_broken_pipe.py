"""`ember ... | head`: when the reader goes away, the command stops quietly."""

from __future__ import annotations

import subprocess
import sys

# A command that prints far more than a pipe holds, through ember's own main().
SCRIPT = """
import argparse, sys
import ember.cli.main as cli

def run(args):
    for n in range(200_000):
        print("line", n)
    return 0

parser = argparse.ArgumentParser()
parser.set_defaults(run=run)
cli.build_parser = lambda: parser
sys.exit(cli.main([]))
"""


def test_a_closed_pipe_ends_the_command_quietly_with_sigpipes_status() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as process:
        assert process.stdout is not None and process.stderr is not None
        assert process.stdout.readline() == b"line 0\n"
        process.stdout.close()  # as `head -1` does once it has its line
        stderr = process.stderr.read().decode()
        assert process.wait(timeout=60) == 141
    assert stderr == ""  # no traceback, no "Exception ignored" at exit
