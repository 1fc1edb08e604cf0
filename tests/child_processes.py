"""Tests that spawn processes: start them and collect one report each without hanging the run, and
the 'flashjit' log lines a child writes."""

from __future__ import annotations

import logging


def collect_flashjit_log() -> list[str]:
    """Send the 'flashjit' logger's INFO records (e.g. 'compiling ...') to a list; for spawned children."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logger = logging.getLogger("flashjit")
    logger.setLevel(logging.INFO)
    logger.addHandler(Collect())
    return messages


def run_children(children, results, timeout: float = 120) -> list:
    """Start the processes, collect one report each from the results queue, and reap them (killing
    any still alive after 30 s), so a hung child fails the test instead of blocking the run."""
    for child in children:
        child.start()
    try:
        return [results.get(timeout=timeout) for _ in children]
    finally:
        for child in children:
            child.join(30)
            if child.is_alive():
                child.kill()
