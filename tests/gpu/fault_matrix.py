"""The GPU tests under each deliberately broken kernel (tests/fault_injection.py), path by path: runs
`pytest --inject-fault FAULT:PATH` over the test files of that path and writes which tests failed to
OUT/faults.json and OUT/faults.md (the runs' junit reports stay in a temporary folder). Exit 1 when
a fault failed no test of a path (the tests missed it) or a run ended in errors rather than failures.

    python tests/gpu/fault_matrix.py --out DIR [--faults F ...] [--paths P ...] [--maxfail N] [--jobs N]
                                     [--timeout S]

Each run stops after --maxfail failures (one proves the fault is seen; a few show by what); --jobs
runs that many at once on the one GPU. Set FLASHJIT_CACHE_DIR to one folder for all runs: the
unbroken kernels then compile once, the broken ones (keys of their own) once per fault and path.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from fault_injection import FAULTS, PATHS  # noqa: E402

# path -> (test files, -k expression selecting that path's tests in them). The key counts come first:
# their kernels compile as they run, where the other files prewarm hundreds of specs (broken ones
# compile anew), so a run that stops at --maxfail stops early; --maxfail beyond their failures
# reaches the path's row-by-row tests.
SUITES = {
    "cuda_cores": (["test_key_counts_gpu.py", "test_decode_gpu.py", "test_masks_gpu.py"], "cuda_cores or cc"),
    "tensor_cores": (["test_key_counts_gpu.py", "test_decode_gpu.py", "test_masks_gpu.py"], "tensor_cores or tc"),
    "fp8": (["test_key_counts_gpu.py", "test_fp8_gpu.py", "test_head_shapes_gpu.py"], "fp8 or e4m3 or e5m2"),
    "mla": (["test_key_counts_gpu.py", "test_mla_gpu.py"], "mla"),
    "shared_prefix": (["test_key_counts_gpu.py", "test_shared_prefix_gpu.py"], "shared_prefix"),
}


def outcomes(report: Path) -> dict:
    """{'failed': [test ids], 'errors': [test ids], 'passed': n} of a junit XML report."""
    found = {"failed": [], "errors": [], "passed": 0}
    if not report.is_file():
        return found
    for case in ElementTree.parse(report).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None:
            found["failed"].append(name)
        elif case.find("error") is not None:
            found["errors"].append(name)
        elif case.find("skipped") is None:
            found["passed"] += 1
    return found


def run(fault: str, path: str, reports: Path, maxfail: int, timeout: float) -> dict:
    files, selection = SUITES[path]
    report = reports / f"{fault}-{path}.xml"
    command = [sys.executable, "-m", "pytest", *(str(HERE / f) for f in files), "-k", selection, "-q",
               "-p", "no:cacheprovider", f"--inject-fault={fault}:{path}", f"--maxfail={maxfail}",
               f"--junitxml={report}"]
    start = time.perf_counter()
    try:
        rc = subprocess.run(command, cwd=HERE.parent.parent, timeout=timeout, capture_output=True, text=True).returncode
        timed_out = False
    except subprocess.TimeoutExpired:
        rc, timed_out = None, True
    return {"command": " ".join(command), "rc": rc, "timed_out": timed_out,
            "seconds": round(time.perf_counter() - start, 1), **outcomes(report)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--faults", nargs="+", default=sorted(FAULTS), choices=sorted(FAULTS))
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    parser.add_argument("--maxfail", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=1, help="runs at once")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    reports = Path(tempfile.mkdtemp(prefix="flashjit-faults-"))
    pairs = [(fault, path) for fault in args.faults for path in args.paths]
    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(run, fault, path, reports, args.maxfail, args.timeout): (fault, path)
                   for fault, path in pairs}
        for future in concurrent.futures.as_completed(futures):
            fault, path = futures[future]
            result = results[f"{fault}:{path}"] = future.result()
            print(f"{fault:16} {path:14} failed {len(result['failed']):3}  errors {len(result['errors']):3}  "
                  f"passed {result['passed']:4}  {result['seconds']:7.1f} s", flush=True)
            (args.out / "faults.json").write_text(json.dumps(results, indent=1))
    results = {f"{fault}:{path}": results[f"{fault}:{path}"] for fault, path in pairs}
    missed = [key for key, result in results.items() if not result["failed"] or result["errors"]]
    (args.out / "faults.json").write_text(json.dumps(results, indent=1))
    lines = ["| fault | path | tests failed (first 3) | errors |", "|---|---|---|---|"]
    for key, result in results.items():
        fault, path = key.split(":")
        lines.append(f"| {fault} | {path} | {len(result['failed'])}: {', '.join(result['failed'][:3])} | "
                     f"{len(result['errors'])} |")
    (args.out / "faults.md").write_text("\n".join(lines) + "\n")
    if missed:
        print("faults no test caught (or runs with errors): " + ", ".join(missed))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
