"""Whether a v{N} folder is a flashjit cache: its marker file, or, for a cache written before the
marker existed, its layout (flashjit's folders and hidden files only, entries named by keys).

flashjit writes into, clears and prunes only folders that pass, so a cache dir pointed at a data
folder by mistake loses nothing and gains nothing. The marker follows the cache-directory tagging
convention (its first line), so backup tools that honour it skip the kernels.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from . import trusted_files
from .cache_format import KEY_PATTERN

MARKER = "CACHEDIR.TAG"
SIGNATURE = b"Signature: 8a477f597d28d172789f06886806bc55"
LAYOUT = ("entries", "index", "portable", "locks", "failed", "host")  # what a v{N} folder holds
OWN_HIDDEN = re.compile(r"\.(probe|trash)-.*|\..*\.tmp")  # probes, things being removed, temp files
VERSION_FOLDER = re.compile(r"v(\d+)")


def marker_text(schema: int) -> bytes:
    return (SIGNATURE + f"\n# A flashjit kernel cache (schema v{schema}): compiled kernels, rebuilt on demand.\n"
            "# flashjit clears and prunes only folders that hold this file.\n".encode())


def is_marked(root: Path, version: str) -> bool:
    """Whether root/version holds flashjit's marker, read under the trust rule."""
    try:
        text = trusted_files.read_file(root, (version, MARKER), 4096, follow=1)
    except (OSError, trusted_files.Refused):
        return False
    return text.startswith(SIGNATURE) and b"flashjit kernel cache" in text


def in_layout(path: Path) -> bool:
    """Whether a v{N} folder holds flashjit's folders and files only (key-named entries): a cache
    written before the marker existed, or one being made right now."""
    try:
        names = os.listdir(path)
        keys = os.listdir(path / "entries") if "entries" in names else []
    except OSError:
        return False
    return (all(name in LAYOUT or name == MARKER or OWN_HIDDEN.fullmatch(name) for name in names)
            and all(KEY_PATTERN.fullmatch(key) or OWN_HIDDEN.fullmatch(key) for key in keys))


def is_cache_version(root: Path, version: str) -> bool:
    """A v{N} folder flashjit wrote: marked, or in its layout with an entries folder. A link in
    place of an old version is never one (prune removes old versions, never what a link names)."""
    path = Path(root) / version
    if path.is_symlink():
        return False
    return is_marked(root, version) or (in_layout(path) and (path / "entries").is_dir())


def version_problem(root: Path, version: str) -> str | None:
    """None when root/version may be used as a flashjit cache (missing, empty, marked or in the
    layout); else what it is, for a message that says why flashjit leaves it alone."""
    path = Path(root) / version
    try:
        names = sorted(os.listdir(path))
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return f"{path} is a file, not a flashjit cache folder"
    except OSError as exc:
        return f"{path} cannot be listed ({exc.strerror or exc})"
    if not names or is_marked(root, version) or in_layout(path):
        return None
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (f"{path} is not a flashjit cache (it holds {shown} and no {MARKER}): flashjit neither writes "
            "into it nor removes anything from it; give another --cache-dir or FLASHJIT_CACHE_DIR")
