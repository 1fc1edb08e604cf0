"""What FLASHJIT serves in vLLM, and a reason for every setting it refuses: vLLM prints the
reasons of validate_configuration when it cannot use a backend. Framework-free (no vLLM import)."""

from __future__ import annotations

# The decode rows run on flashjit; a mixed step's prefill rows on vLLM's FlashAttention over the
# same cache, so a setting is served when both take it: head sizes up to 256 (FA3), fp8 caches in
# e4m3 with FA3 (compute capability 9.0), learned sinks on 9.0 and newer.
SUPPORTED_HEAD_SIZES = (64, 96, 128, 256)
SUPPORTED_DTYPES = ("float16", "bfloat16")
SUPPORTED_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3")
FP8_CAPABILITIES = ((9, 0),)
SINK_CAPABILITY = (9, 0)
MAX_BLOCK_SIZE = 256
MIN_CAPABILITY = (8, 0)
# Caches over which FLASHJIT asks vLLM for e4m3 queries (Attention.query_quant, which torch.compile
# fuses into the op before it), as vLLM's FlashAttention does: the prefill rows then run FA3 on them
# as given, and the decode kernels convert them to f16 exactly (sm_89+; fp8 caches are served on 9.0).
FP8_QUERY_CACHE_DTYPES = ("fp8", "fp8_e4m3")


# The vLLM switches FLASHJIT refuses whenever they are on, each with its reason.
REFUSED_SETTINGS = {
    "use_mla": "MLA: FLASHJIT serves multi-head and grouped-query attention",
    "use_sparse": "sparse attention: FLASHJIT serves dense attention",
    "use_mm_prefix": "multimodal prefix (bidirectional image tokens): FLASHJIT serves causal attention",
    "use_rswa": "R-SWA (reference sliding window): FLASHJIT serves plain sliding windows",
    "use_non_causal": "non-causal decoder attention: FLASHJIT serves causal attention",
    "use_batch_invariant": "batch invariance (VLLM_BATCH_INVARIANT): not offered by FLASHJIT's vLLM backend",
    "use_pcp": "prefill context parallelism: FLASHJIT serves one context shard (pcp size 1)",
    "use_dcp": "decode context parallelism: FLASHJIT serves one context shard (dcp size 1)",
    "use_adaptive_verification": "adaptive speculative verification: FLASHJIT plans from the host's query "
                                 "lengths, which adaptive verification changes on the device",
}


def takes_fp8_queries(kv_cache_dtype: str, enabled: bool) -> bool:
    """Whether a layer over this cache asks vLLM for e4m3 queries; enabled: FLASHJIT_VLLM_FP8_QUERIES."""
    return enabled and kv_cache_dtype in FP8_QUERY_CACHE_DTYPES


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def refusal_reasons(*, head_size: int, dtype, kv_cache_dtype: str | None, block_size: int | None,
                    capability: tuple[int, int] | None, has_sink: bool = False, attn_type: str = "decoder",
                    **switches: bool) -> list[str]:
    """One reason per setting FLASHJIT does not serve, each naming the setting, its value and what
    is accepted; empty when the configuration is served. switches: REFUSED_SETTINGS' names."""
    unknown = sorted(switches.keys() - REFUSED_SETTINGS.keys())
    if unknown:
        raise TypeError(f"refusal_reasons got unknown settings {unknown}; it takes {', '.join(REFUSED_SETTINGS)}")
    reasons = []
    if head_size not in SUPPORTED_HEAD_SIZES:
        reasons.append(f"head_size {head_size}: FLASHJIT serves {', '.join(map(str, SUPPORTED_HEAD_SIZES))} (its "
                       "prefill rows run on vLLM's FlashAttention 3)")
    if _name(dtype) not in SUPPORTED_DTYPES:
        reasons.append(f"dtype {_name(dtype)}: FLASHJIT serves float16 and bfloat16 queries")
    if kv_cache_dtype is not None and kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        reasons.append(f"kv_cache_dtype {kv_cache_dtype!r}: FLASHJIT serves {', '.join(SUPPORTED_KV_CACHE_DTYPES)} "
                       "(fp8 in e4m3, which the prefill rows' FlashAttention 3 reads)")
    if block_size is not None and not 1 <= block_size <= MAX_BLOCK_SIZE:
        reasons.append(f"block_size {block_size}: FLASHJIT serves blocks of 1 to {MAX_BLOCK_SIZE} tokens")
    if capability is not None:
        cap = tuple(capability)
        if cap < MIN_CAPABILITY:
            reasons.append(f"compute capability {cap[0]}.{cap[1]}: FLASHJIT needs 8.0 or newer")
        if (kv_cache_dtype in SUPPORTED_KV_CACHE_DTYPES and kv_cache_dtype.startswith("fp8")
                and cap not in FP8_CAPABILITIES):
            reasons.append(f"kv_cache_dtype {kv_cache_dtype!r} on compute capability {cap[0]}.{cap[1]}: the prefill "
                           "rows' FlashAttention reads fp8 caches with FA3, on 9.0 only")
        if has_sink and cap < SINK_CAPABILITY:
            reasons.append(f"attention sinks on compute capability {cap[0]}.{cap[1]}: the prefill rows' "
                           "FlashAttention takes sinks on 9.0 and newer")
    if str(attn_type).lower().rpartition(".")[2] != "decoder":
        reasons.append(f"attention type {attn_type}: FLASHJIT serves decoder self-attention")
    reasons += [reason for setting, reason in REFUSED_SETTINGS.items() if switches.get(setting)]
    return reasons


MLA_HEAD_SIZE = 576  # kv_lora_rank 512 + rope 64
MLA_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")


def mla_refusal_reasons(*, head_size: int, dtype, kv_cache_dtype: str | None, block_size: int | None,
                        capability: tuple[int, int] | None, use_mla: bool, has_sink: bool = False,
                        has_sliding_window: bool = False, **others) -> list[str]:
    """FLASHJIT_MLA's reasons: the MLA shape flashjit's kernels take, and the settings FLASHJIT
    refuses for the same reasons (others: refusal_reasons' keywords)."""
    reasons = []
    if not use_mla:
        reasons.append("non-MLA attention: FLASHJIT_MLA serves MLA models (FLASHJIT serves the others)")
    if head_size != MLA_HEAD_SIZE:
        reasons.append(f"head_size {head_size}: FLASHJIT_MLA serves kv_lora_rank 512 + rope 64 = {MLA_HEAD_SIZE}")
    if kv_cache_dtype is not None and kv_cache_dtype not in MLA_KV_CACHE_DTYPES:
        reasons.append(f"kv_cache_dtype {kv_cache_dtype!r}: FLASHJIT_MLA serves {', '.join(MLA_KV_CACHE_DTYPES)}")
    if has_sink:
        reasons.append("attention sinks: FLASHJIT_MLA serves MLA without sinks")
    if has_sliding_window:
        reasons.append("sliding window: FLASHJIT_MLA serves full MLA attention")
    shared = refusal_reasons(head_size=SUPPORTED_HEAD_SIZES[0], dtype=dtype, kv_cache_dtype=None,
                             block_size=block_size, capability=capability, **others)
    return reasons + [reason for reason in shared if not reason.startswith("MLA")]
