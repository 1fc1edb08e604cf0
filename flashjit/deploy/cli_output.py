"""How the `flashjit` commands talk: error lines, the usage error, log routing, tables and sizes.

Tables go to stdout; progress bars, log lines and errors to stderr.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys

from ..errors import SpecError

log = logging.getLogger("flashjit")


LINE_CHARS = 1000  # an error line longer than this quotes an argument too long to echo whole


def error(message: str) -> None:
    """The error line(s) on stderr: control characters escaped (a value from the command line or a
    file reaches the terminal as text), each line at most LINE_CHARS characters."""
    lines = []
    for line in str(message).split("\n"):
        line = "".join(ch if ch.isprintable() or ch == "\t" else ascii(ch)[1:-1] for ch in line)
        lines.append(line if len(line) <= LINE_CHARS else f"{line[:LINE_CHARS - 40]}... ({len(line)} characters)")
    print("flashjit: error: " + "\n".join(lines), file=sys.stderr)


def print_json(value) -> None:
    """A command's report on stdout as JSON (--json): paths and other objects as their text."""
    print(json.dumps(value, indent=1, default=str))


def on_terminal(stream=None) -> bool:
    """Whether stream (default stderr) is a terminal: progress bars draw only there."""
    stream = sys.stderr if stream is None else stream
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced by an object without one, or closed
        return False


class UsageError(SpecError):
    """A bad command-line value: exit status 2, like a bad spec or manifest."""

    def __init__(self, message: str):
        self.field = self.value = self.accepted = None
        Exception.__init__(self, message)


class _TqdmHandler(logging.Handler):
    """Log lines that do not tear the progress bar."""

    def emit(self, record):
        from tqdm import tqdm

        tqdm.write(self.format(record), file=sys.stderr)


@contextlib.contextmanager
def routed_logging(verbose: bool):
    """Route the 'flashjit' logger through tqdm for one command, then restore it (main() may run in-process)."""
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter("flashjit: %(message)s"))
    saved = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO if verbose else logging.WARNING)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]


def table(rows: list[tuple], header: tuple) -> str:
    rows = [tuple(str(c) for c in row) for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(tuple("-" * w for w in widths))] + [line(r) for r in rows])


def format_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
