"""The `flashjit` command: prewarm, list, show, explain, clear, cache, doctor, run-example, check-mask.

Argument parsing only; the commands live in cli_kernels (prewarm, show, run-example, check-mask),
cli_explain, cli_cache (list, clear, cache ...) and cli_doctor, and the work is done by the engine,
the cache, the manifest module, smoke_test and mask_check. Tables (or, with --json, one JSON
value) go to stdout; progress bars, log lines and errors to stderr. Exit codes: 0 success, 1 a
compile/check failure, 2 a bad argument, spec or manifest.
"""

from __future__ import annotations

import argparse
import sys

from .._version import __version__
from ..errors import FlashJITError, SpecError
from .cli_cache import cmd_cache_export, cmd_cache_import, cmd_cache_info, cmd_cache_prune, cmd_clear, cmd_list
from .cli_doctor import cmd_doctor
from .cli_explain import GRAMMAR, cmd_explain
from .cli_kernels import DEFAULT_EXAMPLE, cmd_check_mask, cmd_prewarm, cmd_run_example, cmd_show
from .cli_output import error, routed_logging

VERBOSE_HELP = "log every compile (INFO) on stderr"
EXAMPLE_SPEC = "decode_d128_bf16_kvbf16_causal_p16_g4_q1_nhd_sm90_tc"
SPEC_NAMES = (f"a spec name: {GRAMMAR['decode']}, e.g. {EXAMPLE_SPEC} (`flashjit explain NAME` says what each part "
              "means); or mla_... and merge_states_... names")


def positive_int(text: str) -> int:
    """argparse type of counts: an int of at least 1, in under 20 digits (named by argparse otherwise)."""
    if not text.strip().isdigit() or len(text.strip()) > 18 or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def seed(text: str) -> int:
    if not text.strip().isdigit() or len(text.strip()) > 18:
        raise argparse.ArgumentTypeError(f"expected an integer 0..{10**18 - 1}, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashjit", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"flashjit {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    # -v after the subcommand too; SUPPRESS keeps one given before it when none follows
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(parent, name, help_text, description, func):
        p = parent.add_parser(name, help=help_text, description=description, parents=[verbose])
        if func is not None:
            p.set_defaults(func=func)
        return p

    def cache_dir(p):
        p.add_argument("--cache-dir", metavar="DIR",
                       help="kernel cache folder (default: $FLASHJIT_CACHE_DIR, else the user cache dir)")

    def json_output(p, what="the report"):
        p.add_argument("--json", action="store_true", help=f"print {what} as JSON on stdout instead of text")

    def archs(p):
        p.add_argument("--arch", help="comma-separated target archs, e.g. sm_80,sm_90 (default: the manifest's "
                                      "archs, else this machine's GPU)")

    def jobs(p):
        p.add_argument("--jobs", "-j", type=positive_int, default=None, metavar="N",
                       help="parallel compiles (default: the CPU count)")

    def specs_from(p, what):
        p.add_argument("--spec", action="append", metavar="NAME", help=f"{what}{SPEC_NAMES} (repeatable)")
        p.add_argument("--hf-config", action="append", metavar="CONFIG.json",
                       help=f"{what}the kernels of a HuggingFace config.json (or its folder); repeatable")
        p.add_argument("--page-size", help="with --hf-config: comma-separated page sizes (default 16)")
        p.add_argument("--dtype", help="with --hf-config: query dtype instead of the config's torch_dtype")
        p.add_argument("--kv-dtype", help="with --hf-config: KV cache dtype (default: the query dtype)")
        p.add_argument("--max-q-len", help="with --hf-config: comma-separated query tokens per request (default 1)")
        p.add_argument("--tp", help="with --hf-config of a latent-attention (MLA) model: comma-separated "
                                    "tensor-parallel sizes, heads per GPU = num_attention_heads / TP (default 1,8,16)")

    p = command(sub, "prewarm", "compile (or load) every kernel of a manifest and/or named specs",
                "Compile, or load from the disk cache, every kernel a deployment needs: those of a manifest, of "
                "--spec names and of --hf-config configs, in parallel, so that a server never compiles. Prints "
                "one row per kernel (where it came from, seconds) and a total; a progress bar on a terminal, a "
                "one-line summary on stderr otherwise.", cmd_prewarm)
    p.add_argument("manifest", nargs="?", metavar="MANIFEST.toml",
                   help="a TOML manifest: the models and the kernel variants each needs (docs/cli.md, Manifests)")
    specs_from(p, "")
    archs(p), jobs(p), cache_dir(p), json_output(p, "the kernels and totals")

    p = command(sub, "list", "list the kernels in the cache",
                "List the cache's verified kernels: spec name, arch, cubin size and compile seconds.", cmd_list)
    json_output(p, "the entries (with their keys, creation times, versions and paths)")
    cache_dir(p)

    p = command(sub, "show", "print the rendered CUDA source of a spec",
                "Print the CUDA source flashjit renders for a spec (`flashjit explain` says what its name means).",
                cmd_show)
    p.add_argument("spec_name", metavar="SPEC_NAME", help=SPEC_NAMES)

    p = command(sub, "explain", "say what each part of a spec name means",
                "Say what each part of a spec name means (decode, MLA and merge_states kernels) and which plan() "
                "picks the kernel; the name is parsed by the code --spec uses, and a bad part is named.",
                cmd_explain)
    p.add_argument("spec_name", metavar="SPEC_NAME", help=SPEC_NAMES)
    json_output(p, "the fields")

    p = command(sub, "clear", "remove every kernel from the cache",
                "Remove every kernel (and index file) from the cache; prints how many entries went.", cmd_clear)
    cache_dir(p)

    p = command(sub, "cache", "move kernels between hosts (export/import bundles), inspect and prune the cache",
                "Move kernels between hosts as verified bundles, inspect the cache and prune it.", None)
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    q = command(actions, "export", "write verified cache entries (and index files) to a .tar.gz bundle",
                "Write a bundle: every verified entry of the cache (only --arch's archs, if given), or exactly the "
                "kernels of a manifest, --spec names or --hf-config configs (all must be cached).",
                cmd_cache_export)
    q.add_argument("out", metavar="OUT.tar.gz", help="the bundle file to write")
    q.add_argument("--manifest", help="only the kernels of this manifest (all must be cached)")
    specs_from(q, "only ")
    archs(q), cache_dir(q), json_output(q, "the entries exported")
    q = command(actions, "import", "verify a bundle and add its entries to the cache",
                "Verify a bundle (links, paths, sizes, every cubin against its hash and every key against its "
                "source) and add its entries and index files to the cache.", cmd_cache_import)
    q.add_argument("bundle", metavar="IN.tar.gz", help="a bundle written by `flashjit cache export`")
    q.add_argument("--replace", action="store_true",
                   help="let the bundle's index files replace local ones that name other verified kernels")
    q.add_argument("--max-size", metavar="SIZE", help="refuse bundles that unpack to more than SIZE (default 2GiB)")
    q.add_argument("--max-members", type=positive_int, metavar="N",
                   help="refuse bundles of more than N members (default 50000)")
    cache_dir(q), json_output(q, "what was imported, present and rejected")
    q = command(actions, "info", "size, entries per arch, other schema versions",
                "Report the cache folder: size on disk, verified and incomplete entries, index files, entries "
                "per arch, and folders of other schema versions.", cmd_cache_info)
    json_output(q)
    cache_dir(q)
    q = command(actions, "prune", "evict least recently used entries, or old schema versions",
                "Evict the least recently used entries until the rest fit in --max-size (plus incomplete entries "
                "and stale index files), and/or remove older schema versions' folders.", cmd_cache_prune)
    q.add_argument("--max-size", metavar="SIZE", help="keep at most SIZE of entries, e.g. 2GB, 500MiB")
    q.add_argument("--old-versions", action="store_true", help="remove the folders of older cache schemas")
    q.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")
    cache_dir(q), json_output(q, "what went (or would go) and what was kept")

    p = command(sub, "doctor", "versions, GPU, cache dir and a test compile",
                "Report the versions of flashjit, Python, torch, CuPy, NVRTC and Jinja2, the GPU, the cache folder "
                "and a test compile; exit 1 when NVRTC is missing or the compile fails.", cmd_doctor)
    cache_dir(p), json_output(p)

    p = command(sub, "run-example", f"prewarm examples/{DEFAULT_EXAMPLE}, then (with a GPU) check one decode "
                                    "step against the torch reference",
                f"Prewarm examples/{DEFAULT_EXAMPLE} (or --manifest) and, with a CUDA GPU, run one BatchDecode "
                "step on random data against the float32 torch reference.", cmd_run_example)
    p.add_argument("--manifest", help=f"manifest to prewarm (default: examples/{DEFAULT_EXAMPLE})")
    archs(p), jobs(p), cache_dir(p)

    p = command(sub, "check-mask", "check a mask: compile it, replay its hooks on the CPU, and (with a GPU) run "
                                   "its kernels against the torch reference on random batches",
                "Check a mask or attention variant: compile its kernels, replay its hooks on the CPU against its "
                "torch reference, and with a CUDA GPU run its kernels against the float32 reference on random "
                "batches under every split policy.", cmd_check_mask)
    p.add_argument("mask", metavar="NAME", help="a registered mask (built-in, template folder or plugin), or an "
                                                 "attention variant (soft_cap, sinks, ...: checked under every built-in mask)")
    p.add_argument("--variant", help="check the mask NAME under this attention variant")
    p.add_argument("--arch", help="comma-separated archs to compile for (default: sm_90 without a GPU, "
                                  "none beyond the GPU's own with one)")
    p.add_argument("--params", nargs="+", default=[], metavar="NAME=VALUE",
                   help="fix int/float mask (or variant) params for every case (others are sampled)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the random cases (default 0)")
    jobs(p), cache_dir(p), json_output(p, "the compiles, cases and verdict")
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
