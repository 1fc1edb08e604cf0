"""Prewarm manifests: per model, the kernel variants a deployment needs, in plain TOML.

    archs = ["sm_80", "sm_90"]          # optional; `--arch` overrides, else the current GPU's

    [[model]]
    name = "llama-3-8b"
    num_qo_heads = 32
    num_kv_heads = 8                    # group_size = num_qo_heads // num_kv_heads
    head_dim = 128
    dtype = "bf16"
    kv_dtype = "bf16"                   # optional, defaults to dtype
    q_dtype = "e4m3"                    # optional, defaults to dtype; e4m3 over an e4m3 cache (vLLM's fp8)
    page_sizes = [16]
    masks = ["none", "causal"]
    max_q_lens = [1, 4]                 # optional, default [1]; > 1 for speculative decoding
    kv_layouts = ["NHD"]                # optional, default ["NHD"]
    variants = ["sinks"]                # optional, default ["none"]; attention variants (soft_cap, sinks, ...)

Each model expands to the cross product page_sizes x masks x variants x max_q_lens x kv_layouts x
archs. Runtime values (batch, lengths, sliding-window size, sm_scale, the soft cap, the sinks'
values) are launch arguments and have no place here. Every problem raises ManifestError, naming the file, the model and the field.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

from ..errors import SpecError
from ..jit.arch import current_arch
from ..kernels.decode.spec import HEAD_DIMS, DecodeSpec
from ..serving.plan_setup import output_dtype
from .input_files import INT32_MAX, ManifestError, load_toml, quote

TOP_LEVEL_KEYS = ("archs", "model")
REQUIRED_KEYS = ("name", "num_qo_heads", "num_kv_heads", "head_dim", "dtype", "page_sizes", "masks")
OPTIONAL_KEYS = {"kv_dtype": None, "q_dtype": None, "max_q_lens": [1], "kv_layouts": ["NHD"], "variants": ["none"]}
LIST_KEYS = ("page_sizes", "masks", "max_q_lens", "kv_layouts", "variants")
# manifest field -> DecodeSpec field, to name the manifest's field when a spec rejects a value
_SPEC_FIELD_TO_KEY = {"head_dim": "head_dim", "dtype": "dtype", "kv_dtype": "kv_dtype", "mask": "masks",
                      "page_size": "page_sizes", "group_size": "num_qo_heads/num_kv_heads",
                      "max_q_len": "max_q_lens", "kv_layout": "kv_layouts", "arch": "archs", "variant": "variants",
                      "query_fp8": "q_dtype"}


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """One [[model]] table, validated for shape (values are validated by DecodeSpec)."""

    name: str
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kv_dtype: str | None
    page_sizes: tuple[int, ...]
    masks: tuple[str, ...]
    max_q_lens: tuple[int, ...] = (1,)
    kv_layouts: tuple[str, ...] = ("NHD",)
    variants: tuple[str, ...] = ("none",)
    q_dtype: str | None = None  # None: dtype; e4m3 for queries a framework quantized (DecodeSpec.query_fp8)

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads


@dataclasses.dataclass(frozen=True)
class Manifest:
    path: str
    archs: tuple[str, ...]  # empty when the file names none
    models: tuple[ModelEntry, ...]

    def specs(self, archs=None) -> list[DecodeSpec]:
        """Every spec of every model for each target arch, without duplicates, in file order."""
        targets = resolve_archs(archs, self.archs, self.path)
        found: dict[DecodeSpec, None] = {}
        for model in self.models:
            for spec in expand_model(model, targets, self.path):
                found.setdefault(spec)
        return list(found)


def load_manifest(path) -> Manifest:
    """Parse and check a manifest file (no spec is built yet: archs may come from the command line)."""
    path = Path(path)
    return parse_manifest(load_toml(path), path)


def parse_manifest(data: dict, path="<manifest>") -> Manifest:
    unknown = sorted(set(data) - set(TOP_LEVEL_KEYS))
    if unknown:
        raise ManifestError(path, None, unknown[0], f"unknown top-level key; accepted: {', '.join(TOP_LEVEL_KEYS)}")
    archs = data.get("archs", [])
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ManifestError(path, None, "archs", f"must be a list of arch names such as [\"sm_80\", \"sm_90\"], got {quote(archs)}")
    tables = data.get("model")
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise ManifestError(path, None, "model", "the manifest needs at least one [[model]] table")
    models, seen = [], set()
    for index, table in enumerate(tables):
        model = _parse_model(table, index, path)
        if model.name in seen:
            raise ManifestError(path, model.name, "name", "appears twice; model names must be unique")
        seen.add(model.name)
        models.append(model)
    return Manifest(str(path), tuple(archs), tuple(models))


def _parse_model(table: dict, index: int, path) -> ModelEntry:
    name = table.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ManifestError(path, f"#{index + 1}", "name", f"every [[model]] needs a non-empty string name, got {quote(name)}")
    fail = lambda field, problem: ManifestError(path, name, field, problem)  # noqa: E731
    unknown = sorted(set(table) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS))
    if unknown:
        raise fail(unknown[0], f"unknown key; accepted: {', '.join(REQUIRED_KEYS + tuple(OPTIONAL_KEYS))}")
    missing = [key for key in REQUIRED_KEYS if key not in table]
    if missing:
        raise fail(missing[0], "is required")
    values = dict(OPTIONAL_KEYS, **table)
    for key in ("num_qo_heads", "num_kv_heads", "head_dim"):
        value = values[key]
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= INT32_MAX:
            raise fail(key, f"must be a positive integer up to {INT32_MAX}, got {quote(value)}")
    if values["num_qo_heads"] % values["num_kv_heads"]:
        raise fail("num_kv_heads", f"must divide num_qo_heads={values['num_qo_heads']} "
                                   f"(GQA group size), got {values['num_kv_heads']}")
    for key in ("dtype", "kv_dtype", "q_dtype"):
        if values[key] is not None and not isinstance(values[key], str):
            raise fail(key, f"must be a string such as \"bf16\", got {quote(values[key])}")
    for key in LIST_KEYS:
        value = values[key]
        kind = str if key in ("masks", "kv_layouts", "variants") else int
        if (not isinstance(value, list) or not value
                or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value)):
            example = '["none", "causal"]' if kind is str else "[16]"
            raise fail(key, f"must be a non-empty list of {kind.__name__}s such as {example}, got {quote(value)}")
    return ModelEntry(
        name=name, num_qo_heads=values["num_qo_heads"], num_kv_heads=values["num_kv_heads"],
        head_dim=values["head_dim"], dtype=values["dtype"], kv_dtype=values["kv_dtype"], q_dtype=values["q_dtype"],
        page_sizes=tuple(values["page_sizes"]), masks=tuple(values["masks"]),
        max_q_lens=tuple(values["max_q_lens"]), kv_layouts=tuple(values["kv_layouts"]),
        variants=tuple(values["variants"]))


def resolve_archs(cli_archs, manifest_archs=(), path=None) -> tuple[str, ...]:
    """Target archs, normalized ("90" -> "sm_90"): the command line's, else the manifest's, else the GPU's."""
    if isinstance(cli_archs, str):
        cli_archs = parse_arch_list(cli_archs)
    if cli_archs:
        archs, field = tuple(cli_archs), "--arch"
    elif manifest_archs:
        archs, field = tuple(manifest_archs), "archs"
    else:
        detected = current_arch()
        if detected is None:
            raise ManifestError(path, None, "archs", "no target arch: pass --arch sm_80,sm_90 (or set archs = [...] "
                                                     "in the manifest); there is no GPU here to detect one from")
        archs, field = (detected,), "archs"
    normalized = []
    for arch in archs:
        try:  # DecodeSpec is the one place that knows the accepted spellings
            normalized.append(DecodeSpec(head_dim=HEAD_DIMS[0], arch=arch).arch)
        except SpecError as exc:
            raise ManifestError(path, None, field, f"{quote(arch)} is not a known arch; accepted: {exc.accepted}") from None
    return tuple(dict.fromkeys(normalized))


def parse_arch_list(text: str) -> list[str]:
    """'sm_80,sm_90' -> ['sm_80', 'sm_90'] (validated later, by DecodeSpec)."""
    return [part.strip() for part in text.split(",") if part.strip()]


def expand_model(model: ModelEntry, archs, path="<manifest>") -> list[DecodeSpec]:
    query_fp8 = _query_fp8(model, path)
    specs = []
    for page_size, mask, variant, max_q_len, layout, arch in itertools.product(
            model.page_sizes, model.masks, model.variants, model.max_q_lens, model.kv_layouts, archs):
        try:
            specs.append(DecodeSpec(head_dim=model.head_dim, dtype=model.dtype, kv_dtype=model.kv_dtype, mask=mask,
                                    page_size=page_size, group_size=model.group_size, max_q_len=max_q_len,
                                    kv_layout=layout, arch=arch, variant=variant, query_fp8=query_fp8))
        except SpecError as exc:
            key = _SPEC_FIELD_TO_KEY.get(exc.field, exc.field)
            value = model.q_dtype if exc.field == "query_fp8" else exc.value
            raise ManifestError(path, model.name, key, f"{quote(value)} is not supported; accepted: {exc.accepted}") from None
    return specs


def _query_fp8(model: ModelEntry, path) -> bool:
    """Whether the model's q_dtype asks for e4m3 queries, by plan()'s rule (its dtype is the output's)."""
    if model.q_dtype is None:
        return False
    try:
        return output_dtype(model.q_dtype, model.dtype)[1]
    except SpecError as exc:  # not a query dtype at all
        accepted = exc.accepted
    except ValueError:  # another 16-bit dtype than the output's
        accepted = f"the dtype ({model.dtype}) or e4m3"
    raise ManifestError(path, model.name, "q_dtype", f"{quote(model.q_dtype)} is not supported; accepted: {accepted}")


def specs_from_manifest(path, archs=None) -> list[DecodeSpec]:
    """load_manifest(path).specs(archs): the one call the CLI needs."""
    return load_manifest(path).specs(archs)
