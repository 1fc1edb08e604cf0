"""`flashjit explain NAME`: what each part of a spec name means, and which plan() picks the kernel.

The name is cut into its parts here only to say which part is wrong; the spec itself comes from
the real parser (family.spec_from_name), whose field errors are reported against their part.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from ..errors import SpecError
from .cli_output import UsageError


class Part(NamedTuple):
    text: str       # the part of the name ("" where the name leaves it out)
    field: str      # the spec field it sets
    pattern: str    # what the part must look like (a regex), for the error naming it
    form: str       # that form, in words


# Each family's parts in order: (field, pattern, form). Optional parts end the decode name.
DECODE_HEAD = (("head_dim", r"d\d+", "d<head_dim>, e.g. d128"), ("dtype", r"[a-z0-9]+", "f16 or bf16"),
               ("kv_dtype", r"kv[a-z0-9]+", "kv<dtype>, e.g. kvbf16 or kve4m3"))
DECODE_TAIL = (("page_size", r"p\d+", "p<page_size>, e.g. p16"), ("group_size", r"g\d+", "g<group_size>, e.g. g4"),
               ("max_q_len", r"q\d+", "q<max_q_len>, e.g. q1"), ("kv_layout", r"nhd|hnd", "nhd or hnd"),
               ("arch", r"sm\d+a?", "sm<arch>, e.g. sm90"))
MLA_PARTS = (("kv_lora_rank", r"c\d+", "c<kv_lora_rank>, e.g. c512"), ("rope_dim", r"r\d+", "r<rope_dim>, e.g. r64"),
             ("num_heads", r"h\d+", "h<num_heads>, e.g. h16"), ("dtype", r"[a-z0-9]+", "f16 or bf16"),
             ("kv_dtype", r"kv[a-z0-9]+", "kv<dtype>, e.g. kvbf16"), ("page_size", r"p\d+", "p<page_size>, e.g. p64"),
             ("max_q_len", r"q\d+", "q<max_q_len>, e.g. q1"), ("arch", r"sm\d+a?", "sm<arch>, e.g. sm90"))
MERGE_PARTS = (("dtype", r"f16|bf16|f32", "f16, bf16 or f32"), ("arch", r"sm\d+a?", "sm<arch>, e.g. sm90"))
GRAMMAR = {
    "decode": "decode_d{head_dim}_{dtype}_kv{kv_dtype}_{mask}[-{variant}]_p{page_size}_g{group_size}_q{max_q_len}"
              "_{nhd|hnd}_sm{arch}[_tc][_sp][_fp8q]",
    "mla": "mla_c{kv_lora_rank}_r{rope_dim}_h{num_heads}_{dtype}_kv{kv_dtype}_p{page_size}_q{max_q_len}_sm{arch}",
    "merge_states": "merge_states_{dtype}_sm{arch}",
}


def _bad(name: str, part: Part, problem: str) -> UsageError:
    shown = repr(part.text) if part.text else "nothing"
    return UsageError(f"{name!r}: field {part.field} ({shown}): {problem}")


def _match(name: str, tokens: list, specs: tuple) -> list[Part]:
    parts = []
    for (field, pattern, form), text in zip(specs, tokens + [""] * (len(specs) - len(tokens))):
        part = Part(text, field, pattern, form)
        if not re.fullmatch(pattern, text):
            raise _bad(name, part, f"expected {form}")
        parts.append(part)
    return parts


def split_name(name: str) -> tuple[str, list[Part]]:
    """(family, parts) of a spec name; UsageError naming the first part of the wrong form."""
    if not isinstance(name, str) or not name.strip():
        raise UsageError(f"expected a spec name ({', '.join(GRAMMAR.values())}), got {name!r}")
    name = name.strip()
    tokens = name.split("_")
    if name.startswith("merge_states_"):
        return "merge_states", _match(name, tokens[2:], MERGE_PARTS) + _extra(name, tokens[4:])
    if tokens[0] == "mla":
        return "mla", _match(name, tokens[1:], MLA_PARTS) + _extra(name, tokens[9:])
    if tokens[0] != "decode":
        raise UsageError(f"{name!r}: a spec name starts with decode_, mla_ or merge_states_; the forms are "
                         + "; ".join(GRAMMAR.values()))
    flags = []
    while len(tokens) > 1 and tokens[-1] in ("tc", "sp", "fp8q"):
        flags.insert(0, tokens.pop())
    if [f for f in ("tc", "sp", "fp8q") if f in flags] != flags or len(set(flags)) != len(flags):
        raise _bad(name, Part("_".join(flags), "tensor_cores", "", ""),
                   "expected _tc, _sp, _fp8q in that order at the end")
    head = _match(name, tokens[1:4], DECODE_HEAD)
    # The tail from the right: a part left out is then named by the part found in its place.
    tail_tokens = [tokens[i] if i >= 4 else "" for i in range(len(tokens) - len(DECODE_TAIL), len(tokens))]
    tail = _match(name, tail_tokens[::-1], DECODE_TAIL[::-1])[::-1]
    mask, _, variant = "_".join(tokens[4:len(tokens) - len(DECODE_TAIL)]).partition("-")
    mask_part = Part(mask, "mask", r"\w+", "a mask name, e.g. causal")
    if not re.fullmatch(r"[A-Za-z]\w*", mask):
        raise _bad(name, mask_part, "expected a mask name between kv<dtype> and p<page_size>, e.g. causal or "
                                    "sliding_window-sinks")
    variant_part = Part(variant, "variant", r"\w*", "-<variant> after the mask, e.g. -sinks")
    flag_parts = [Part("tc" if "tc" in flags else "", "tensor_cores", "", ""),
                  Part("sp" if "sp" in flags else "", "shared_prefix", "", ""),
                  Part("fp8q" if "fp8q" in flags else "", "query_fp8", "", "")]
    return "decode", head + [mask_part, variant_part] + tail + flag_parts


def _extra(name: str, tokens: list) -> list:
    if tokens:
        raise UsageError(f"{name!r}: unexpected {'_'.join(tokens)!r} after the arch")
    return []


def parse(name: str):
    """(spec, family, parts): the spec from the real parser; a field it refuses is named with its part."""
    from ..jit.family import spec_from_name

    family, parts = split_name(name)
    try:
        spec = spec_from_name(name)
    except SpecError as exc:
        part = next((p for p in parts if p.field == exc.field), None)
        if part is None:  # the grammar's checks above passed, the parser's did not
            raise UsageError(f"{name!r}: {exc}") from None
        raise _bad(name.strip(), part, f"{exc.value!r} is not supported; accepted: {exc.accepted}") from None
    return spec, family, parts


# ---- what each field means ------------------------------------------------------------------------

def meanings(spec, family: str) -> dict:
    """field -> what its value means for this spec."""
    layouts = {"NHD": "pages of [page_size, kv_heads, head_dim]", "HND": "pages of [kv_heads, page_size, head_dim]"}
    if family == "merge_states":
        dtype = "the dtype of the states merged"
    elif getattr(spec, "query_fp8", False):
        dtype = "the output's dtype (the queries are e4m3: _fp8q)"
    else:
        dtype = "the queries' and output's dtype"
    common = {
        "dtype": f"{spec.dtype}: {dtype}",
        "kv_dtype": f"{getattr(spec, 'kv_dtype', '')}: the KV cache's dtype"
                    + (" (fp8: run() takes k_scale and v_scale)" if getattr(spec, "kv_is_fp8", False) else ""),
        "page_size": f"{getattr(spec, 'page_size', '')} tokens per cache page",
        "max_q_len": f"up to {getattr(spec, 'max_q_len', '')} query tokens per request (1: plain decode; more: "
                     "speculative or multi-token decode, causal among them)",
        "arch": f"{spec.arch}: the GPU architecture the kernel is compiled for",
    }
    if family == "mla":
        return {**common, "kv_lora_rank": f"{spec.kv_lora_rank}: the latent (c_kv) width, the shared key and value",
                "rope_dim": f"{spec.rope_dim}: the decoupled RoPE key (k_pe) width",
                "num_heads": f"{spec.num_heads} query heads on the one latent head (num_attention_heads / TP)"}
    if family == "merge_states":
        return common
    from ..masks.registry import masks
    from ..masks.variants import variants

    mask, variant = masks.get(spec.mask), variants.get(spec.variant)
    params = lambda d: (f"; plan() takes {', '.join(f'{p.name} ({p.kind})' for p in d.params)}"  # noqa: E731
                        if d.params else "")
    return {**common,
            "head_dim": f"{spec.head_dim}: the head dimension of queries, keys and values",
            "mask": f"{spec.mask}: which keys each query sees (docs/masks.md){params(mask)}",
            "variant": (f"{spec.variant}: how visible scores become weights{params(variant)}" if spec.variant != "none"
                        else "none: plain softmax (-soft_cap, -sinks or -soft_cap_sinks after the mask name one)"),
            "group_size": f"{spec.group_size} query heads per KV head (num_qo_heads / num_kv_heads)",
            "kv_layout": f"{spec.kv_layout}: {layouts[spec.kv_layout]}",
            "tensor_cores": "tensor-core kernel (_tc)" if spec.tensor_cores else "CUDA-core kernel (no _tc)",
            "shared_prefix": ("also reads shared-prefix records (_sp)" if spec.shared_prefix
                              else "reads each request alone (no _sp)"),
            "query_fp8": ("e4m3 queries (_fp8q), quantized by the framework; dtype is the output's"
                          if spec.query_fp8 else f"{spec.dtype} queries (no _fp8q)")}


def picked_by(spec, family: str) -> str:
    """Which plan() or prewarm picks this kernel: where a name from the grammar alone goes wrong."""
    if family == "merge_states":
        return f"merge_states() of {spec.dtype} states on an {spec.arch} GPU"
    if family == "mla":
        return (f"BatchDecodeMLA.plan(num_heads={spec.num_heads}, page_size={spec.page_size}, "
                f"q_dtype={spec.dtype!r}, kv_dtype={spec.kv_dtype!r}) on an {spec.arch} GPU, up to "
                f"{spec.max_q_len} query tokens per request")
    chosen = spec.replace(tensor_cores=None, shared_prefix=False)
    variant = "" if spec.variant == "none" else f", variant={spec.variant!r}"
    out_dtype = f"out_dtype={spec.dtype!r}, " if spec.query_fp8 else ""
    call = (f"BatchDecode.plan(num_qo_heads={spec.group_size}*n, num_kv_heads=n, head_dim={spec.head_dim}, "
            f"page_size={spec.page_size}, mask={spec.mask!r}{variant}, q_dtype={spec.q_dtype!r}, {out_dtype}"
            f"kv_dtype={spec.kv_dtype!r}, kv_layout={spec.kv_layout!r}) on an {spec.arch} GPU, up to "
            f"{spec.max_q_len} query tokens per request")
    if spec.shared_prefix:
        return f"{call}, when requests share prefixes (share_prefixes, docs/shared_prefix.md)"
    if chosen.tensor_cores != spec.tensor_cores:
        return f"{call}, only with tensor_cores={spec.tensor_cores}: by default it picks {chosen.name}"
    return call


def explain(name: str) -> dict:
    spec, family, parts = parse(name)
    meaning = meanings(spec, family)
    return {"name": spec.name, "family": family, "grammar": GRAMMAR[family], "spec": spec.to_dict(),
            "fields": [{"part": p.text, "field": p.field, "value": getattr(spec, p.field), "meaning": meaning[p.field]}
                       for p in parts],
            "picked_by": picked_by(spec, family)}


def cmd_explain(args) -> int:
    from .cli_output import print_json, table

    found = explain(args.spec_name)
    if args.json:
        print_json(found)
        return 0
    print(f"{found['name']}: a {found['family']} kernel ({found['grammar']})")
    print(table([(p["part"] or "-", p["field"], p["meaning"]) for p in found["fields"]], ("part", "field", "meaning")))
    print(f"picked by: {found['picked_by']}")
    return 0
