"""Run one benchmark case's decode a few times, for a profiler to attach to (GPU).

    ncu --kernel-name regex:flashjit_decode --launch-skip 3 --launch-count 1 \\
        python -m benchmarks.profile_case "b16 L8192 e4m3" [--peer flashinfer-tc]

The inputs are those of benchmarks/decode.py (checked there against the reference).
"""

import argparse
import sys
import tempfile

from benchmarks.decode import CASES, build_inputs, flashinfer_impls, flashjit_impl, quantize


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=[c.name for c in CASES], metavar="CASE")
    parser.add_argument("--peer", help="profile this FlashInfer path instead (flashinfer or flashinfer-tc)")
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args(argv)

    import torch

    import flashjit

    case = next(c for c in CASES if c.name == args.case)
    batch = build_inputs(torch, case)
    fp8 = quantize(batch, case)
    if args.peer:
        impls, absent = flashinfer_impls(torch, batch, case, fp8)
        if args.peer not in impls:
            sys.exit(absent or f"no peer {args.peer!r}; have {sorted(impls)}")
        run, _ = impls[args.peer]
    else:
        run, _, _ = flashjit_impl(torch, batch, case, flashjit.Engine(cache_dir=tempfile.mkdtemp()), fp8)
    for _ in range(args.calls):
        run()
    torch.cuda.synchronize()
    print(f"{args.case}: {args.calls} calls of {args.peer or 'flashjit'}")


if __name__ == "__main__":
    main()
