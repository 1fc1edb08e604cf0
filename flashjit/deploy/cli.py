"""The `flashjit` command: prewarm, list, show, clear, cache, doctor, run-example.

Argument parsing only; the commands live in cli_kernels (prewarm, show, run-example, check-mask),
cli_cache (list, clear, cache ...) and cli_doctor, and the work is done by the engine, the cache,
the manifest module, smoke_test and mask_check. Tables go to stdout, progress bars and log lines
to stderr. Exit codes: 0 success, 1 a compile/check failure, 2 a bad argument, spec or manifest.
"""

from __future__ import annotations

import argparse
import sys

from .._version import __version__
from ..errors import FlashJITError, SpecError
from .cli_cache import cmd_cache_export, cmd_cache_import, cmd_cache_info, cmd_cache_prune, cmd_clear, cmd_list
from .cli_doctor import cmd_doctor
from .cli_kernels import DEFAULT_EXAMPLE, cmd_check_mask, cmd_prewarm, cmd_run_example, cmd_show
from .cli_output import error, routed_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashjit", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"flashjit {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every compile (INFO) on stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def cache_dir(p):
        p.add_argument("--cache-dir", help="kernel cache folder (default: $FLASHJIT_CACHE_DIR, else the user cache dir)")

    def archs(p):
        p.add_argument("--arch", help="comma-separated target archs, e.g. sm_80,sm_90 (default: the manifest's "
                                      "archs, else this machine's GPU)")

    def jobs(p):
        p.add_argument("--jobs", "-j", type=int, default=None, help="parallel compiles (default: CPU count)")

    def specs_from(p, what):
        p.add_argument("--spec", action="append", metavar="NAME",
                       help=f"{what}a spec name such as decode_d128_bf16_kvbf16_none_p16_g4_q1_nhd_sm90_tc or "
                            "mla_c512_r64_h16_bf16_kvbf16_p64_q1_sm90 (repeatable)")
        p.add_argument("--hf-config", action="append", metavar="CONFIG.json",
                       help=f"{what}the kernels of a HuggingFace config.json (or its folder); repeatable")
        p.add_argument("--page-size", help="with --hf-config: comma-separated page sizes (default 16)")
        p.add_argument("--dtype", help="with --hf-config: query dtype instead of the config's torch_dtype")
        p.add_argument("--kv-dtype", help="with --hf-config: KV cache dtype (default: the query dtype)")
        p.add_argument("--max-q-len", help="with --hf-config: comma-separated query tokens per request (default 1)")
        p.add_argument("--tp", help="with --hf-config of a latent-attention (MLA) model: comma-separated "
                                    "tensor-parallel sizes, heads per GPU = num_attention_heads / TP (default 1,8,16)")

    p = sub.add_parser("prewarm", help="compile (or load) every kernel of a manifest and/or named specs")
    p.add_argument("manifest", nargs="?", metavar="MANIFEST.toml")
    specs_from(p, "")
    archs(p), jobs(p), cache_dir(p)
    p.set_defaults(func=cmd_prewarm)

    p = sub.add_parser("list", help="list the kernels in the cache")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    cache_dir(p)
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("show", help="print the rendered CUDA source of a spec")
    p.add_argument("spec_name", metavar="SPEC_NAME")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("clear", help="remove every kernel from the cache")
    cache_dir(p)
    p.set_defaults(func=cmd_clear)

    p = sub.add_parser("cache", help="move kernels between hosts (export/import bundles), inspect and prune the cache")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    q = actions.add_parser("export", help="write verified cache entries (and index files) to a .tar.gz bundle")
    q.add_argument("out", metavar="OUT.tar.gz")
    q.add_argument("--manifest", help="only the kernels of this manifest (all must be cached)")
    specs_from(q, "only ")
    archs(q), cache_dir(q)
    q.set_defaults(func=cmd_cache_export)
    q = actions.add_parser("import", help="verify a bundle and add its entries to the cache")
    q.add_argument("bundle", metavar="IN.tar.gz")
    q.add_argument("--replace", action="store_true",
                   help="let the bundle's index files replace local ones that name other verified kernels")
    q.add_argument("--max-size", metavar="SIZE", help="refuse bundles that unpack to more than SIZE (default 2GiB)")
    q.add_argument("--max-members", type=int, metavar="N", help="refuse bundles of more than N members (default 50000)")
    cache_dir(q)
    q.set_defaults(func=cmd_cache_import)
    q = actions.add_parser("info", help="size, entries per arch, other schema versions")
    q.add_argument("--json", action="store_true", help="print JSON instead of text")
    cache_dir(q)
    q.set_defaults(func=cmd_cache_info)
    q = actions.add_parser("prune", help="evict least recently used entries, or old schema versions")
    q.add_argument("--max-size", metavar="SIZE", help="keep at most SIZE of entries, e.g. 2GB, 500MiB")
    q.add_argument("--old-versions", action="store_true", help="remove the folders of older cache schemas")
    q.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")
    cache_dir(q)
    q.set_defaults(func=cmd_cache_prune)

    p = sub.add_parser("doctor", help="versions, GPU, cache dir and a test compile")
    cache_dir(p)
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("run-example", help=f"prewarm examples/{DEFAULT_EXAMPLE}, then (with a GPU) check one "
                                           "decode step against the torch reference")
    p.add_argument("--manifest", help=f"manifest to prewarm (default: examples/{DEFAULT_EXAMPLE})")
    archs(p), jobs(p), cache_dir(p)
    p.set_defaults(func=cmd_run_example)

    p = sub.add_parser("check-mask", help="check a mask: compile it, replay its hooks on the CPU, and (with a GPU) "
                                          "run its kernels against the torch reference on random batches")
    p.add_argument("mask", metavar="NAME", help="a registered mask (built-in, template folder or plugin), or an "
                                                 "attention variant (soft_cap, sinks, ...: checked under every built-in mask)")
    p.add_argument("--variant", help="check the mask NAME under this attention variant")
    p.add_argument("--arch", help="comma-separated archs to compile for (default: sm_90 without a GPU, "
                                  "none beyond the GPU's own with one)")
    p.add_argument("--params", nargs="+", default=[], metavar="NAME=VALUE",
                   help="fix int/float mask (or variant) params for every case (others are sampled)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random cases (default 0)")
    jobs(p), cache_dir(p)
    p.set_defaults(func=cmd_check_mask)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with routed_logging(args.verbose):
            return args.func(args)
    except SpecError as exc:  # bad spec name, manifest or arch: the user's input
        error(str(exc))
        return 2
    except FlashJITError as exc:  # CompileError carries the NVRTC log and the saved source's path
        error(str(exc))
        return 1
    except BrokenPipeError:  # `flashjit show ... | head`
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
