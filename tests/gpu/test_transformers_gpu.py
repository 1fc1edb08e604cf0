"""flashjit in transformers' continuous batching on the GPU: the adapter's BatchDecode against the
float32 reference on one step, and greedy tokens against transformers' paged|sdpa (fp16,
random-initialized Llama and Qwen2, multi-token steps, sliding layers, forked requests)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashjit.integrations.transformers import PagedAttention, ReferenceDecode, register  # noqa: E402
from flashjit.integrations.transformers import check_transformers_api  # noqa: E402

check_transformers_api()  # the GPU machine's transformers must be the one the adapter reads

PROMPT_LENGTHS = (7, 3, 40, 30, 300, 16, 1, 129)


def prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def model_of(family: str, window: int | None = None, layers: int = 4):
    torch.manual_seed(0)
    common = dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=2048)
    if family == "llama":
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**common, use_sliding_window=window is not None, sliding_window=window,
                                          max_window_layers=layers // 2)
        model = transformers.Qwen2ForCausalLM(config)
    # A random model's logits are nearly uniform: fp16 rounding alone flips greedy near-ties. Output
    # weights 30x larger keep the same ordering with margins rounding cannot cross.
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return model.to(device="cuda", dtype=torch.float16).eval()


def generate(model, implementation, max_batch_tokens, num_return_sequences=1, new_tokens=40):
    """Every finished request's tokens, forked children included."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    inputs = prompts()
    sampling = dict(do_sample=True, top_k=1) if num_return_sequences > 1 else dict(do_sample=False)
    config = transformers.GenerationConfig(max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0,
                                           num_return_sequences=num_return_sequences, **sampling)
    model.set_attn_implementation(implementation)
    batching = ContinuousBatchingConfig(block_size=256 if max_batch_tokens > 64 else 16, num_blocks=256,
                                        max_batch_tokens=max_batch_tokens, use_cuda_graph=False)
    results = {}
    with model.continuous_batching_context_manager(generation_config=config, continuous_batching_config=batching,
                                                   block=True, timeout=5) as manager:
        manager.add_requests(inputs=inputs, max_new_tokens=new_tokens)
        while len(results) < len(inputs) * num_return_sequences:
            result = manager.get_result(timeout=60)
            assert result is not None or manager.is_running(), "generation stopped (its error is logged above)"
            if result is not None and result.is_finished():
                results[result.request_id] = result.generated_tokens
    return dict(sorted(results.items()))


def assert_same_tokens(got, expected):
    assert got.keys() == expected.keys()
    for request, tokens in expected.items():
        first = next((i for i, (a, b) in enumerate(zip(got[request], tokens)) if a != b), None)
        assert got[request] == tokens, f"{request}: first differs at token {first}: {got[request]} vs {tokens}"


@pytest.mark.parametrize("family, window", [("llama", None), ("qwen2", None), ("qwen2", 64)])
@pytest.mark.parametrize("max_batch_tokens", [512, 12])  # whole prompts; 12-token chunks over a past (multi-token)
def test_greedy_tokens_equal_paged_sdpa(family, window, max_batch_tokens):
    model = model_of(family, window)
    expected = generate(model, "paged|sdpa", max_batch_tokens)
    got = generate(model, register("jit_gpu_test"), max_batch_tokens)
    assert_same_tokens(got, expected)


def test_forked_requests_give_paged_sdpa_tokens():
    model = model_of("llama")
    expected = generate(model, "paged|sdpa", 512, num_return_sequences=3)
    got = generate(model, register("jit_fork_test"), 512, num_return_sequences=3)
    assert len(got) == 3 * len(PROMPT_LENGTHS)
    assert_same_tokens(got, expected)


class HandMadeCache(SimpleNamespace):
    """The PagedAttentionCache attributes the adapter reads (a subclass, so it takes weak references)."""


def one_step(kv_lens, q_lens, bs=16, heads=(32, 8), head_dim=128, dtype=torch.bfloat16):
    """A full-attention cache of random keys, shuffled blocks, and the kwargs transformers passes."""
    g = torch.Generator(device="cuda").manual_seed(0)
    num_blocks = sum(-(-kv // bs) for kv in kv_lens) + 2
    order = torch.randperm(num_blocks - 2, device="cuda", generator=g).tolist()
    read, at, cu_k, cu_q, write = [], 0, [0], [0], []
    for kv, q in zip(kv_lens, q_lens):
        blocks = order[at:at + -(-kv // bs)]
        at += len(blocks)
        positions = [blocks[p // bs] * bs + p % bs for p in range(kv)]
        read += positions
        write += positions[kv - q:]
        cu_k.append(cu_k[-1] + kv)
        cu_q.append(cu_q[-1] + q)
    shape = (num_blocks * bs, heads[1], head_dim)
    cache = HandMadeCache(layer_index_to_group_indices={0: (0, 0)}, sliding_windows={0: 1}, block_size=bs,
                            sentinel_index=-1,
                            key_cache=[torch.randn(shape, device="cuda", generator=g).to(dtype)],
                            value_cache=[torch.randn(shape, device="cuda", generator=g).to(dtype)])
    as_index = dict(dtype=torch.int64, device="cuda")
    kwargs = dict(cache=cache, cu_seq_lens_q=torch.tensor(cu_q, dtype=torch.int32, device="cuda"),
                  cu_seq_lens_k=torch.tensor(cu_k, dtype=torch.int32, device="cuda"),
                  read_index=[torch.tensor(read, **as_index)], write_index=[torch.tensor(write, **as_index)])
    tokens = sum(q_lens)
    q = torch.randn(1, heads[0], tokens, head_dim, device="cuda", generator=g).to(dtype)
    k = torch.randn(1, heads[1], tokens, head_dim, device="cuda", generator=g).to(dtype)
    v = torch.randn(1, heads[1], tokens, head_dim, device="cuda", generator=g).to(dtype)
    return cache, kwargs, (q, k, v)


@pytest.mark.parametrize("kv_lens, q_lens", [([1, 17, 300, 4096], [1, 1, 1, 1]),
                                              ([50, 700, 33], [4, 16, 3]),
                                              ([20, 900, 64], [1, 200, 2])])  # a long chunk beside decodes
def test_batch_decode_matches_the_reference_backend_on_one_step(kv_lens, q_lens):
    module = SimpleNamespace(layer_idx=0)
    cache, kwargs, (q, k, v) = one_step(kv_lens, q_lens)
    original = (cache.key_cache[0].clone(), cache.value_cache[0].clone())
    got, _ = PagedAttention()(module, q, k, v, None, scaling=0.088, **kwargs)
    cache.key_cache[0].copy_(original[0])
    cache.value_cache[0].copy_(original[1])
    expected, _ = PagedAttention(ReferenceDecode)(module, q, k, v, None, scaling=0.088, **kwargs)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_capture_in_a_cuda_graph_is_refused_by_name():
    cache, kwargs, (q, k, v) = one_step([40], [1])
    attention = PagedAttention()
    attention(SimpleNamespace(layer_idx=0), q, k, v, None, **kwargs)  # plans and compiles outside the capture
    graph, refusal = torch.cuda.CUDAGraph(), None
    try:
        with torch.cuda.graph(graph):
            try:
                attention(SimpleNamespace(layer_idx=0), q, k, v, None, **kwargs)
            except RuntimeError as e:  # raised before any GPU work: the capture itself ends cleanly
                refusal = e
    finally:
        graph.reset()
    assert refusal is not None and "CUDA graphs" in str(refusal)
