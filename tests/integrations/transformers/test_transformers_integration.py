"""flashjit.integrations.transformers on the CPU: page tables from transformers' key index, one plan
per step and layer group, refusals, and generate_batch end to end with the float32 reference
backend against transformers' own paged|sdpa."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashjit.integrations.transformers import (PagedAttention, ReferenceDecode, UnsupportedAttention,  # noqa: E402
                                                check_transformers_api, register)
from flashjit.integrations.transformers import gathered  # noqa: E402
from flashjit.integrations.transformers.attention import key_positions  # noqa: E402
from flashjit.integrations.transformers.cache_layout import layer_cache  # noqa: E402
from flashjit.integrations.transformers.step_tables import page_ids, step_tables  # noqa: E402

try:
    check_transformers_api()
except ImportError as e:  # another transformers than the adapter reads: its refusal is tested below
    pytest.skip(str(e), allow_module_level=True)

from flashjit.integrations.transformers import paged_name  # noqa: E402

PAGED_SDPA = paged_name("sdpa")  # transformers' own paged SDPA: the tokens every run is compared with


def full_read_index(block_tables, kv_lens, block_size):
    """transformers' full-attention read index: each request's positions, block after block."""
    index = []
    for blocks, kv in zip(block_tables, kv_lens):
        index += [blocks[p // block_size] * block_size + p % block_size for p in range(kv)]
    return torch.tensor(index, dtype=torch.int64)


def cumulative(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


# ---- step tables ----------------------------------------------------------------------------

def test_a_decode_step_is_served_whole_with_the_block_table_as_pages():
    bs, kv_lens = 16, [1, 16, 17, 40]
    rng = random.Random(0)
    free = list(range(20))
    rng.shuffle(free)
    tables_of = [[free.pop() for _ in range(-(-kv // bs))] for kv in kv_lens]
    cu_q, cu_k = cumulative([1] * 4), cumulative(kv_lens)
    t = step_tables(cu_q, cu_k, bs, 16, query_rows=4)
    assert t.served == (0, 1, 2, 3) and t.fallback == () and t.covers_all_rows and t.token_rows is None
    assert t.indptr.tolist() == [0, 1, 2, 4, 7] and t.last_page_len.tolist() == [1, 16, 1, 8]
    assert t.qo_indptr.tolist() == [0, 1, 2, 3, 4] and t.indptr.dtype == torch.int32
    ids = page_ids(full_read_index(tables_of, kv_lens, bs), t, bs)
    assert ids.dtype == torch.int32 and ids.tolist() == sum(tables_of, [])


def test_long_requests_fall_back_and_the_served_rows_are_gathered():
    cu_q, cu_k = cumulative([1, 40, 3]), cumulative([10, 40, 20])
    t = step_tables(cu_q, cu_k, 16, 16, query_rows=44)
    assert t.served == (0, 2) and t.fallback == (1,)
    assert t.token_rows.tolist() == [0, 41, 42, 43] and not t.covers_all_rows
    assert t.qo_indptr.tolist() == [0, 1, 4] and t.max_q_len == 3
    assert t.page_slots.tolist() == [0, 50, 66]  # first positions of each served request's pages


def test_padding_requests_are_skipped_and_padded_rows_are_not_covered():
    cu_q, cu_k = [0, 1, 2, 2, 2], [0, 5, 9, 9, 9]  # two padding requests, 64 padded rows
    t = step_tables(cu_q, cu_k, 4, 16, query_rows=64)
    assert t.served == (0, 1) and t.token_rows is None and t.num_tokens == 2 and not t.covers_all_rows


def test_a_ring_serves_only_requests_whose_new_tokens_overwrite_nothing_they_read():
    window = 8
    # one token over a full window; 3 tokens within the window; 3 tokens past a wrapped ring
    cu_q, cu_k = cumulative([1, 3, 3]), cumulative([8, 8, 10])
    t = step_tables(cu_q, cu_k, 1, 16, query_rows=7, ring_window=window)
    assert t.served == (0, 1) and t.fallback == (2,)
    assert t.indptr.tolist() == [0, 8, 16] and t.last_page_len.tolist() == [1, 1]


@pytest.mark.parametrize("cu_q, cu_k, needle", [([0, 2, 1], [0, 2, 3], "cu_seq_lens_q"),
                                                 ([0, 3], [0, 2], "at least as many keys"),
                                                 ([0, 1], [0, 1, 2], "same number")])
def test_bad_steps_are_refused_by_name(cu_q, cu_k, needle):
    with pytest.raises(ValueError, match=needle):
        step_tables(cu_q, cu_k, 16, 16, query_rows=4)


def test_a_ring_takes_each_new_tokens_write_slot_in_place_of_the_sentinel():
    sentinel = 99
    read = torch.tensor([5, 6, sentinel, 7, sentinel, sentinel])
    write = torch.tensor([40, 41, 42, 98, 98])  # padded with trash slots
    assert key_positions(read, write, 8, sentinel).tolist() == [5, 6, 40, 7, 41, 42]
    assert key_positions(read, write, None, sentinel) is read
    assert key_positions(read[:0], write, 8, sentinel) is write


def test_the_gathered_mask_is_lower_right_causal_with_a_window_of_w_keys():
    seen = gathered.visible(2, 5, 3, "cpu").int().tolist()
    assert seen == [[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]  # query at position 3, then 4; 3 keys each


# ---- the attention function on a hand-made cache ---------------------------------------------

class CountingReference(ReferenceDecode):
    instances: list = []

    def __init__(self, device=None):
        super().__init__(device)
        self.max_q_lens = []
        CountingReference.instances.append(self)

    def plan(self, indptr, indices, last_page_len, *args, qo_indptr=None, **options):
        q = qo_indptr.tolist()
        self.max_q_lens.append(max(b - a for a, b in zip(q, q[1:])))
        return super().plan(indptr, indices, last_page_len, *args, qo_indptr=qo_indptr, **options)


class HandMadeCache(SimpleNamespace):
    """The PagedAttentionCache attributes the adapter reads (a subclass, so it takes weak references)."""


def hand_made_step(kv_lens, q_lens, *, layers=2, heads=(4, 2), head_dim=64, bs=16, seed=0, layout="5.17"):
    """A full-attention cache with random past keys and the kwargs transformers would pass, in
    transformers 5.17's layout (flat per-layer caches) or 5.18's (an allocator's per-layer views,
    the value view one page shorter than the key view)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-kv // bs) for kv in kv_lens) + 2
    order = torch.randperm(num_blocks - 2, generator=g).tolist()
    tables_of, at = [], 0
    for kv in kv_lens:
        n = -(-kv // bs)
        tables_of.append(order[at:at + n])
        at += n
    shape = (num_blocks * bs, heads[1], head_dim)
    keys = [torch.randn(shape, generator=g) for _ in range(layers)]
    values = [torch.randn(shape, generator=g) for _ in range(layers)]
    if layout == "5.17":
        cache = HandMadeCache(layer_index_to_group_indices={i: (0, i) for i in range(layers)},
                              sliding_windows={i: 1 for i in range(layers)}, block_size=bs, sentinel_index=-1,
                              key_cache=keys, value_cache=values)
    else:
        spare = torch.randn(bs, heads[1], head_dim, generator=g)
        views = {i: (torch.cat((keys[i], spare)), values[i]) for i in range(layers)}  # K one page longer
        allocator = SimpleNamespace(index=0, layer_indices=list(range(layers)), layer_type="full_attention",
                                    tokens_per_page=bs, sentinel_index=1, _kv_token_views=views)
        cache = HandMadeCache(layer_to_allocator={i: allocator for i in range(layers)})
    read = full_read_index(tables_of, kv_lens, bs)
    cu_k = cumulative(kv_lens)
    write = torch.cat([read[cu_k[r + 1] - q:cu_k[r + 1]] for r, q in enumerate(q_lens)])
    tokens = sum(q_lens)
    cu_k_kwarg = torch.tensor(cu_k, dtype=torch.int32)
    kwargs = dict(cache=cache, cu_seq_lens_q=torch.tensor(cumulative(q_lens), dtype=torch.int32),
                  cu_seq_lens_k=cu_k_kwarg if layout == "5.17" else {"full_attention": cu_k_kwarg},
                  read_index=[read], write_index=[write])
    qkv = [(torch.randn(1, heads[0], tokens, head_dim, generator=g), torch.randn(1, heads[1], tokens, head_dim, generator=g),
            torch.randn(1, heads[1], tokens, head_dim, generator=g)) for _ in range(layers)]
    return cache, kwargs, qkv, read


def layer_keys_values(cache, layer):
    where = layer_cache(cache, layer)
    return where.keys, where.values


def dense_attention(q, cache, layer, read, kv_lens, q_lens, scale):
    """The expected output, straight from the key index (no pages)."""
    out, cu_k, cu_q = [], cumulative(kv_lens), cumulative(q_lens)
    for r in range(len(kv_lens)):
        idx = read[cu_k[r]:cu_k[r + 1]]
        keys, values = layer_keys_values(cache, layer)
        k, v = keys[idx], values[idx]
        out.append(gathered.attend(q[cu_q[r]:cu_q[r + 1]], k, v, scale, None))
    return torch.cat(out)


@pytest.mark.parametrize("layout", ["5.17", "5.18"])
def test_one_plan_per_step_serves_every_layer_and_writes_the_new_keys(layout):
    CountingReference.instances.clear()
    kv_lens, q_lens = [5, 33, 20], [1, 1, 4]
    cache, kwargs, qkv, read = hand_made_step(kv_lens, q_lens, layout=layout)
    attention = PagedAttention(CountingReference)
    for layer, (q, k, v) in enumerate(qkv):
        out, weights = attention(SimpleNamespace(layer_idx=layer), q, k, v, None, scaling=0.125, **kwargs)
        assert weights is None
        assert torch.equal(layer_keys_values(cache, layer)[0][kwargs["write_index"][0]], k[0].transpose(0, 1))
        expected = dense_attention(q[0].transpose(0, 1), cache, layer, read, kv_lens, q_lens, 0.125)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert attention.plans == 1 and len(CountingReference.instances) == 1
    assert CountingReference.instances[0].max_q_lens == [4]


def test_the_next_step_plans_again_even_in_a_layer_past_the_first():
    cache, kwargs, qkv, _ = hand_made_step([5, 9], [1, 1])
    attention = PagedAttention(CountingReference)
    q, k, v = qkv[1]
    attention(SimpleNamespace(layer_idx=1), q, k, v, None, scaling=0.125, **kwargs)
    attention(SimpleNamespace(layer_idx=1), q, k, v, None, scaling=0.125, **kwargs)
    assert attention.plans == 1  # the same tensors: the same step
    fresh = dict(kwargs, read_index=[kwargs["read_index"][0][:]])  # a new step's views of the same storage
    attention(SimpleNamespace(layer_idx=1), q, k, v, None, scaling=0.125, **fresh)
    assert attention.plans == 2
    attention(SimpleNamespace(layer_idx=0), *qkv[0], None, scaling=0.125, **fresh)
    assert attention.plans == 3  # the group's first layer always plans


def test_the_attention_function_does_not_keep_a_finished_managers_cache_alive():
    import gc
    import weakref

    cache, kwargs, qkv, _ = hand_made_step([5, 9], [1, 1], layers=1)
    attention = PagedAttention(ReferenceDecode)
    attention(SimpleNamespace(layer_idx=0), *qkv[0], None, **kwargs)
    alive = weakref.ref(cache)
    del cache, kwargs["cache"]
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("layout", ["5.17", "5.18"])
def test_a_step_mixing_decodes_and_a_long_chunk_matches_dense_attention(layout):
    kv_lens, q_lens = [7, 40, 18], [1, 30, 2]
    cache, kwargs, qkv, read = hand_made_step(kv_lens, q_lens, layers=1, layout=layout)
    q, k, v = qkv[0]
    out, _ = PagedAttention(ReferenceDecode)(SimpleNamespace(layer_idx=0), q, k, v, None, scaling=0.1, **kwargs)
    expected = dense_attention(q[0].transpose(0, 1), cache, 0, read, kv_lens, q_lens, 0.1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def capped_sinks_attention(q, k, v, scale, softcap, sinks):
    """One request's attention, lower-right causal, with Gemma 2's soft cap and gpt-oss's sinks, written out."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,khd->hnk", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    n, kv = q.shape[0], k.shape[0]
    future = torch.arange(kv)[None, :] > torch.arange(kv - n, kv)[:, None]
    scores = scores.masked_fill(future, float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.float()[:, None, None].expand(-1, n, 1)), dim=-1)
    return torch.einsum("hnk,khd->nhd", torch.softmax(scores, -1)[..., :kv], v)


@pytest.mark.parametrize("layout", ["5.17", "5.18"])
@pytest.mark.parametrize("softcap, with_sinks", [(20.0, False), (None, True), (5.0, True)])
def test_soft_capping_and_each_layers_sinks_are_served_with_one_plan_a_step(layout, softcap, with_sinks):
    """Gemma 2's softcap kwarg and gpt-oss's per-layer sinks (module.sinks, or s_aux), on decode rows
    and on a long chunk's gathered fallback alike."""
    kv_lens, q_lens = [7, 40, 18], [1, 30, 2]  # the 30-token chunk takes the fallback
    cache, kwargs, qkv, read = hand_made_step(kv_lens, q_lens, layout=layout)
    attention = PagedAttention(ReferenceDecode)
    sinks = [torch.randn(4, dtype=torch.bfloat16) * 2 if with_sinks else None for _ in qkv]
    extra = {} if softcap is None else {"softcap": softcap}
    for layer, (q, k, v) in enumerate(qkv):
        module = SimpleNamespace(layer_idx=layer, sinks=sinks[layer])
        out, _ = attention(module, q, k, v, None, scaling=0.125, **kwargs, **extra)
        keys, values = layer_keys_values(cache, layer)
        q_rows, cu_k, cu_q = q[0].transpose(0, 1), cumulative(kv_lens), cumulative(q_lens)
        for r in range(len(kv_lens)):
            idx = read[cu_k[r]:cu_k[r + 1]]
            expected = capped_sinks_attention(q_rows[cu_q[r]:cu_q[r + 1]], keys[idx], values[idx], 0.125, softcap,
                                              sinks[layer])
            torch.testing.assert_close(out[cu_q[r]:cu_q[r + 1]], expected, atol=1e-5, rtol=1e-5)
    assert attention.plans == 1


@pytest.mark.parametrize("extra, module_attrs, feature", [
    ({"softcap": -1.0}, {}, "soft cap"),
    ({"s_aux": torch.zeros(3)}, {}, "sinks other than one logit per query head"),
    ({}, {"sinks": torch.zeros(5)}, "sinks"),
    ({"dropout": 0.1}, {}, "dropout"),
])
def test_features_flashjit_lacks_are_refused_by_name_before_any_write(extra, module_attrs, feature):
    cache, kwargs, qkv, _ = hand_made_step([5], [1], layers=1)
    before = cache.key_cache[0].clone()
    with pytest.raises(UnsupportedAttention, match=feature):
        PagedAttention(ReferenceDecode)(SimpleNamespace(layer_idx=0, **module_attrs), *qkv[0], None, **kwargs, **extra)
    assert torch.equal(cache.key_cache[0], before)


def test_head_dims_and_groups_the_kernels_lack_are_refused():
    cache, kwargs, qkv, _ = hand_made_step([5], [1], layers=1, head_dim=32)
    with pytest.raises(UnsupportedAttention, match="head_dim 32"):
        PagedAttention(ReferenceDecode)(SimpleNamespace(layer_idx=0), *qkv[0], None, **kwargs)
    cache, kwargs, qkv, _ = hand_made_step([5], [1], layers=1, heads=(6, 4))
    with pytest.raises(UnsupportedAttention, match="6 query heads over 4"):
        PagedAttention(ReferenceDecode)(SimpleNamespace(layer_idx=0), *qkv[0], None, **kwargs)


def test_the_default_name_is_one_transformers_serves_as_registered():
    name = register(backend_factory=ReferenceDecode)
    assert name == paged_name("fjit") and "flash" not in name
    assert isinstance(transformers.AttentionInterface._global_mapping[name], PagedAttention)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device serves flashjit's attention here")
def test_without_a_cuda_device_register_raises_naming_what_is_missing():
    """At register(), before any model runs."""
    with pytest.raises(RuntimeError, match=r"^no CUDA device: flashjit's paged attention needs one \(torch .*\); "
                                           r"register\(backend_factory=ReferenceDecode\) serves the float32 "
                                           r"reference instead$"):
        register("fjit_no_cuda")
    assert paged_name("fjit_no_cuda") not in transformers.AttentionInterface._global_mapping


def test_a_call_without_a_paged_cache_and_bad_names_are_refused():
    q = torch.zeros(1, 4, 1, 64)
    with pytest.raises(ValueError, match="without `cache`"):
        PagedAttention(ReferenceDecode)(SimpleNamespace(layer_idx=0), q, q[:, :2], q[:, :2], None)
    for name in ("flashjit", "my_Flash", "", "a|b", "org/kernel", 3):
        with pytest.raises(ValueError, match="name"):
            register(name)
    with pytest.raises(ValueError, match="max_decode_q_len"):
        PagedAttention(max_decode_q_len=17)


# ---- generate_batch end to end ----------------------------------------------------------------

def tiny_model(family: str, window: int | None = None):
    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    config = transformers.Qwen2Config(**common, use_sliding_window=window is not None, sliding_window=window,
                                      max_window_layers=2)
    return transformers.Qwen2ForCausalLM(config).eval()


def generate(model, implementation, max_batch_tokens, num_return_sequences=1):
    """Every finished request's tokens, forked children included (generate_batch returns the parents only)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [3] * 40, list(range(50, 80))]
    # Forks need sampling; top_k=1 keeps it greedy, so both implementations must pick the same tokens.
    sampling = dict(do_sample=True, top_k=1) if num_return_sequences > 1 else dict(do_sample=False)
    config = transformers.GenerationConfig(max_new_tokens=20, eos_token_id=None, pad_token_id=0,
                                           num_return_sequences=num_return_sequences, **sampling)
    model.set_attn_implementation(implementation)
    batching = ContinuousBatchingConfig(block_size=16, num_blocks=64, max_batch_tokens=max_batch_tokens)
    results = {}
    with model.continuous_batching_context_manager(generation_config=config, continuous_batching_config=batching,
                                                   block=True, timeout=5) as manager:
        manager.add_requests(inputs=prompts, max_new_tokens=20)
        while len(results) < len(prompts) * num_return_sequences:
            result = manager.get_result(timeout=10)
            assert result is not None or manager.is_running(), "generation stopped (its error is logged above)"
            if result is not None and result.is_finished():
                results[result.request_id] = result.generated_tokens
    return dict(sorted(results.items()))


def greedy_batch(model, max_batch_tokens):
    """generate_batch's (prompt ids, generated tokens) per request: 16 greedy tokens for each of three
    prompts, in blocks of 16 tokens."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(50, 80))]
    config = transformers.GenerationConfig(max_new_tokens=16, eos_token_id=None, pad_token_id=0, do_sample=False)
    batching = ContinuousBatchingConfig(block_size=16, num_blocks=32, max_batch_tokens=max_batch_tokens)
    out = model.generate_batch(prompts, generation_config=config, progress_bar=False,
                               continuous_batching_config=batching)
    return {k: (r.prompt_ids, r.generated_tokens) for k, r in out.items()}


@pytest.mark.parametrize("family, window", [("llama", None), ("qwen2", 20), ("qwen2", 8)])
@pytest.mark.parametrize("max_batch_tokens", [64, 12])  # whole prompts with long ones gathered; 12-token chunks
def test_generate_batch_with_the_reference_backend_gives_paged_sdpa_tokens(family, window, max_batch_tokens):
    model = tiny_model(family, window)
    expected = generate(model, PAGED_SDPA, max_batch_tokens)
    CountingReference.instances.clear()
    got = generate(model, register("jit_cpu_reference", backend_factory=CountingReference),
                   max_batch_tokens)
    assert got == expected and all(len(t) == 20 for t in got.values())
    planned_q = {q for backend in CountingReference.instances for q in backend.max_q_lens}
    assert 1 in planned_q and max(planned_q) > 1  # decode steps and multi-token steps both ran on the backend


class FailingReference(ReferenceDecode):
    """A backend whose kernel fails to build: the error flashjit's compiler would raise in generate_batch's thread."""

    def plan(self, *args, **options):
        raise RuntimeError("NVRTC compilation failed: spec decode_demo (stand-in)")


@pytest.mark.parametrize("head_dim, backend, error, cause", [
    (32, ReferenceDecode, UnsupportedAttention, r"does not support head_dim 32"),
    (64, FailingReference, RuntimeError, r"^NVRTC compilation failed: spec decode_demo"),
])
def test_generate_batch_raises_what_flashjits_attention_raised_in_its_thread(head_dim, backend, error, cause):
    """transformers' generation thread logs the exception and fails the requests (empty token lists);
    the caller gets the exception itself, and a later call on transformers' own attention is untouched."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                                      max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(config).eval()
    model.set_attn_implementation(register("jit_failing", backend_factory=backend))
    with pytest.raises(error, match=cause):
        greedy_batch(model, max_batch_tokens=64)
    model.set_attn_implementation(PAGED_SDPA)
    outputs = greedy_batch(model, max_batch_tokens=64)
    assert [len(generated) for _, generated in outputs.values()] == [16, 16, 16]


def test_errors_are_collected_inside_the_block_only_first_of_each_message():
    attention, q = PagedAttention(ReferenceDecode), torch.zeros(1, 4, 1, 64)
    module = SimpleNamespace(layer_idx=0)
    errors = []
    with attention.collect_errors() as raised:
        for _ in range(2):
            with pytest.raises(ValueError, match="without `cache`") as caught:
                attention(module, q, q[:, :2], q[:, :2], None)
            errors.append(caught.value)
    assert errors[0] is not errors[1] and raised == {str(errors[0]): errors[0]}
    with pytest.raises(ValueError):
        attention(module, q, q[:, :2], q[:, :2], None)
    assert len(raised) == 1  # nothing is kept past the block (a traceback would hold the step's cache)


def test_forked_requests_give_paged_sdpa_tokens():
    model = tiny_model("llama")
    expected = generate(model, PAGED_SDPA, 64, num_return_sequences=2)
    got = generate(model, register("jit_cpu_reference", backend_factory=ReferenceDecode), 64, num_return_sequences=2)
    assert len(got) == 8 and got == expected


# ---- the float32 oracle the GPU tests judge tokens with ---------------------------------------

def test_the_greedy_oracle_accepts_paged_sdpas_tokens_and_rejects_changed_ones():
    import copy

    from flashjit.integrations.transformers.greedy_oracle import check_sequences

    exact = tiny_model("llama")
    exact.set_attn_implementation("sdpa")
    plain = copy.deepcopy(exact).to(torch.bfloat16)
    model = copy.deepcopy(plain)
    model.set_attn_implementation(PAGED_SDPA)
    outputs = greedy_batch(model, max_batch_tokens=64)
    decisive, positions, failures = check_sequences(exact, plain, outputs)
    assert positions == 48 and failures == [] and decisive >= positions // 2
    # The float32 runner-up fails exactly at the decisive positions (the logits at t see tokens before t only).
    from flashjit.integrations.transformers.greedy_oracle import check_sequence

    prompt, generated = outputs[next(iter(outputs))]
    logits = exact(input_ids=torch.tensor([prompt + generated])).logits[0, len(prompt) - 1:-1]
    runner_up = logits.topk(2, dim=-1).indices[:, 1].tolist()
    failed_at = [t for t in range(len(generated))
                 if check_sequence(exact, plain, prompt, generated[:t] + [runner_up[t]]).failures]
    decisive = check_sequence(exact, plain, prompt, generated).decisive
    assert len(failed_at) == decisive > 0


# ---- CUDA-graph steps: page tables made by fixed-shape torch ops ------------------------------

def expected_pieces(cu_q, cu_k, key_index, bs, piece):
    """The pieces on the host: (q tokens, kv keys, page ids) of each piece, requests in order."""
    out = []
    for r in range(len(cu_q) - 1):
        n, kv = cu_q[r + 1] - cu_q[r], cu_k[r + 1] - cu_k[r]
        for start in range(0, n, piece):
            q = min(piece, n - start)
            keys = kv - n + start + q
            ids = [int(key_index[cu_k[r] + p * bs]) // bs for p in range(-(-keys // bs))]
            out.append((q, keys, ids))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_device_step_tables_cut_every_request_into_pieces_over_its_page_prefixes(seed):
    from flashjit.integrations.transformers.graph_step import device_step_tables, max_pieces

    rng = random.Random(seed)
    bs, piece = rng.choice([4, 16]), rng.choice([1, 4, 16])
    q_lens = [rng.choice([1, 1, 2, 5, 16, 17, 40]) for _ in range(rng.randint(1, 6))]
    kv_lens = [q + rng.randint(0, 60) for q in q_lens]
    padding = rng.randint(0, 3)  # transformers pads with requests of no tokens
    blocks = sum(-(-kv // bs) for kv in kv_lens) + 2
    free = list(range(blocks - 2))
    rng.shuffle(free)
    tables_of = [[free.pop() for _ in range(-(-kv // bs))] for kv in kv_lens]
    key_index = full_read_index(tables_of, kv_lens, bs)
    cu_q, cu_k = cumulative(q_lens + [0] * padding), cumulative(kv_lens + [0] * padding)
    rows = cu_q[-1] + rng.randint(0, 7)
    num_pieces = max_pieces(rows, len(q_lens) + padding, piece)
    batch, indptr, last, qo, ids = device_step_tables(torch.tensor(cu_q, dtype=torch.int32),
                                                      torch.tensor(cu_k, dtype=torch.int32), key_index, bs, piece,
                                                      num_pieces, num_pieces * blocks)
    expected = expected_pieces(cu_q, cu_k, key_index, bs, piece)
    b = len(expected)
    assert int(batch) == b <= num_pieces and indptr.dtype == ids.dtype == torch.int32
    assert qo[:b + 1].tolist() == cumulative([q for q, _, _ in expected])
    pages = [ids[indptr[i]:indptr[i + 1]].tolist() for i in range(b)]
    assert pages == [p for _, _, p in expected]
    assert last[:b].tolist() == [keys - (len(p) - 1) * bs for _, keys, p in expected]
    # Unused pieces: no pages, no tokens; unused page ids: 0 (a valid page).
    assert set(indptr[b:].tolist()) == {int(indptr[b])} and set(qo[b:].tolist()) == {int(qo[b])}
    assert last[b:].tolist() == [0] * (num_pieces - b) and set(ids[int(indptr[b]):].tolist()) <= {0}


@pytest.mark.parametrize("piece", [16, 3])
@pytest.mark.parametrize("max_batch_tokens", [64, 12])
def test_cuda_graph_steps_with_the_reference_backend_give_paged_sdpa_tokens(piece, max_batch_tokens):
    model = tiny_model("llama")
    expected = generate(model, PAGED_SDPA, max_batch_tokens)
    name = register("jit_cpu_graph", backend_factory=ReferenceDecode, cuda_graphs=True, max_decode_q_len=piece)
    assert generate(model, name, max_batch_tokens) == expected


def test_cuda_graph_steps_refuse_sliding_window_layers_by_name():
    cache, kwargs, qkv, _ = hand_made_step([5], [1], layers=1)
    cache.sliding_windows = {0: 8}
    with pytest.raises(UnsupportedAttention, match="sliding-window layers in CUDA graphs"):
        PagedAttention(ReferenceDecode, cuda_graphs=True)(SimpleNamespace(layer_idx=0), *qkv[0], None, **kwargs)
    with pytest.raises(ValueError, match="cuda_graphs"):
        PagedAttention(cuda_graphs=1)


@pytest.mark.parametrize("version", ["5.16.0", "5.24.0", "6.0.0"])
def test_releases_outside_the_supported_range_are_refused_naming_it(monkeypatch, version):
    import sys

    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)  # (the module imported now)
    with pytest.raises(ImportError, match=f"transformers>=5.17,<5.24; transformers {version} is installed"):
        check_transformers_api()


def test_the_5_18_layout_cuts_keys_and_values_to_the_pages_they_share():
    cache, _, _, _ = hand_made_step([5, 9], [1, 1], layers=2, layout="5.18")
    first, second = layer_cache(cache, 0), layer_cache(cache, 1)
    assert first.keys.shape == first.values.shape and first.keys.shape[0] % first.block_size == 0
    assert (first.group, first.first_in_group, second.first_in_group, first.ring) == (0, True, False, None)
    k_pages, v_pages = second.pages(first.block_size)
    assert k_pages.shape == v_pages.shape == (first.keys.shape[0] // 16, 16, 2, 64)
