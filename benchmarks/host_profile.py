"""Where the host time of plan() and run() goes (GPU): cProfile of many calls, top entries.

    python -m benchmarks.host_profile
"""

import argparse
import cProfile
import io
import pstats
import tempfile


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)

    import torch

    import flashjit
    from flashjit.deploy.random_batches import make_batch

    engine = flashjit.Engine(cache_dir=tempfile.mkdtemp())
    batch = make_batch([128 + 6 * i for i in range(64)], num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
    decoder = flashjit.BatchDecode(engine)
    args = (batch.indptr, batch.indices, batch.last_page_len, 32, 8, 128, 16)
    decoder.plan(*args)
    out, cache = torch.empty_like(batch.q), (batch.k_cache, batch.v_cache)
    decoder.run(batch.q, cache, out=out)
    torch.cuda.synchronize()
    for name, fn, n in (("plan", lambda: decoder.plan(*args), 300), ("run", lambda: decoder.run(batch.q, cache, out=out), 3000)):
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(n):
            fn()
        profile.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(14)
        print(f"===== {name} x{n}\n" + "\n".join(text.getvalue().splitlines()[6:24]))


if __name__ == "__main__":
    main()
