"""Run one benchmark case's decode a few times, for a profiler to attach to (GPU).

    ncu --kernel-name regex:flashjit_decode --launch-skip 3 --launch-count 1 \\
        python -m benchmarks.profile_case "b16 L8192 e4m3" [--peer flashinfer-tc]

The inputs and implementations are those of benchmarks/decode.py (checked there against the reference).
"""

import argparse
import sys
import tempfile

from benchmarks.cases import CASES
from benchmarks.inputs import build_inputs, quantize
from benchmarks.peers import candidates


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=[c.name for c in CASES], metavar="CASE")
    parser.add_argument("--peer", default="flashjit",
                        help="the implementation to run (flashjit, sdpa-cudnn, flashinfer, flashinfer-tc, fa3, ...)")
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args(argv)

    import torch

    import flashjit

    case = next(c for c in CASES if c.name == args.case)
    batch = build_inputs(torch, case)
    fp8 = quantize(batch, case)
    factories, notes = candidates(torch, batch, case, flashjit.Engine(cache_dir=tempfile.mkdtemp()), fp8,
                                  cuda_cores=True)
    if args.peer not in factories:
        sys.exit(f"no {args.peer!r} on {case.name!r}; have {sorted(factories)}" + "".join(f"\n  {n}" for n in notes))
    run = factories[args.peer]().eager.call
    for _ in range(args.calls):
        run()
    torch.cuda.synchronize()
    print(f"{args.case}: {args.calls} calls of {args.peer}")


if __name__ == "__main__":
    main()
