"""The repository's folders, for tests at any depth of tests/."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
HF_EXAMPLES = EXAMPLES / "hf"  # HuggingFace config.json folders
