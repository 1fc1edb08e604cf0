"""Golden source digests: what every kernel spec of the examples, and a matrix around them, renders to.

The rendered source alone determines a kernel's cubin and its cache entry key (jit/keys.py), so a
change to the Python or template tree that should change no kernel must leave every digest here
as it is. tests/test_golden_sources.py compares; this module lists the specs and writes the file:

    python tests/golden_sources.py --write     # only where a kernel is meant to change

Each record is "<compile arch> <sha256 of the source>" of a spec's name, or "refused <field>" for a
spec its constructor refuses (the matrix crosses the edges of what fits on an arch).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).with_name("golden") / "sources.json"
ARCHS = ("sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_120")
HF_ARCHS = ("sm_80", "sm_89", "sm_90")
USER_MASK = ROOT / "examples" / "masks" / "chunked.py"


def _example_specs():
    from flashjit.deploy.hf_config import manifest_from_hf_config
    from flashjit.deploy.hf_mla import is_mla_config, read_mla_config
    from flashjit.deploy.manifest import specs_from_manifest
    from flashjit.errors import SpecError

    for path in sorted((ROOT / "examples").glob("*.toml")):
        yield from specs_from_manifest(path)
    for path in sorted((ROOT / "examples" / "hf").glob("*/config.json")):
        if is_mla_config(path):
            for arch, kv_dtype in itertools.product(ARCHS, (None, "e4m3")):
                try:  # an fp8 cache at 128 heads does not fit the archs of 100 KB blocks
                    yield from read_mla_config(path).specs((arch,), page_sizes=(1, 64), kv_dtype=kv_dtype,
                                                           max_q_lens=(1, 2, 4))
                except SpecError:
                    pass
        else:
            for kv_dtype in (None, "e4m3"):
                yield from manifest_from_hf_config(path, page_sizes=(16,), kv_dtype=kv_dtype, max_q_lens=(1, 4),
                                                   kv_layouts=("NHD", "HND")).specs(HF_ARCHS)


def _decode_matrix():
    """(kwargs of DecodeSpec) around the examples: every mask and variant, head_dim, cache dtype,
    kernel kind and arch, the shared-prefix kernels, and the row shapes."""
    from flashjit.masks.registry import masks
    from flashjit.masks.variants import variants

    for mask, variant, tc in itertools.product(sorted(masks.names()), sorted(variants.names()), (True, False)):
        for kv in ("bf16", "e4m3"):
            yield dict(head_dim=128, kv_dtype=kv, mask=mask, variant=variant, group_size=4, max_q_len=2,
                       tensor_cores=tc, arch="sm_90")
    for head_dim, kv, tc, arch in itertools.product((64, 96, 128, 256, 512), ("bf16", "f16", "e4m3", "e5m2"),
                                                     (True, False), ARCHS):
        dtype = "f16" if kv == "f16" else "bf16"
        yield dict(head_dim=head_dim, dtype=dtype, kv_dtype=kv, mask="causal", group_size=4, max_q_len=2,
                   tensor_cores=tc, arch=arch)
    for head_dim, group, q_len, mask, arch in itertools.product((64, 96, 128, 256, 512), (1, 4, 8), (1, 4),
                                                               ("none", "causal", "sliding_window", "tree"),
                                                               ("sm_80", "sm_89", "sm_90", "sm_90a", "sm_120")):
        yield dict(head_dim=head_dim, mask=mask, group_size=group, max_q_len=q_len, tensor_cores=True,
                   shared_prefix=True, arch=arch)
    for group, q_len, page, layout, tc in itertools.product((1, 2, 4, 8, 16, 64), (1, 2, 4, 16), (1, 16, 64),
                                                            ("NHD", "HND"), (True, False)):
        yield dict(head_dim=128, mask="causal", group_size=group, max_q_len=q_len, page_size=page,
                   kv_layout=layout, tensor_cores=tc, arch="sm_90")


def _mla_matrix():
    for heads, q_len, dtype, kv, page, arch in itertools.product((1, 8, 16, 32, 64, 128), (1, 2, 4),
                                                                  ("bf16", "f16"), ("same", "e4m3", "e5m2"),
                                                                  (1, 64), ARCHS):
        yield dict(num_heads=heads, max_q_len=q_len, dtype=dtype, kv_dtype=None if kv == "same" else kv,
                   page_size=page, arch=arch)


def _record(engine, make):
    from flashjit.errors import SpecError

    try:
        spec = make()
    except SpecError as exc:
        return None, f"refused {exc.field}"
    source = engine.source(spec)
    return spec.name, f"{spec.compile_arch} {hashlib.sha256(source.encode()).hexdigest()[:32]}"


def digests(engine) -> dict[str, str]:
    """name -> record of every spec (the user mask examples/masks/chunked registered meanwhile)."""
    from flashjit import DecodeSpec, MergeSpec, MLASpec

    found: dict[str, str] = {}

    def add(make, label):
        name, record = _record(engine, make)
        found[name or label] = record

    for spec in _example_specs():
        add(lambda spec=spec: spec, spec.name)
    for kwargs in _decode_matrix():
        add(lambda kwargs=kwargs: DecodeSpec(**kwargs), "decode " + repr(sorted(kwargs.items())))
    for kwargs in _mla_matrix():
        add(lambda kwargs=kwargs: MLASpec(**kwargs), "mla " + repr(sorted(kwargs.items())))
    for dtype, arch in itertools.product(("f16", "bf16", "f32"), ARCHS):
        add(lambda dtype=dtype, arch=arch: MergeSpec(dtype=dtype, arch=arch), f"merge {dtype} {arch}")
    _register_user_mask()
    for tc, arch in itertools.product((True, False), ("sm_80", "sm_90")):
        add(lambda tc=tc, arch=arch: DecodeSpec(128, mask="chunked", group_size=4, tensor_cores=tc, arch=arch),
            f"chunked {tc} {arch}")
    return found


def _register_user_mask():
    import importlib.util

    module_spec = importlib.util.spec_from_file_location("flashjit_golden_chunked", USER_MASK)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    module.register()


def main(argv) -> int:
    import tempfile

    from flashjit import Engine

    with tempfile.TemporaryDirectory() as cache_dir:
        found = digests(Engine(cache_dir=cache_dir))
    if "--write" in argv:
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(found, indent=0, sort_keys=True) + "\n")
        print(f"wrote {len(found)} digests to {GOLDEN}")
        return 0
    golden = json.loads(GOLDEN.read_text())
    changed = sorted(name for name in golden.keys() | found.keys() if golden.get(name) != found.get(name))
    print("\n".join(changed) or f"all {len(found)} digests as in {GOLDEN.name}")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # the flashjit of this checkout, whatever else is installed
    raise SystemExit(main(sys.argv[1:]))
