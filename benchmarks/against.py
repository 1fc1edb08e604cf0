"""One benchmark, run on this checkout and on a baseline one back to back, so a change is timed
against what it changes on the same GPU at the same time (performance.md: compare ratios measured
in one run).

    python -m benchmarks.against BASELINE_TREE [--rounds N] -- MODULE [ARGS...]
    python -m benchmarks.against /tmp/base -- benchmarks.mla --iters 20 --rows h128

BASELINE_TREE is another tree of this repository (`git archive main | tar -x -C /tmp/base`); each
round runs `python -m MODULE ARGS` in the baseline tree, then in this one, alternating, each in a
child process whose imports come from its tree (PYTHONPATH: the tree first, then the caller's) and
whose kernels go to a cache folder of its own. The children's output is printed as it comes, each
under a line naming the tree and round. The exit status is 1 if any child failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def tree(path: str) -> Path:
    """A checkout of this repository: a folder holding flashjit/ and templates/."""
    found = Path(path).resolve()
    if not (found / "flashjit").is_dir() or not (found / "templates").is_dir():
        raise argparse.ArgumentTypeError(f"{path} is not a flashjit checkout (it needs flashjit/ and templates/)")
    return found


def child_env(root: Path, cache_dir: str) -> dict:
    """The environment of a child run from root: its tree first on PYTHONPATH, its own kernel cache."""
    env = dict(os.environ, FLASHJIT_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     usage="%(prog)s BASELINE_TREE [--rounds N] -- MODULE [ARGS...]")
    parser.add_argument("baseline", type=tree, help="the baseline checkout")
    parser.add_argument("--rounds", type=int, default=1, help="baseline-then-this rounds (default 1)")
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args, command = parser.parse_args(argv[:split]), argv[split + 1:]
    if not command:
        parser.error("name the benchmark module after --, e.g. -- benchmarks.mla --iters 20")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    failed = False
    with tempfile.TemporaryDirectory(prefix="flashjit-against-") as scratch:
        for round_ in range(1, args.rounds + 1):
            for side, (label, root) in enumerate((("baseline", args.baseline), ("this tree", HERE))):
                print(f"== {label} ({root}), round {round_}: python -m {' '.join(command)}", flush=True)
                env = child_env(root, os.path.join(scratch, str(side)))
                done = subprocess.run([sys.executable, "-m", *command], cwd=root, env=env)
                if done.returncode != 0:
                    print(f"== {label}: exit status {done.returncode}", flush=True)
                    failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
