"""Mask parameters for a check: typed command-line overrides, sampled values, and their text."""

from __future__ import annotations

import random

from ... import validation
from ...errors import SpecError
from ...masks.registry import MaskDef

DEFAULT_INTS = (0, 1, 5, 37)  # int params of masks without sample_params
DEFAULT_FLOATS = (0.0, 0.5, 2.0)


def parse_overrides(mask: MaskDef, items, what: str = "mask") -> dict:
    """['window_left=37', ...] (or {'window_left': '37'}) -> {'window_left': 37}, typed and checked
    by the param kinds (what: "mask", or "variant" for a VariantDef's params)."""
    kinds = {p.name: p.kind for p in mask.params}
    if isinstance(items, dict):
        items = [f"{k}={v}" for k, v in items.items()]
    values = {}
    for item in items or ():
        name, sep, text = str(item).partition("=")
        name = name.strip()
        if not sep or name not in kinds:
            raise SpecError("--params", item, f"NAME=VALUE with NAME one of {list(kinds)} ({what} {mask.name!r})",
                            owner="check_mask")
        if kinds[name] not in ("int", "float"):
            raise SpecError("--params", item, f"int or float params only; {name!r} is a tensor, built by the "
                                              f"{what}'s sample_params", owner="check_mask")
        try:
            number = int(text) if kinds[name] == "int" else float(text)
            values[name] = (validation.int32_param(name, number) if kinds[name] == "int"
                            else validation.float32_param(name, number))
        except ValueError:
            raise SpecError("--params", item, f"{'an int in 0..2147483647' if kinds[name] == 'int' else 'a finite float'}"
                                              f" value for {name!r}", owner="check_mask") from None
    return values


def sample_params(mask: MaskDef, rng: random.Random, kv_lens, q_lens, page_size: int, device,
                  overrides: dict | None = None) -> dict:
    """mask_params for a random batch: MaskDef.sample_params, then overrides, then small defaults."""
    overrides = dict(overrides or {})
    params = dict(mask.sample_params(rng, list(kv_lens), list(q_lens), page_size, device)) if mask.sample_params else {}
    for p in mask.params:
        if p.name in overrides:
            params[p.name] = overrides[p.name]
        elif p.name not in params:
            if p.kind == "int_tensor":
                raise SpecError(f"mask {mask.name!r}", f"param {p.name} (int_tensor)",
                                "masks whose tensor params a sample_params callable builds: "
                                "register_mask(..., sample_params=fn), see docs/masks.md")
            params[p.name] = rng.choice(DEFAULT_INTS if p.kind == "int" else DEFAULT_FLOATS)
    return params


def describe_params(params: dict) -> str:
    """Short text of mask params for failure messages (tensors by length, or values when short)."""
    parts = []
    for name, value in params.items():
        if hasattr(value, "tolist"):
            value = value.tolist() if value.numel() <= 16 else f"<{value.numel()} values>"
        parts.append(f"{name}={value}")
    return ", ".join(parts)
