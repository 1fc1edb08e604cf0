"""flashjit.integrations.sglang's framework-free core on the CPU: page tables from SGLang's
req_to_token metadata against a plain reference, the pool's buffers as paged caches, KV writes,
plans for every layer form (eager and CUDA-graph capacity) and prewarming. SGLang itself is not
imported: tensors are shaped as its ReqToTokenPool and MHATokenToKVPool build them."""

from __future__ import annotations

import random

import pytest
import torch

from flashjit.errors import KernelNotPrewarmed
from flashjit.integrations.sglang import (AttentionShape, LayerForm, PoolDecoder, host_table, page_ids, paged_kv,
                                          write_kv)
from flashjit.jit.engine import Engine
from flashjit.kernels.worklist_kernel import LoadedKernel
from flashjit.serving.batch_decode import BatchDecode

CPU = torch.device("cpu")


class SGLangStep:
    """A step as SGLang holds it: req_to_token [slots, context] of pool slots, the step's request
    slots and lengths. Pages of page_size consecutive, page-aligned slots are handed out at random;
    slot 0's page stays free (SGLang's padding page)."""

    def __init__(self, seq_lens, page_size=1, slots=8, context=300, pool_pages=600, seed=0):
        rng = random.Random(seed)
        self.page_size, self.seq_lens = page_size, list(seq_lens)
        free = list(range(1, pool_pages))
        rng.shuffle(free)
        self.req_to_token = torch.zeros(slots, context, dtype=torch.int32)
        self.req_pool_indices = torch.tensor(rng.sample(range(slots), len(seq_lens)), dtype=torch.int64)
        self.pages = []  # the reference: each request's page ids, in order
        for slot, n in zip(self.req_pool_indices.tolist(), seq_lens):
            pages = [free.pop() for _ in range(-(-n // page_size))]
            self.pages.append(pages)
            tokens = [p * page_size + i for p in pages for i in range(page_size)][:n]
            self.req_to_token[slot, :n] = torch.tensor(tokens, dtype=torch.int32)

    @property
    def seq_lens_tensor(self):
        return torch.tensor(self.seq_lens, dtype=torch.int64)


def reference_table(seq_lens, page_size):
    indptr, last = [0], []
    for n in seq_lens:
        pages = -(-n // page_size)
        indptr.append(indptr[-1] + pages)
        last.append(n - (pages - 1) * page_size if pages else 0)
    return indptr, last


# ---- page tables ------------------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 16])
def test_the_page_table_lists_each_requests_pages_from_req_to_token(page_size):
    seq_lens = [1, 17, 0, 64, 33, 5]
    step = SGLangStep(seq_lens, page_size)
    table = host_table(step.seq_lens_tensor, page_size)
    indptr, last = reference_table(seq_lens, page_size)
    assert table.indptr.tolist() == indptr and table.last_page_len.tolist() == last
    assert table.indptr.dtype == table.last_page_len.dtype == torch.int32 and table.indptr.is_contiguous()
    assert table.qo_indptr is None and table.max_q_len == 1 and table.batch == 6
    ids = page_ids(step.req_to_token, step.req_pool_indices, step.seq_lens_tensor, page_size, table.num_page_ids)
    assert ids.dtype == torch.int32 and ids.tolist() == sum(step.pages, [])


def test_multi_token_rows_get_their_query_offsets():
    table = host_table([10, 3, 7], 4, q_lens=[1, 3, 2])
    assert table.qo_indptr.tolist() == [0, 1, 4, 6] and table.max_q_len == 3
    assert table.indptr.tolist() == [0, 3, 4, 6] and table.last_page_len.tolist() == [2, 3, 3]


@pytest.mark.parametrize("bad, message", [
    (dict(seq_lens=[3, -1]), "seq_lens: expected non-negative"),
    (dict(seq_lens=[3, 2], q_lens=[1, 3]), "q_lens: expected 0..seq_lens"),
    (dict(seq_lens=[3], q_lens=[1, 1]), "q_lens: expected length 1"),
    (dict(seq_lens=[3], page_size=0), "page_size: expected an int in 1..256"),
    (dict(seq_lens=[3], page_size=512), "page_size: expected an int in 1..256"),
    (dict(seq_lens=[[3]]), "seq_lens: expected a 1-D integer array"),
])
def test_bad_metadata_is_refused_by_name(bad, message):
    args = dict(page_size=1) | bad
    with pytest.raises(ValueError, match=message):
        host_table(args.pop("seq_lens"), **args)


def test_page_ids_go_into_a_given_buffer_and_one_too_small_is_refused_untouched():
    step = SGLangStep([5, 9], page_size=4)
    n = host_table(step.seq_lens, 4).num_page_ids
    buffer = torch.full((10,), -7, dtype=torch.int32)
    written = page_ids(step.req_to_token, step.req_pool_indices, step.seq_lens_tensor, 4, n, out=buffer)
    assert written.data_ptr() == buffer.data_ptr() and buffer[:n].tolist() == sum(step.pages, [])
    assert buffer[n:].tolist() == [-7] * (10 - n)
    small = torch.full((n - 1,), -7, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"out: expected a contiguous int32 buffer of at least {n} page ids"):
        page_ids(step.req_to_token, step.req_pool_indices, step.seq_lens_tensor, 4, n, out=small)
    assert small.tolist() == [-7] * (n - 1)


def test_request_slots_and_lengths_must_match():
    step = SGLangStep([5, 9])
    with pytest.raises(ValueError, match="req_pool_indices: expected one slot per request"):
        page_ids(step.req_to_token, step.req_pool_indices[:1], step.seq_lens_tensor, 1, 14)
    with pytest.raises(ValueError, match="req_to_token: expected an int32 or int64 tensor"):
        page_ids(step.req_to_token.float(), step.req_pool_indices, step.seq_lens_tensor, 1, 14)


# ---- the pool as paged caches, and KV writes --------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 16])
def test_a_token_major_buffer_is_read_in_place_as_pages(page_size):
    slots = 64 + page_size  # SGLang's size + page_size rows
    buffer = torch.randn(slots, 2, 64).to(torch.bfloat16)
    pages = paged_kv(buffer, page_size, "NHD")
    assert pages.shape == (slots // page_size, page_size, 2, 64) and pages.data_ptr() == buffer.data_ptr()
    slot = 37
    assert torch.equal(pages[slot // page_size, slot % page_size], buffer[slot])


def test_a_page_major_buffer_is_its_own_paged_cache_and_a_wrong_page_is_refused():
    buffer = torch.zeros(5, 2, 16, 64, dtype=torch.float16)
    assert paged_kv(buffer, 16, "HND") is buffer
    with pytest.raises(ValueError, match=r"kv buffer \(HND\): expected \[pages, kv_heads, 8, head_dim\]"):
        paged_kv(buffer, 8, "HND")
    with pytest.raises(ValueError, match="kv layout: expected NHD or HND"):
        paged_kv(buffer, 16, "vectorized_5d")


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_new_keys_and_values_land_at_their_slots(layout):
    page_size, heads, dim = 4, 2, 64
    shape = (32, heads, dim) if layout == "NHD" else (8, heads, page_size, dim)
    k_buffer, v_buffer = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
    loc = torch.tensor([5, 30, 12])
    k, v = torch.randn(3, heads, dim).to(torch.bfloat16), torch.randn(3, heads, dim).to(torch.bfloat16)
    write_kv(k_buffer, v_buffer, loc, k, v, page_size=page_size, layout=layout)
    k_pages, v_pages = paged_kv(k_buffer, page_size, layout), paged_kv(v_buffer, page_size, layout)
    for i, slot in enumerate(loc.tolist()):
        page, offset = divmod(slot, page_size)
        got_k = k_pages[page, offset] if layout == "NHD" else k_pages[page, :, offset]
        got_v = v_pages[page, offset] if layout == "NHD" else v_pages[page, :, offset]
        assert torch.equal(got_k, k[i]) and torch.equal(got_v, v[i])
    assert int((k_buffer != 0).any(-1).sum()) == 3 * heads  # nothing else written


def test_an_fp8_pool_holds_the_values_over_their_scale():
    k_buffer = torch.zeros(16, 1, 64, dtype=torch.float8_e4m3fn)
    v_buffer = torch.zeros(16, 1, 64, dtype=torch.float8_e4m3fn)
    k, v = torch.randn(2, 1, 64).to(torch.bfloat16), torch.randn(2, 1, 64).to(torch.bfloat16)
    write_kv(k_buffer, v_buffer, torch.tensor([3, 9]), k, v, k_scale=0.5, v_scale=2.0)
    assert torch.equal(k_buffer[[3, 9]], (k.float() / 0.5).to(torch.float8_e4m3fn))
    assert torch.equal(v_buffer[[3, 9]], (v.float() / 2.0).to(torch.float8_e4m3fn))


# ---- plans ------------------------------------------------------------------------------------

def fake_loaded(kernel, device_index) -> LoadedKernel:
    return LoadedKernel(None, 0xD0, 0xE0, 2, 132)


class Recorded(BatchDecode):
    """A CPU BatchDecode that keeps each plan()'s arguments."""

    def __init__(self, engine, device, **options):
        super().__init__(engine, device, arch="sm_90", load_kernel=fake_loaded, **options)
        self.plans = []

    def plan(self, indptr, indices, last_page_len, *args, **kwargs):
        self.plans.append(dict(indptr=indptr.tolist(), ids=indices[: int(indptr[-1])].tolist(),
                               last=last_page_len.tolist(), args=args, kwargs=kwargs))
        return super().plan(indptr, indices, last_page_len, *args, **kwargs)


SHAPE = AttentionShape(num_qo_heads=8, num_kv_heads=2, head_dim=128, q_dtype="bfloat16", page_size=16)
FULL, WINDOW = LayerForm(sm_scale=128 ** -0.5), LayerForm(sm_scale=128 ** -0.5, window_left=63, logit_cap=30.0)


@pytest.fixture
def engine(tmp_path, fake_nvrtc):
    return Engine(cache_dir=tmp_path / "cache")


def test_an_eager_step_plans_every_form_over_one_page_table(engine):
    decoder = PoolDecoder(SHAPE, [FULL, WINDOW, FULL], CPU, engine=engine, make_decoder=Recorded)
    assert decoder.forms == (FULL, WINDOW)
    step = SGLangStep([40, 1, 100], page_size=16)
    planned = decoder.plan(step.req_to_token, step.req_pool_indices, step.seq_lens_tensor, step.seq_lens)
    indptr, last = reference_table(step.seq_lens, 16)
    for form, kernel_mask in ((FULL, "none"), (WINDOW, "sliding_window")):
        bd = planned.decoders[form]
        record = bd.plans[-1]
        assert record["indptr"] == indptr and record["last"] == last and record["ids"] == sum(step.pages, [])
        assert record["kwargs"]["check_page_ids"] is False and record["kwargs"]["share_prefixes"] is False
        assert bd.spec.mask == kernel_mask and bd.spec in decoder.specs("sm_90")
        assert list(bd.current_plan.tables.kv_lens) == step.seq_lens
    assert planned.decoders[WINDOW].spec.variant == "soft_cap" and planned.decoders[FULL].spec.variant == "none"
    assert planned.decoders[WINDOW].plans[-1]["kwargs"]["window_left"] == 63 and not planned.graph


def test_graph_steps_plan_any_composition_up_to_the_capacity_into_one_page_id_buffer(engine):
    decoder = PoolDecoder(SHAPE, [FULL, WINDOW], CPU, engine=engine, make_decoder=Recorded)
    decoder.init_graphs(max_batch_size=4, max_pages_per_request=8)
    buffer = decoder.graph_page_ids
    assert buffer.numel() == 32
    for seq_lens in ([40, 1, 100], [128, 128, 2, 7], [1]):
        step = SGLangStep(seq_lens, page_size=16, seed=len(seq_lens))
        planned = decoder.plan_graph(step.req_to_token, step.req_pool_indices, step.seq_lens_tensor, step.seq_lens)
        n = planned.table.num_page_ids
        assert planned.graph and buffer[:n].tolist() == sum(step.pages, [])
        for bd in planned.decoders.values():
            assert bd.use_cuda_graph and bd.current_plan.page_ids is buffer and bd.batch_size == len(seq_lens)
    step = SGLangStep([1] * 5, page_size=16)
    with pytest.raises(ValueError, match="CUDA-graph step: expected at most max_batch_size=4 requests, got 5"):
        decoder.plan_graph(step.req_to_token, step.req_pool_indices, step.seq_lens_tensor, step.seq_lens)
    step = SGLangStep([300, 300, 300], page_size=16, context=300)  # 57 pages: more than the buffer's 32
    before = buffer.clone()
    with pytest.raises(ValueError, match="expected a contiguous int32 buffer of at least 57 page ids"):
        decoder.plan_graph(step.req_to_token, step.req_pool_indices, step.seq_lens_tensor, step.seq_lens)
    assert torch.equal(buffer, before)


def test_multi_token_steps_use_the_causal_mask_up_to_max_q_len(engine):
    decoder = PoolDecoder(SHAPE, [FULL], CPU, engine=engine, make_decoder=Recorded, max_q_len=4)
    step = SGLangStep([20, 9], page_size=16)
    planned = decoder.plan(step.req_to_token, step.req_pool_indices, step.seq_lens_tensor, step.seq_lens,
                           q_lens_cpu=[4, 1])
    bd = planned.decoders[FULL]
    assert bd.spec.mask == "causal" and bd.spec.max_q_len == 4 and bd.num_tokens == 5
    assert bd.spec in decoder.specs("sm_90")
    with pytest.raises(ValueError, match="q_lens: expected at most max_q_len=4 query tokens per request, got 5"):
        decoder.plan(step.req_to_token, step.req_pool_indices, step.seq_lens_tensor, step.seq_lens, q_lens_cpu=[5, 1])


def test_prewarm_builds_every_spec_and_strict_mode_refuses_a_missing_one(engine, fake_nvrtc, monkeypatch, tmp_path):
    decoder = PoolDecoder(SHAPE, [FULL, WINDOW], CPU, engine=engine, make_decoder=Recorded)
    specs = decoder.specs("sm_90")
    assert len(specs) == 2 and {s.group_size for s in specs} == {4} and {s.page_size for s in specs} == {16}
    results = decoder.prewarm(arch="sm_90")
    assert [r.spec for r in results] == specs and sorted(fake_nvrtc) == sorted(s.name for s in specs)
    monkeypatch.setenv("FLASHJIT_NO_COMPILE", "1")
    strict = PoolDecoder(SHAPE, [FULL], CPU, engine=Engine(cache_dir=tmp_path / "empty"), make_decoder=Recorded)
    with pytest.raises(KernelNotPrewarmed, match=specs[0].name):
        strict.prewarm(arch="sm_90")


@pytest.mark.parametrize("bad, message", [
    (dict(num_qo_heads=6, num_kv_heads=4), "num_qo_heads: expected a multiple of num_kv_heads=4"),
    (dict(q_dtype="float32"), "q_dtype"),
    (dict(kv_dtype="int8"), "kv_dtype"),
    (dict(page_size=300), "page_size: expected an int in 1..256"),
    (dict(kv_layout="vectorized_5d"), "kv layout: expected NHD or HND"),
])
def test_a_bad_attention_shape_is_refused_by_name(bad, message):
    with pytest.raises(ValueError, match=message):
        AttentionShape(**(dict(num_qo_heads=8, num_kv_heads=2, head_dim=128) | bad))


def test_forms_and_their_settings_are_checked():
    with pytest.raises(ValueError, match="sm_scale: expected a finite float > 0"):
        LayerForm(sm_scale=0.0)
    with pytest.raises(ValueError, match="window_left: expected an int"):
        LayerForm(sm_scale=0.1, window_left=-2)
    with pytest.raises(ValueError, match="forms: expected one LayerForm or more"):
        PoolDecoder(SHAPE, [], CPU, make_decoder=Recorded)
    with pytest.raises(ValueError, match="max_q_len: expected an int in 1..16"):
        PoolDecoder(SHAPE, [FULL], CPU, make_decoder=Recorded, max_q_len=17)


def test_an_empty_step_plans_no_request(engine):
    decoder = PoolDecoder(SHAPE, [FULL], CPU, engine=engine, make_decoder=Recorded)
    req_to_token, none = torch.zeros(4, 64, dtype=torch.int32), torch.zeros(0, dtype=torch.int64)
    assert decoder.plan(req_to_token, none, none, none).decoders[FULL].batch_size == 0
    decoder.init_graphs(4, 4)
    assert decoder.plan_graph(req_to_token, none, none, none).decoders[FULL].batch_size == 0
