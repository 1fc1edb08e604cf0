"""FLASHJIT against the real vLLM 0.33.0 code (installed with --no-deps in .venv-frameworks, on
the CPU): vLLM's plugin loader finds the entry point, its config accepts the name, the backend's
validate_configuration at compute capability 9.0 accepts what flashjit serves and gives one reason
per refused setting, and the metadata builder plans steps from CommonAttentionMetadata made the
way vLLM's attention tests make it (tests/v1/attention/utils.py: create_common_attn_metadata)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm")

from vllm.config import AttentionConfig, CompilationConfig, DeviceConfig, VllmConfig  # noqa: E402
from vllm.config.compilation import CUDAGraphMode  # noqa: E402
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

import flashjit.integrations.vllm as plugin  # noqa: E402
from flashjit.integrations.vllm.backend import FlashJITBackend  # noqa: E402
from flashjit.integrations.vllm.builder import FlashJITMetadataBuilder  # noqa: E402
from flashjit.integrations.vllm.impl import FlashJITImpl  # noqa: E402
from flashjit.kernels.worklist_kernel import LoadedKernel  # noqa: E402

H90 = DeviceCapability(9, 0)


@pytest.fixture(autouse=True)
def registered():
    assert plugin.register()


def test_vllm_loads_the_entry_point_and_registers_flashjit(monkeypatch):
    import vllm.plugins as plugins

    found = plugins.load_plugins_by_group(plugins.DEFAULT_PLUGINS_GROUP)
    assert found["flashjit"] is plugin.register
    monkeypatch.setattr(plugins, "plugins_loaded", False)
    plugins.load_general_plugins()  # runs every general plugin, flashjit's among them
    assert AttentionBackendEnum["FLASHJIT"].get_class() is FlashJITBackend


def test_registration_is_idempotent():
    before = list(AttentionBackendEnum.__members__)
    assert plugin.register() and plugin.register()
    assert list(AttentionBackendEnum.__members__) == before


def test_another_vllm_minor_is_refused_naming_both_versions(caplog):
    with pytest.raises(plugin.UnsupportedVLLMVersion, match=r"vLLM 0\.33\.x.*vLLM 0\.34\.1 is installed"):
        plugin.check_vllm_version("0.34.1")
    caplog.set_level(logging.ERROR, logger="flashjit")
    assert plugin.register("0.32.0") is False
    assert "0.33" in caplog.text and "0.32.0" in caplog.text
    assert plugin.check_vllm_version() == vllm.__version__


def test_attention_config_accepts_the_name():
    config = AttentionConfig(backend="FLASHJIT")
    assert config.backend is AttentionBackendEnum.FLASHJIT
    assert config.backend.get_class().get_name() == "FLASHJIT"
    assert FlashJITBackend.get_impl_cls() is FlashJITImpl
    assert FlashJITBackend.get_builder_cls() is FlashJITMetadataBuilder


# validate_configuration's settings that both backends serve, at compute capability 9.0.
SERVED = dict(dtype=torch.bfloat16, kv_cache_dtype="auto", has_sink=False, use_sparse=False, use_mm_prefix=False,
              use_per_head_quant_scales=False, device_capability=H90, attn_type="decoder")


def validate(**changes):
    return FlashJITBackend.validate_configuration(**{**SERVED, "head_size": 128, "block_size": 16, "use_mla": False,
                                                     **changes})


@pytest.mark.parametrize("changes", [
    {}, {"head_size": 64}, {"head_size": 96}, {"head_size": 256}, {"dtype": torch.float16},
    {"kv_cache_dtype": "fp8"}, {"kv_cache_dtype": "fp8_e4m3"}, {"kv_cache_dtype": "bfloat16"},
    {"block_size": 1}, {"block_size": 64}, {"block_size": 256}, {"block_size": None},
    {"has_sink": True}, {"has_sliding_window": True}, {"use_per_head_quant_scales": True},
    {"use_kv_connector": True}, {"device_capability": DeviceCapability(8, 0)},
    {"device_capability": DeviceCapability(10, 0)},
])
def test_supported_configurations_are_accepted(changes):
    assert validate(**changes) == []


@pytest.mark.parametrize("changes, reason", [
    ({"head_size": 80}, "head_size 80: FLASHJIT serves 64, 96, 128, 256"),
    ({"head_size": 512}, "head_size 512"),
    ({"dtype": torch.float32}, "dtype float32: FLASHJIT serves float16 and bfloat16"),
    ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype 'fp8_e5m2'"),
    ({"kv_cache_dtype": "nvfp4"}, "kv_cache_dtype 'nvfp4'"),
    ({"block_size": 512}, "block_size 512: FLASHJIT serves blocks of 1 to 256"),
    ({"use_mla": True}, "MLA"),
    ({"use_sparse": True}, "sparse attention"),
    ({"use_mm_prefix": True}, "multimodal prefix"),
    ({"attn_type": "encoder_only"}, "attention type encoder_only"),
    ({"use_non_causal": True}, "non-causal"),
    ({"use_rswa": True}, "R-SWA"),
    ({"use_batch_invariant": True}, "batch invariance"),
    ({"use_pcp": True}, "prefill context parallelism"),
    ({"use_dcp": True}, "decode context parallelism"),
    ({"use_adaptive_verification": True}, "adaptive speculative verification"),
    ({"device_capability": DeviceCapability(7, 5)}, "compute capability 7.5: FLASHJIT needs 8.0"),
    ({"kv_cache_dtype": "fp8", "device_capability": DeviceCapability(8, 9)},
     "kv_cache_dtype 'fp8' on compute capability 8.9"),
    ({"has_sink": True, "device_capability": DeviceCapability(8, 0)}, "attention sinks on compute capability 8.0"),
])
def test_each_refused_setting_has_its_own_reason(changes, reason):
    reasons = validate(**changes)
    assert len(reasons) == 1 and reasons[0].startswith(reason), reasons


def test_every_refused_setting_is_reported_at_once():
    assert len(validate(head_size=80, dtype=torch.float32, use_dcp=True)) == 3


def test_vllm_selects_flashjit_through_its_own_checks():
    assert FlashJITBackend.supports_head_size(128) and not FlashJITBackend.supports_head_size(80)
    assert FlashJITBackend.supports_block_size(256) and not FlashJITBackend.supports_block_size(272)
    assert FlashJITBackend.supports_kv_cache_dtype("fp8") and not FlashJITBackend.supports_kv_cache_dtype("fp8_e5m2")
    assert FlashJITBackend.supports_sink() and FlashJITBackend.supports_sliding_window()
    assert not FlashJITBackend.forward_includes_kv_cache_update


def test_every_kv_cache_layout_is_served_lbnhc_first():
    layouts = get_supported_kv_cache_layouts([FlashJITBackend])
    assert layouts[0] is KVCacheLayout.LBNHC and set(layouts) == set(KVCacheLayout)


# ---- the metadata builder, on CPU tensors ------------------------------------------------------

BLOCK_SIZE, KV_HEADS, HEAD_SIZE, HEADS = 16, 2, 64, 8


def fake_loaded(kernel, device_index) -> LoadedKernel:
    return LoadedKernel(None, 0xD0, 0xE0, 2, 132, decode_packed=0xD1 if kernel.tiling.packed_entry else None)


class Layer(AttentionLayerBase):
    """A model layer as vLLM's builders find it: in static_forward_context, with its impl."""

    def __init__(self, impl):
        super().__init__()
        self.impl = impl

    def get_attn_backend(self):
        return FlashJITBackend

    def get_kv_cache_spec(self, vllm_config):
        return None


def make_config(cudagraph_mode="FULL_AND_PIECEWISE", capture_sizes=(1, 2, 4, 8, 16, 32)):
    compilation = CompilationConfig(cudagraph_mode=cudagraph_mode, cudagraph_capture_sizes=list(capture_sizes))
    config = VllmConfig(device_config=DeviceConfig(device="cpu"), compilation_config=compilation)
    # On the CPU vLLM turns graphs off; a GPU config keeps what was asked, as here.
    config.compilation_config.cudagraph_mode = CUDAGraphMode[cudagraph_mode]
    config.compilation_config.max_cudagraph_capture_size = max(capture_sizes)
    return config


def add_layers(config, names, **impl_args):
    for name in names:
        impl = FlashJITImpl(HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, KV_HEADS, None, impl_args.get("sliding_window"),
                            impl_args.get("kv_cache_dtype", "auto"), impl_args.get("logits_soft_cap"))
        config.compilation_config.static_forward_context[name] = Layer(impl)


@pytest.fixture
def builder_for(monkeypatch, engine, fake_nvrtc):
    monkeypatch.setattr(FlashJITMetadataBuilder, "decoder_options",
                        dict(arch="sm_90", load_kernel=fake_loaded, engine=engine))

    def make(config, names=("model.layers.0.attn", "model.layers.1.attn"), **impl_args):
        add_layers(config, names, **impl_args)
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                                 dtype=torch.bfloat16)
        return FlashJITMetadataBuilder(spec, list(names), config, torch.device("cpu"))
    return make


def common_attn_metadata(seq_lens, query_lens, *, num_blocks=1000, seed=0) -> CommonAttentionMetadata:
    """Step metadata built the way vLLM's attention tests build it: cumulative query starts, key
    counts, a random block table (block 0 stays vLLM's null block) and slot mapping."""
    g = torch.Generator().manual_seed(seed)
    query_start_loc = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    max_blocks = max(seq_lens) // BLOCK_SIZE + 1
    block_table = torch.randint(1, num_blocks, (len(seq_lens), max_blocks), dtype=torch.int32, generator=g)
    tokens = int(sum(query_lens))
    slot_mapping = torch.randint(BLOCK_SIZE, num_blocks * BLOCK_SIZE, (tokens,), dtype=torch.int64, generator=g)
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc, query_start_loc_cpu=query_start_loc.clone(), seq_lens=seq,
        num_reqs=len(seq_lens), num_actual_tokens=tokens, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=block_table, slot_mapping=slot_mapping, seq_lens_cpu_upper_bound=seq.clone())


def test_builder_declares_uniform_batch_graphs_and_reorders_short_rows_first(builder_for):
    config = make_config()
    builder = builder_for(config)
    assert builder.get_cudagraph_support(config, None) is AttentionCGSupport.UNIFORM_BATCH
    assert builder.get_varlen_cudagraph_max_query_len(config, None) == 1
    assert builder.reorder_batch_threshold == 1
    assert len(builder.planner.forms) == 1  # both layers share one form


def test_builder_prewarms_its_forms_kernels(builder_for, fake_nvrtc):
    builder_for(make_config(), sliding_window=128)
    assert len(fake_nvrtc) == 1 and "sliding_window" in fake_nvrtc[0]  # q1 with a window: no shared-prefix kernel


@pytest.mark.parametrize("flag, fp8_queries", [("", True), ("0", False)])
def test_layers_over_an_fp8_cache_ask_vllm_for_e4m3_queries(builder_for, fake_nvrtc, monkeypatch, flag, fp8_queries):
    """vLLM's Attention quantizes the queries of an impl that says supports_quant_query_input (as
    for FlashAttention); FLASHJIT_VLLM_FP8_QUERIES=0 keeps them 16-bit. The builder prewarms to match."""
    monkeypatch.setenv("FLASHJIT_VLLM_FP8_QUERIES", flag)
    impl = FlashJITImpl(HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, KV_HEADS, None, None, "fp8")
    assert impl.supports_quant_query_input is fp8_queries
    assert not FlashJITImpl(HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, KV_HEADS, None, None, "auto").supports_quant_query_input
    builder_for(make_config(), kv_cache_dtype="fp8")
    assert fake_nvrtc and all(name.endswith("_fp8q") is fp8_queries for name in fake_nvrtc)


@pytest.mark.parametrize("seq_lens, query_lens, decodes", [
    ([32, 40, 1024, 512], [1, 1, 1, 1], 4),                    # small decode
    ([2048] * 8, [1] * 8, 8),                                   # medium decode
    ([32, 40, 1024, 512], [1, 1, 8, 5], 2),                     # mixed small: short prefills after the decodes
    ([2048, 4096, 1000, 300], [1, 1, 512, 256], 2),             # mixed medium
    ([8192], [1], 1),                                           # single long decode
])
def test_builder_plans_batch_specs(builder_for, seq_lens, query_lens, decodes):
    builder = builder_for(make_config("PIECEWISE"))
    m = common_attn_metadata(seq_lens, query_lens)
    meta = builder.build(0, m)
    step = meta.step
    assert step.rows.num_decodes == decodes and step.graph_tokens is None
    decoder = next(iter(step.decoders.values()))
    assert decoder.batch_size == decodes and decoder.num_tokens == sum(query_lens[:decodes])
    planned = decoder.current_plan.tables
    assert planned.num_page_ids == sum(-(-s // BLOCK_SIZE) for s in seq_lens[:decodes])
    if decodes < len(seq_lens):
        p = step.prefill
        assert p.first_row == decodes and p.token_begin == sum(query_lens[:decodes])
        assert p.cu_seqlens_q.tolist() == np.concatenate([[0], np.cumsum(query_lens[decodes:])]).tolist()
        assert torch.equal(p.block_table, m.block_table_tensor[decodes:])
    else:
        assert step.prefill is None
    assert meta.num_actual_tokens == sum(query_lens) and meta.slot_mapping is m.slot_mapping


def test_builder_plans_speculative_rows_on_flashjit(builder_for, monkeypatch):
    monkeypatch.setenv("FLASHJIT_VLLM_DECODE_Q_LEN", "4")
    builder = builder_for(make_config("PIECEWISE"))
    assert builder.reorder_batch_threshold == 4
    step = builder.build(0, common_attn_metadata([100, 200, 300, 700], [4, 4, 3, 100])).step
    assert step.rows.num_decodes == 3 and next(iter(step.decoders.values())).spec.max_q_len == 4
    monkeypatch.setenv("FLASHJIT_VLLM_DECODE_Q_LEN", "17")  # not a count the kernels take: the default, warned
    assert builder_for(make_config("PIECEWISE"), names=("model.layers.9.attn",)).reorder_batch_threshold == 1


def test_full_graph_decode_steps_plan_the_graph_decoder_of_their_captured_size(builder_for):
    builder = builder_for(make_config())
    step = builder.build(0, common_attn_metadata([100, 200, 300], [1, 1, 1])).step
    assert step.graph_tokens == 4  # the smallest capture size holding 3 tokens
    form = next(iter(builder.planner.forms))
    assert step.decoders[form] is builder.planner.forms[form].graphs[4]
    mixed = builder.build(0, common_attn_metadata([100, 200, 3000], [1, 1, 600])).step
    assert mixed.graph_tokens is None and mixed.decoders[form] is builder.planner.forms[form].eager


def test_builder_refuses_non_causal_steps(builder_for):
    builder = builder_for(make_config("PIECEWISE"))
    m = common_attn_metadata([100], [1])
    m.causal = False
    with pytest.raises(NotImplementedError, match="causal"):
        builder.build(0, m)


def test_impl_refuses_alibi_naming_it():
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        FlashJITImpl(HEADS, HEAD_SIZE, 0.125, KV_HEADS, [0.5] * HEADS, None, "auto")


# ---- the impl, on CPU tensors: the cache writer and a prefill-only forward ---------------------

def scales(k=1.0, v=1.0):
    from types import SimpleNamespace

    return SimpleNamespace(_q_scale=torch.tensor([1.0]), _q_scale_float=1.0, _k_scale=torch.tensor([k]), _v_scale=torch.tensor([v]))


def test_the_query_scale_is_the_host_float_or_the_per_kv_head_tensor():
    from flashjit.integrations.vllm.impl import query_scale

    assert query_scale(scales()) == 1.0 and not torch.is_tensor(query_scale(scales()))
    per_head = scales()
    per_head._q_scale, per_head._q_scale_float = torch.tensor([0.5, 2.0]), 2.0  # vLLM keeps the largest as the float
    assert query_scale(per_head) is per_head._q_scale


def vllm_kv_cache(num_blocks, dtype=torch.bfloat16):
    """A layer's cache as vLLM 0.33 binds it in its default LBNHC layout: storage [blocks, block, kv heads,
    2 * head] seen as [blocks, kv heads, block, 2 * head]."""
    return torch.zeros(num_blocks, BLOCK_SIZE, KV_HEADS, 2 * HEAD_SIZE, dtype=dtype).permute(0, 2, 1, 3)


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_do_kv_cache_update_writes_k_and_v_side_by_side(cache_dtype):
    impl = FlashJITImpl(HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, KV_HEADS, None, None, cache_dtype)
    kv_cache = vllm_kv_cache(8, torch.uint8 if cache_dtype == "fp8" else torch.bfloat16)
    key, value = torch.randn(3, KV_HEADS, HEAD_SIZE).bfloat16(), torch.randn(3, KV_HEADS, HEAD_SIZE).bfloat16()
    impl.do_kv_cache_update(scales(0.5, 0.25), key, value, kv_cache, torch.tensor([17, 18, 100]))
    stored = kv_cache.permute(0, 2, 1, 3)  # [blocks, block, kv heads, 2 * head]
    if cache_dtype == "fp8":
        stored = stored.view(torch.float8_e4m3fn).float() * torch.cat([torch.full((HEAD_SIZE,), 0.5),
                                                                       torch.full((HEAD_SIZE,), 0.25)])
    tol = dict(rtol=0.07, atol=0.02) if cache_dtype == "fp8" else dict(rtol=0, atol=0)
    for token, slot in enumerate([17, 18, 100]):
        block, offset = divmod(slot, BLOCK_SIZE)
        assert torch.allclose(stored[block, offset, :, :HEAD_SIZE].float(), key[token].float(), **tol)
        assert torch.allclose(stored[block, offset, :, HEAD_SIZE:].float(), value[token].float(), **tol)


def test_profiling_forward_without_metadata_gives_zeros():
    impl = FlashJITImpl(HEADS, HEAD_SIZE, 0.125, KV_HEADS, None, None, "auto")
    out = torch.ones(4, HEADS, HEAD_SIZE)
    assert not impl.forward(scales(), out, None, None, vllm_kv_cache(2), None, out).any()


def test_prefill_only_forward_matches_dense_causal_attention(builder_for):
    from flashjit.integrations.core import ReferencePrefill

    builder = builder_for(make_config("PIECEWISE"))
    impl = FlashJITImpl(HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, KV_HEADS, None, None, "auto")
    m = common_attn_metadata([40], [40], num_blocks=8)
    m.block_table_tensor = torch.tensor([[5, 2, 7]], dtype=torch.int32)  # distinct blocks: no slot is written twice
    meta = builder.build(0, m)
    assert meta.step.rows.num_decodes == 0 and not meta.step.decoders
    kv_cache = vllm_kv_cache(8)
    q = torch.randn(40, HEADS, HEAD_SIZE).bfloat16()
    k, v = torch.randn(40, KV_HEADS, HEAD_SIZE).bfloat16(), torch.randn(40, KV_HEADS, HEAD_SIZE).bfloat16()
    slots = (m.block_table_tensor[0, torch.arange(40) // BLOCK_SIZE].long() * BLOCK_SIZE
             + torch.arange(40) % BLOCK_SIZE)
    impl.do_kv_cache_update(scales(), k, v, kv_cache, slots)
    impl.layer_attention(BLOCK_SIZE, q.dtype).prefill = ReferencePrefill()  # vllm_flash_attn needs a GPU
    out = impl.forward(scales(), q, k, v, kv_cache, meta, torch.zeros_like(q))
    group = HEADS // KV_HEADS
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float().repeat_interleave(group, 1)) * HEAD_SIZE ** -0.5
    scores = scores.masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float().repeat_interleave(group, 1))
    assert torch.allclose(out.float(), want, atol=2e-2)


def test_builder_under_no_compile_needs_its_kernels_cached(monkeypatch, tmp_path, fake_nvrtc):
    import flashjit
    from flashjit.errors import KernelNotPrewarmed

    def build(engine):
        monkeypatch.setattr(FlashJITMetadataBuilder, "decoder_options",
                            dict(arch="sm_90", load_kernel=fake_loaded, engine=engine))
        config = make_config("PIECEWISE")
        add_layers(config, ["model.layers.0.attn"])
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                                 dtype=torch.bfloat16)
        return FlashJITMetadataBuilder(spec, ["model.layers.0.attn"], config, torch.device("cpu"))

    monkeypatch.setenv("FLASHJIT_NO_COMPILE", "1")
    with pytest.raises(KernelNotPrewarmed, match="decode_d64_bf16_kvbf16_causal_p16_g4_q1"):
        build(flashjit.Engine(cache_dir=tmp_path))
    assert not fake_nvrtc
    build(flashjit.Engine(cache_dir=tmp_path, allow_compile=True))  # a deploy step fills the cache
    compiled = len(fake_nvrtc)
    build(flashjit.Engine(cache_dir=tmp_path))  # FLASHJIT_NO_COMPILE=1: every kernel from the cache
    assert compiled == 2 and len(fake_nvrtc) == compiled


# ---- FLASHJIT_MLA -----------------------------------------------------------------------------

def test_mla_backend_is_registered_and_selectable():
    from flashjit.integrations.vllm.mla import FlashJITMLABackend, FlashJITMLAImpl, FlashJITMLAMetadataBuilder

    config = AttentionConfig(backend="FLASHJIT_MLA")
    assert config.backend.get_class() is FlashJITMLABackend and FlashJITMLABackend.is_mla()
    assert FlashJITMLABackend.get_impl_cls() is FlashJITMLAImpl
    assert FlashJITMLABackend.get_builder_cls() is FlashJITMLAMetadataBuilder
    assert FlashJITMLAMetadataBuilder.get_cudagraph_support(None, None) is AttentionCGSupport.UNIFORM_BATCH


def validate_mla(**changes):
    from flashjit.integrations.vllm.mla import FlashJITMLABackend

    return FlashJITMLABackend.validate_configuration(**{**SERVED, "head_size": 576, "block_size": 64, "use_mla": True,
                                                        **changes})


@pytest.mark.parametrize("changes", [{}, {"kv_cache_dtype": "fp8"}, {"kv_cache_dtype": "fp8_e5m2"},
                                     {"block_size": 1}, {"block_size": 256}, {"dtype": torch.float16}])
def test_mla_configurations_are_accepted(changes):
    assert validate_mla(**changes) == []


@pytest.mark.parametrize("changes, reason", [
    ({"use_mla": False, "head_size": 128}, "non-MLA attention"),
    ({"head_size": 320}, "head_size 320: FLASHJIT_MLA serves kv_lora_rank 512 + rope 64 = 576"),
    ({"use_sparse": True}, "sparse attention"),
    ({"has_sink": True}, "attention sinks"),
    ({"block_size": 512}, "block_size 512"),
    ({"use_dcp": True}, "decode context parallelism"),
    ({"use_per_head_quant_scales": True}, "per-head quant scales"),
])
def test_mla_refusals_name_the_setting(changes, reason):
    reasons = validate_mla(**changes)
    assert any(r.startswith(reason) for r in reasons), reasons
