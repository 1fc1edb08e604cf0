"""The `flashjit` command run in-process (cli.main), for the tests of every folder that drive it."""

from __future__ import annotations

import contextlib
import io

from flashjit.deploy import cli


def run(*argv) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `flashjit ARGV...`."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()
