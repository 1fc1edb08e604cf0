"""Runs one build command so that it never outlives the process that asked for it.

host_library starts this file as a script (python -I -S build_watchdog.py PARENT_PID SCRATCH
COMMAND...; the standard library only, so it starts in ~20 ms). It runs COMMAND in a process group
of its own and waits for it, exiting with its status. If the process that started it goes away
(a SIGKILL cannot be caught, so that process cannot clean up itself: this one notices its parent
change) or it is sent SIGTERM (the build timed out), it kills COMMAND's whole group, removes the
SCRATCH folder and exits with status 1.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

POLL_S = 0.05


def _stop(compiler: subprocess.Popen, scratch: str) -> int:
    try:
        os.killpg(compiler.pid, signal.SIGKILL)
    except OSError:
        pass
    compiler.wait()
    shutil.rmtree(scratch, ignore_errors=True)
    return 1


def main(argv: list[str]) -> int:
    parent, scratch, command = int(argv[0]), argv[1], argv[2:]
    compiler = subprocess.Popen(command, start_new_session=True)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    while not stopping and os.getppid() == parent:
        try:
            return compiler.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
    return _stop(compiler, scratch)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
