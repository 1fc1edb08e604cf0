"""FlashJITAttnBackend over real SGLang 0.5.23 objects on the CPU: a model runner holding SGLang's
own ReqToTokenPool, MHATokenToKVPool and RadixAttention layers. The backend is built, checked and
planned as SGLang drives it (eager steps, then its CUDA-graph contract: init_cuda_graph_state,
init_forward_metadata_out_graph before each capture and replay), and each plan's page table is
compared with one read off req_to_token by a plain loop. Kernels compile with a fake NVRTC and
never launch: the GPU tests run them."""

from __future__ import annotations

import random
import re
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.layers.radix_attention import AttentionType, RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from flashjit.integrations.sglang import LayerForm  # noqa: E402
from flashjit.integrations.sglang.backend import FlashJITAttnBackend  # noqa: E402
from flashjit.jit.engine import Engine  # noqa: E402
from flashjit.kernels.worklist_kernel import LoadedKernel  # noqa: E402
from flashjit.serving.batch_decode import BatchDecode  # noqa: E402

CONTEXT, SLOTS = 256, 8


def cpu_decoder(engine, device, **options):
    """A BatchDecode on the CPU as an H200 would size its plans (nothing is loaded)."""
    return BatchDecode(engine, device, arch="sm_90", load_kernel=lambda kernel, index: LoadedKernel(
        None, 0xD0, 0xE0, 2, 132), **options)


def layers(count=2, heads=8, kv_heads=2, dim=128, **options):
    return torch.nn.ModuleList(RadixAttention(heads, dim, dim ** -0.5, kv_heads, layer_id=i, **options)
                               for i in range(count))


def model_runner(page_size=1, kv_dtype=torch.bfloat16, model=None, pool_size=1024, **changes):
    """What the backend reads of SGLang's ModelRunner, with SGLang's own pools and layers."""
    model = layers() if model is None else model
    first = next((m for m in model.modules() if isinstance(m, RadixAttention)), None)
    kv_heads, dim = (2, 128) if first is None else (first.tp_k_head_num, first.qk_head_dim)
    pool = MHATokenToKVPool(size=pool_size, page_size=page_size, dtype=kv_dtype, head_num=kv_heads, head_dim=dim,
                            layer_num=len(model), device="cpu", enable_memory_saver=False)
    runner = SimpleNamespace(
        device="cpu", dtype=torch.bfloat16, page_size=page_size, model=model, token_to_kv_pool=pool,
        req_to_token_pool=ReqToTokenPool(size=SLOTS, max_context_len=CONTEXT, device="cpu", enable_memory_saver=False),
        model_config=SimpleNamespace(context_len=CONTEXT, is_encoder_decoder=False), use_mla_backend=False,
        spec_algorithm=SpeculativeAlgorithm.NONE, prefill_attention_backend_str="fa3",
        decode_attention_backend_str="flashjit", server_args=SimpleNamespace(dcp_size=1))
    for name, value in changes.items():
        setattr(runner, name, value)
    return runner


@pytest.fixture
def engine(tmp_path, fake_nvrtc):
    return Engine(cache_dir=tmp_path / "cache")


def backend_for(runner, engine):
    return FlashJITAttnBackend(runner, decoder_options=dict(engine=engine, make_decoder=cpu_decoder, arch="sm_90"))


def admit(runner, seq_lens, seed=0):
    """Requests admitted as SGLang's scheduler leaves them: a request slot each (slot 0 is the
    padding row) and page-aligned runs of pool slots in req_to_token (slot 0's page is the
    padding page). Returns (req_pool_indices, each request's page ids: the reference)."""
    rng = random.Random(seed)
    page_size = runner.page_size
    pages_free = list(range(1, runner.token_to_kv_pool.size // page_size))
    rng.shuffle(pages_free)
    slots = rng.sample(range(1, SLOTS + 1), len(seq_lens))
    reference = []
    for slot, n in zip(slots, seq_lens):
        pages = [pages_free.pop() for _ in range(-(-n // page_size))]
        tokens = [p * page_size + i for p in pages for i in range(page_size)][:n]
        runner.req_to_token_pool.write((slot, slice(0, n)), torch.tensor(tokens, dtype=torch.int32))
        reference.append(pages)
    return torch.tensor(slots, dtype=torch.int64), reference


def decode_batch(req_pool_indices, seq_lens, mode=ForwardMode.DECODE):
    """The fields of a decode ForwardBatch the backend reads (SGLang's replay view has these too)."""
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    return SimpleNamespace(forward_mode=mode, batch_size=len(seq_lens), req_pool_indices=req_pool_indices,
                           seq_lens=lens, seq_lens_cpu=lens.clone())


def planned_table(step, form):
    bd = step.decoders[form]
    tables = bd.current_plan.tables
    ids = bd.current_plan.page_ids[: step.table.num_page_ids].tolist()
    return list(tables.kv_lens), ids


# ---- construction -----------------------------------------------------------------------------

def test_the_backend_serves_each_layers_form_and_prewarms_its_kernels(engine, fake_nvrtc):
    model = torch.nn.ModuleList([*layers(2), RadixAttention(8, 128, 0.1, 2, layer_id=2, logit_cap=30.0,
                                                            sliding_window_size=511)])
    backend = backend_for(model_runner(page_size=16, model=model), engine)
    full, capped = LayerForm(sm_scale=128 ** -0.5), LayerForm(sm_scale=0.1, window_left=511, logit_cap=30.0)
    assert backend._form_of_layer == {0: full, 1: full, 2: capped}
    shape = backend.decoder.shape
    assert (shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, shape.page_size, shape.kv_layout) == \
        (8, 2, 128, 16, "NHD")
    assert sorted(fake_nvrtc) == sorted(spec.name for spec in backend.decoder.specs())
    assert {s.mask for s in backend.decoder.specs()} == {"none", "sliding_window"}


@pytest.mark.parametrize("change, reason", [
    (dict(prefill_attention_backend_str="flashjit"), "--prefill-attention-backend .* is flashjit"),
    (dict(spec_algorithm=SpeculativeAlgorithm.EAGLE), "--speculative-algorithm EAGLE"),
    (dict(use_mla_backend=True), "multi-head latent attention"),
    (dict(server_args=SimpleNamespace(dcp_size=2)), "--dcp-size 2"),
    (dict(dtype=torch.float32), "--dtype float32: accepted bfloat16, float16"),
    (dict(kv_index_translator=SimpleNamespace(is_translating=True)), "req_to_token holds virtual KV ids"),
    (dict(model=layers(dim=80)), "layer\\(s\\) 0, 1: head_dim 80: accepted 64, 96, 128, 256, 512"),
    (dict(model=layers(heads=8, kv_heads=3)), "8 query heads over 3 KV heads"),
    (dict(model=layers(attn_type=AttentionType.ENCODER_ONLY)), "attention type encoder_only"),
    (dict(model=layers(v_head_dim=64)), "value head_dim 64 unlike the key's 128"),
    (dict(model=torch.nn.ModuleList([torch.nn.Linear(2, 2)])), "no RadixAttention layer"),
])
def test_a_configuration_it_cannot_serve_is_refused_naming_the_setting(engine, change, reason):
    change = dict(change)
    runner = model_runner(model=change.pop("model", None))
    for name, value in change.items():
        setattr(runner, name, value)
    with pytest.raises(ValueError, match="cannot serve this configuration:\n") as refused:
        backend_for(runner, engine)
    assert re.search(reason, str(refused.value)), str(refused.value)


def test_pools_it_does_not_read_are_refused_by_class_and_layout(engine, monkeypatch):
    runner = model_runner()

    class SWAKVPool(MHATokenToKVPool):
        pass

    runner.token_to_kv_pool.__class__ = SWAKVPool
    with pytest.raises(ValueError, match="KV pool SWAKVPool: flashjit reads MHATokenToKVPool"):
        backend_for(runner, engine)
    runner = model_runner()
    runner.token_to_kv_pool.kv_cache_layout = "vectorized_5d"
    with pytest.raises(ValueError, match="KV pool layout 'vectorized_5d': accepted nhd, hnd"):
        backend_for(runner, engine)


def test_every_refused_setting_is_listed_at_once(engine):
    runner = model_runner(model=layers(dim=80), dtype=torch.float32, prefill_attention_backend_str="flashjit")
    with pytest.raises(ValueError) as refused:
        backend_for(runner, engine)
    assert str(refused.value).count("\n  - ") == 3


# ---- eager steps --------------------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 16])
def test_an_eager_decode_step_plans_the_pages_req_to_token_lists(engine, page_size):
    runner = model_runner(page_size=page_size)
    backend = backend_for(runner, engine)
    seq_lens = [1, 40, 17, 100]
    slots, reference = admit(runner, seq_lens)
    backend.init_forward_metadata(decode_batch(slots, seq_lens))
    step = backend.forward_metadata
    assert not step.graph
    kv_lens, ids = planned_table(step, LayerForm(sm_scale=128 ** -0.5))
    assert kv_lens == seq_lens and ids == sum(reference, [])
    assert step.decoders[LayerForm(sm_scale=128 ** -0.5)].spec.page_size == page_size


def test_an_hnd_pool_is_read_page_major(engine, monkeypatch):
    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")
    runner = model_runner(page_size=16)
    assert runner.token_to_kv_pool.kv_cache_layout == "hnd"
    backend = backend_for(runner, engine)
    assert backend.decoder.shape.kv_layout == "HND"
    slots, reference = admit(runner, [33, 5])
    backend.init_forward_metadata(decode_batch(slots, [33, 5]))
    assert planned_table(backend.forward_metadata, LayerForm(sm_scale=128 ** -0.5))[1] == sum(reference, [])


def test_an_fp8_pool_plans_the_fp8_kernel(engine):
    backend = backend_for(model_runner(kv_dtype=torch.float8_e4m3fn), engine)
    assert {s.kv_dtype for s in backend.decoder.specs()} == {"float8_e4m3fn"}


def test_idle_steps_plan_nothing_and_other_modes_are_refused(engine):
    runner = model_runner()
    backend = backend_for(runner, engine)
    backend.init_forward_metadata(decode_batch(torch.zeros(0, dtype=torch.int64), [], mode=ForwardMode.IDLE))
    assert backend.forward_metadata is None
    slots, _ = admit(runner, [4])
    with pytest.raises(RuntimeError, match="plans decode batches, not TARGET_VERIFY"):
        backend.init_forward_metadata(decode_batch(slots, [4], mode=ForwardMode.TARGET_VERIFY))
    with pytest.raises(RuntimeError, match="serves decode batches, not EXTEND ones: .*--prefill-attention-backend fa3"):
        backend.forward_extend(None, None, None, runner.model[0], SimpleNamespace(forward_mode=ForwardMode.EXTEND))
    with pytest.raises(ValueError, match="takes q, k, v alone; got sinks"):
        backend.forward_decode(None, None, None, runner.model[0], None, sinks=torch.zeros(8))


# ---- SGLang's CUDA-graph contract -------------------------------------------------------------------

def test_capture_and_replays_plan_each_padded_batch_into_the_graph_decoders(engine):
    runner = model_runner(page_size=16)
    backend = backend_for(runner, engine)
    max_bs = 8
    backend.init_cuda_graph_state(max_bs, max_bs)
    form = LayerForm(sm_scale=128 ** -0.5)
    ids_buffer = backend.decoder.graph_page_ids
    assert ids_buffer.numel() == max_bs * CONTEXT // 16  # every request of the captured size at full context
    # SGLang captures graph sizes largest first, over padding rows (slot 0, seq_len the fill value).
    for bs in (8, 4):
        padding = decode_batch(torch.zeros(bs, dtype=torch.int64), [backend.get_cuda_graph_seq_len_fill_value()] * bs)
        backend.init_forward_metadata_out_graph(padding, in_capture=True)
        step = backend.forward_metadata
        assert step.graph and step.decoders[form].batch_size == bs and step.decoders[form].use_cuda_graph
    # Replays: new compositions padded to the graph's size, planned outside the graph each time.
    for seed, seq_lens in enumerate(([100, 3, 64], [256, 256, 1, 9, 77], [5])):
        slots, reference = admit(runner, seq_lens, seed=seed)
        bs = 4 if len(seq_lens) <= 4 else 8
        pad = bs - len(seq_lens)
        view = decode_batch(torch.cat([slots, torch.zeros(pad, dtype=torch.int64)]), seq_lens + [1] * pad)
        backend.init_forward_metadata_out_graph(view)
        kv_lens, ids = planned_table(backend.forward_metadata, form)
        padding_ids = [runner.req_to_token_pool.req_to_token[0, 0].item() // 16] * pad
        assert kv_lens == seq_lens + [1] * pad and ids == sum(reference, []) + padding_ids
        assert backend.forward_metadata.decoders[form].current_plan.page_ids is ids_buffer
    backend.init_forward_metadata_in_graph(view)  # nothing to record: the plan is made outside the graph


# ---- forward_decode, with a float32 stand-in for the kernels ------------------------------------

class ReferenceDecoder:
    """BatchDecode's plan()/run() computed by flashjit.serving.reference (the kernels cannot run on
    the CPU): what forward_decode hands the decoder is then checked by its result."""

    def __init__(self, engine, device, use_cuda_graph=False, page_ids_buffer=None, **options):
        self.use_cuda_graph = use_cuda_graph

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *, mask,
             window_left, sm_scale, logits_soft_cap, kv_layout, **options):
        self.batch_size = indptr.numel() - 1
        self.table = (indptr, indices[: int(indptr[-1])].clone(), last_page_len)
        self.options = dict(mask=mask, mask_params=None if window_left is None else {"window_left": window_left},
                            sm_scale=sm_scale, kv_layout=kv_layout,
                            variant="none" if logits_soft_cap is None else "soft_cap",
                            variant_params=None if logits_soft_cap is None else {"logits_soft_cap": logits_soft_cap})

    def run(self, q, kv_cache, *, out=None, k_scale=None, v_scale=None):
        k, v = (c.float() * (1.0 if s is None else s) for c, s in zip(kv_cache, (k_scale, v_scale)))
        from flashjit.serving.reference import decode_reference

        result, _ = decode_reference(q, k, v, *self.table, **self.options)
        return result.to(q.dtype)


def attention_by_hand(q, keys, values, scale, window=None, cap=None):
    """One decode query [heads, dim] over a request's keys and values [n, kv_heads, dim], in float32."""
    group = q.shape[0] // keys.shape[1]
    k, v = keys.float().repeat_interleave(group, 1), values.float().repeat_interleave(group, 1)
    scores = torch.einsum("hd,nhd->hn", q.float(), k) * scale
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    if window is not None:
        scores[:, : max(0, keys.shape[0] - 1 - window)] = float("-inf")
    return torch.einsum("hn,nhd->hd", scores.softmax(-1), v)


@pytest.mark.parametrize("page_size, kv_dtype, scale", [(1, torch.bfloat16, None), (16, torch.bfloat16, None),
                                                        (16, torch.float8_e4m3fn, 0.05)])
def test_forward_decode_writes_the_new_tokens_and_attends_over_the_pool(engine, page_size, kv_dtype, scale):
    model = torch.nn.ModuleList([RadixAttention(8, 128, 128 ** -0.5, 2, layer_id=0),
                                 RadixAttention(8, 128, 128 ** -0.5, 2, layer_id=1, logit_cap=20.0,
                                                sliding_window_size=40)])
    runner = model_runner(page_size=page_size, kv_dtype=kv_dtype, model=model)
    pool = runner.token_to_kv_pool
    gen = torch.Generator().manual_seed(0)
    for layer in model:
        layer.k_scale = layer.v_scale = None if scale is None else torch.tensor(scale)
        layer.k_scale_float = layer.v_scale_float = scale
        for buffer in (pool.k_buffer[layer.layer_id], pool.v_buffer[layer.layer_id]):  # the cached prefixes
            values = torch.randn(buffer.shape, generator=gen) / (1.0 if scale is None else scale)
            buffer.copy_(values.to(kv_dtype).view(buffer.dtype))
    backend = FlashJITAttnBackend(runner, decoder_options=dict(engine=engine, make_decoder=ReferenceDecoder,
                                                               arch="sm_90"))
    seq_lens = [1, 70, 16, 33]
    slots, _ = admit(runner, seq_lens)
    rows = runner.req_to_token_pool.req_to_token
    batch = decode_batch(slots, seq_lens)
    batch.out_cache_loc = torch.tensor([int(rows[s, n - 1]) for s, n in zip(slots.tolist(), seq_lens)])
    batch.out_cache_loc_is_physical = False
    backend.init_forward_metadata(batch)
    for layer in model:
        q = torch.randn(4, 8 * 128, generator=gen).bfloat16()
        k, v = torch.randn(4, 2, 128, generator=gen).bfloat16(), torch.randn(4, 2, 128, generator=gen).bfloat16()
        out = backend.forward_decode(q, k.clone(), v.clone(), layer, batch)
        assert out.shape == (4, 8 * 128) and out.dtype == torch.bfloat16
        keys = pool.get_key_buffer(layer.layer_id).float() * (1.0 if scale is None else scale)
        values = pool.get_value_buffer(layer.layer_id).float() * (1.0 if scale is None else scale)
        for i, (slot, n) in enumerate(zip(slots.tolist(), seq_lens)):
            tokens = rows[slot, :n].long()
            # the new token's key, where out_cache_loc points (to fp8's rounding: 3 mantissa bits)
            tolerance = dict(rtol=0, atol=0) if scale is None else dict(rtol=2 ** -4, atol=scale * 2 ** -9)
            assert torch.allclose(keys[tokens[-1]], k[i].float(), **tolerance)
            expected = attention_by_hand(q[i].view(8, 128), keys[tokens], values[tokens], layer.scaling,
                                         window=None if layer.sliding_window_size < 0 else layer.sliding_window_size,
                                         cap=layer.logit_cap or None)
            got = out[i].view(8, 128).float()
            assert (got - expected).norm() / expected.norm() < 1e-2, f"layer {layer.layer_id}, request {i}"
