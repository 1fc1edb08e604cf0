"""The operator's input files (manifests, HuggingFace config.json): read without blocking, decoded
strictly, parsed with their nesting bounded, and their fields checked by type, so every problem is
one ManifestError line naming the file and the field, never a traceback or a hang.

* Only a regular file is read: a FIFO, device or socket is refused before it is opened for
  reading (and opened without blocking, so one swapped in meanwhile is refused too), as is a file
  over MAX_INPUT_BYTES.
* The text is UTF-8 (a byte-order mark is allowed); JSON's and TOML's parsers recurse, so nesting
  deep enough to exhaust Python's stack is refused by name, and a JSON integer of more than
  MAX_DIGITS digits is kept as a HugeNumber that every field check refuses, naming the field.
* Values quoted in a message are shortened (quote) and stripped of control characters
  (printable): a model name or a path reaches the terminal as text, never as escape sequences.
"""

from __future__ import annotations

import json
import math
import os
import stat
import sys
from pathlib import Path

from ..errors import SpecError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

MAX_INPUT_BYTES = 16 << 20  # manifests and configs are kilobytes; this bounds a mistaken path
MAX_DIGITS = 30             # digits of a JSON integer kept as an int (2**64 has 20)
QUOTE_CHARS = 80            # characters of a value quoted in an error
INT32_MAX = 2**31 - 1


class ManifestError(SpecError):
    """A manifest or config file that cannot be expanded: a SpecError (so a ValueError) naming the
    file, the model and the field, in one line whatever they hold."""

    def __init__(self, path, model: str | None, field: str, problem: str):
        self.path, self.model, self.problem = (str(path) if path else None), model, problem
        self.field, self.value, self.accepted = field, None, problem
        where = (f"{printable(self.path)}: " if self.path else "") + (f"model {quote(model)}, " if model else "")
        Exception.__init__(self, f"{where}field {quote(field)}: {printable(problem)}")


class HugeNumber(str):
    """A JSON integer of more than MAX_DIGITS digits, kept as its text: no field accepts it."""

    def __repr__(self):
        return f"a number of {len(self.lstrip('-'))} digits"


def printable(text: str) -> str:
    """text with every control (non-printable) character written as an escape."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def quote(value) -> str:
    """repr(value), control characters escaped, shortened to QUOTE_CHARS characters."""
    text = repr(value)
    if len(text) > QUOTE_CHARS:
        text = f"{text[:QUOTE_CHARS - 20]}... ({len(text)} characters)"
    return printable(text)


def read_text(path) -> str:
    """The UTF-8 text of a regular file of at most MAX_INPUT_BYTES, opened without blocking."""
    path = Path(path)
    fail = lambda problem: ManifestError(path, None, "<file>", problem)  # noqa: E731
    try:
        kind = os.stat(path).st_mode
        if not stat.S_ISREG(kind):
            raise fail(f"is not a regular file ({_kind(kind)}): give a .toml or .json file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced since the stat
                raise fail("is not a regular file: give a .toml or .json file")
            with os.fdopen(fd, "rb", closefd=False) as stream:
                data = stream.read(MAX_INPUT_BYTES + 1)
        finally:
            os.close(fd)
    except OSError as exc:
        raise fail(f"cannot be read ({exc.strerror or exc})") from None
    if len(data) > MAX_INPUT_BYTES:
        raise fail(f"is larger than {MAX_INPUT_BYTES >> 20} MiB: not a manifest or config file")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise fail(f"is not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start})") from None


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a plain file"


def _int_or_huge(text: str):
    return HugeNumber(text) if len(text.lstrip("-")) > MAX_DIGITS else int(text)


def load_json(path) -> object:
    """A JSON file's value; ManifestError naming the file for anything that is not JSON."""
    text = read_text(path)
    try:
        return json.loads(text, parse_int=_int_or_huge)
    except RecursionError:
        raise ManifestError(path, None, "<file>", "nests too deeply to be a config file") from None
    except ValueError as exc:
        raise ManifestError(path, None, "<file>", f"is not valid JSON ({printable(str(exc))})") from None


def load_toml(path) -> dict:
    """A TOML file's tables; ManifestError naming the file for anything that is not TOML."""
    text = read_text(path)
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise ManifestError(path, None, "<file>", "nests too deeply to be a manifest") from None
    except ValueError as exc:  # TOMLDecodeError, and an integer too long to convert
        raise ManifestError(path, None, "<file>", f"is not valid TOML ({printable(str(exc))[:200]})") from None


# ---- typed fields ---------------------------------------------------------------------------------

def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def int_field(config: dict, key: str, fail, *, minimum: int = 1, default=None):
    """config[key] as an int in minimum..INT32_MAX; default when absent or null."""
    value = config.get(key)
    if value is None:
        return default
    if not _is_int(value) or not minimum <= value <= INT32_MAX:
        raise fail(key, f"must be an integer in {minimum}..{INT32_MAX}, got {quote(value)}")
    return value


def number_field(config: dict, key: str, fail, *, minimum: float = 0.0, default=None):
    """config[key] as a finite number >= minimum (a float); default when absent or null."""
    value = config.get(key)
    if value is None:
        return default
    if not _is_number(value) or value < minimum:
        raise fail(key, f"must be a finite number >= {minimum:g}, got {quote(value)}")
    return float(value)


def _typed_field(config: dict, key: str, fail, accepts, what: str, default):
    """config[key] when accepts(value) holds; default when absent or null; else fail naming what it must be."""
    value = config.get(key)
    if value is None:
        return default
    if not accepts(value):
        raise fail(key, f"must be {what}, got {quote(value)}")
    return value


def str_field(config: dict, key: str, fail, *, default=None):
    return _typed_field(config, key, fail, lambda v: isinstance(v, str), "a string", default)


def bool_field(config: dict, key: str, fail, *, default=None):
    return _typed_field(config, key, fail, lambda v: isinstance(v, bool), "true or false", default)


def str_list_field(config: dict, key: str, fail, *, default=None):
    return _typed_field(config, key, fail, lambda v: isinstance(v, list) and all(isinstance(i, str) for i in v),
                        "a list of strings", default)


def dict_field(config: dict, key: str, fail, *, default=None):
    return _typed_field(config, key, fail, lambda v: isinstance(v, dict), "an object ({...})", default)
