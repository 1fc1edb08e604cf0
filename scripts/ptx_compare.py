"""The PTX of every golden-source spec in this checkout and in a baseline one, compared: a template
change meant to leave the kernels as they are shows here, without a GPU, whether it does.

    python scripts/ptx_compare.py BASELINE_CHECKOUT [--jobs N] [--match TEXT] [--keep DIR]

BASELINE_CHECKOUT is another tree of this repository (`git worktree add /tmp/base main`, or
`git archive main | tar -x -C /tmp/base`). Each tree renders the specs tests/golden_sources.py lists
with its own flashjit and templates, in a child process of its own, and NVRTC compiles each distinct
source to PTX for the spec's compile arch (compute_XX; the program named as flashjit.jit.compile
names it, since internal symbol names carry it). Comment, .file and .loc lines are dropped before
the PTX is compared. The specs whose PTX differs are printed with the opcodes whose counts differ,
and the exit status is 1 if any spec differs or exists on one side only. --match keeps the specs
whose name contains TEXT; --keep writes both trees' PTX of each differing spec to DIR for a diff.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
OPCODE = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.]*)", re.M)


def normalized(ptx: str) -> str:
    """PTX without the lines that name the compiler, the file or source positions."""
    kept = [line for line in ptx.splitlines() if not line.lstrip().startswith(("//", ".file", ".loc"))]
    return "\n".join(kept) + "\n"


def opcodes(ptx: str) -> collections.Counter:
    return collections.Counter(match.group(1) for match in OPCODE.finditer(ptx) if not match.group(1).startswith("."))


def _compile(job: tuple[str, str, str, str]) -> tuple[str, str]:
    """(source digest, PTX digest) of one source; the PTX goes to folder/<PTX digest>.ptx.gz."""
    name, arch, source, folder = job
    from cupy.cuda import nvrtc

    program = nvrtc.createProgram(source, f"{name}.cu", [], [])
    try:
        nvrtc.compileProgram(program, [f"-arch={arch.replace('sm_', 'compute_')}", "--std=c++17", "--use_fast_math"])
        ptx = nvrtc.getPTX(program)
    except nvrtc.NVRTCError as exc:
        raise RuntimeError(f"{name}: {nvrtc.getProgramLog(program) or exc}") from None
    finally:
        nvrtc.destroyProgram(program)
    text = normalized((ptx.decode() if isinstance(ptx, bytes) else ptx).rstrip("\0"))
    digest = hashlib.sha256(text.encode()).hexdigest()
    path = Path(folder) / f"{digest}.ptx.gz"
    if not path.exists():
        with gzip.open(path, "wt") as out:
            out.write(text)
    return hashlib.sha256(source.encode()).hexdigest(), digest


def tree_digests(tree: Path, match: str, folder: Path, jobs: int) -> dict[str, str]:
    """name -> PTX digest of every spec the tree's tests/golden_sources.py lists (in this process,
    whose flashjit must be the tree's)."""
    import flashjit
    from flashjit import Engine

    if not Path(flashjit.__file__).resolve().is_relative_to(tree):
        raise SystemExit(f"flashjit comes from {flashjit.__file__}, not from {tree}")
    sys.path.insert(0, str(tree / "tests"))
    import golden_sources

    sources: dict[str, tuple[str, str]] = {}

    class Recorder:  # golden_sources.digests asks an engine for each spec's source
        def __init__(self, engine):
            self.engine = engine

        def source(self, spec):
            if match not in spec.name:
                return ""  # not rendered: the digest golden_sources takes of it is thrown away
            sources[spec.name] = (spec.compile_arch, self.engine.source(spec))
            return sources[spec.name][1]

    with tempfile.TemporaryDirectory() as cache:
        golden_sources.digests(Recorder(Engine(cache_dir=cache)))
    distinct = {}
    for name, (arch, text) in sources.items():
        distinct.setdefault(hashlib.sha256(text.encode()).hexdigest(), (name, arch, text, str(folder)))
    with ProcessPoolExecutor(jobs) as pool:
        ptx_of = dict(pool.map(_compile, distinct.values(), chunksize=4))
    return {name: ptx_of[hashlib.sha256(text.encode()).hexdigest()] for name, (_, text) in sources.items()}


def _run_tree(tree: Path, args, folder: Path) -> dict[str, str]:
    """tree_digests of a tree, in a child process that imports that tree's flashjit."""
    out = folder / "digests.json"
    env = dict(os.environ, PYTHONPATH=str(tree))
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--tree", str(tree), "--out", str(out),
                    "--ptx-dir", str(folder), "--match", args.match, "--jobs", str(args.jobs)],
                   env=env, check=True, cwd=tree)
    return json.loads(out.read_text())


def _report(name: str, base: Path, mine: Path, keep: Path | None) -> str:
    before, after = gzip.open(base, "rt").read(), gzip.open(mine, "rt").read()
    if keep is not None:
        (keep / f"{name}.base.ptx").write_text(before)
        (keep / f"{name}.ptx").write_text(after)
    delta = opcodes(after)
    delta.subtract(opcodes(before))
    changed = ", ".join(f"{op} {count:+d}" for op, count in sorted(delta.items()) if count)
    return f"{name}: {changed or 'same opcode counts, other order or operands'}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("baseline", type=Path, nargs="?", help="another checkout of this repository")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--match", default="", help="only the specs whose name contains this text")
    parser.add_argument("--keep", type=Path, help="write both PTX files of each differing spec here")
    parser.add_argument("--tree", type=Path, help=argparse.SUPPRESS)  # child mode: one tree's digests
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--ptx-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tree is not None:
        args.out.write_text(json.dumps(tree_digests(args.tree.resolve(), args.match, args.ptx_dir, args.jobs)))
        return 0
    if args.baseline is None:
        parser.error("name the baseline checkout")
    baseline = args.baseline.resolve()
    if not (baseline / "tests" / "golden_sources.py").is_file():
        raise SystemExit(f"{baseline} is not a checkout of this repository (no tests/golden_sources.py)")
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        folders = {tree: Path(work) / label for tree, label in ((baseline, "baseline"), (HERE, "this"))}
        for folder in folders.values():
            folder.mkdir()
        base, mine = (_run_tree(tree, args, folder) for tree, folder in folders.items())
        only = sorted(base.keys() ^ mine.keys())
        differ = sorted(name for name in base.keys() & mine.keys() if base[name] != mine[name])
        for name in differ:
            print(_report(name, folders[baseline] / f"{base[name]}.ptx.gz", folders[HERE] / f"{mine[name]}.ptx.gz",
                          args.keep))
    for name in only:
        print(f"{name}: only in {'the baseline' if name in base else 'this checkout'}")
    same = len(base.keys() & mine.keys()) - len(differ)
    print(f"{same} specs with the same PTX, {len(differ)} different, {len(only)} on one side only "
          f"({len(set(mine.values()))} distinct PTX files here)")
    return 1 if differ or only else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
