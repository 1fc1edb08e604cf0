"""flashjit in transformers' continuous batching on the GPU: the adapter's BatchDecode against the
float32 reference on one step, and generate_batch's greedy tokens checked against a float32
teacher-forced oracle (fp16, random-initialized Llama and Qwen2, multi-token steps, sliding
layers, forked requests).

Why an oracle and not token equality with paged|sdpa: a random model's sequences fall into loops
alternating between two tokens whose logits nearly tie, and there fp16 rounding alone picks either
(two correct fp16 paths part at tokens 11-21 of 40). flashjit.integrations.transformers.greedy_oracle
checks every token of each implementation's own sequence: it must be an argmax of the float32 model
fed the same tokens, within 4x the logit error the plain fp16 forward makes at that position. Where the float32
margin exceeds that tolerance (most positions: the tests require at least half) only the float32
argmax passes, so an attention that reads a wrong page, mask or scale fails; a sabotaged backend
(pages of the neighbouring request) shows that it does. paged|sdpa must pass the same check.
gpt-oss's experts are chosen by a top-2 router: where two router logits nearly tie, any fp16 path
may take the other expert and move the logits by tenths, so a sequence is also accepted when it
passes under the routing flipped at such ties (greedy_oracle, moe_routing), and only then.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashjit.integrations.transformers.greedy_oracle import check_sequences  # noqa: E402

from flashjit.integrations.transformers import PagedAttention, ReferenceDecode, paged_name, register  # noqa: E402
from flashjit.integrations.transformers import check_transformers_api  # noqa: E402
from flashjit.integrations.transformers.attention import flashjit_backend  # noqa: E402
from flashjit.serving.exactness import assert_exact, tolerance  # noqa: E402

check_transformers_api()  # the GPU machine's transformers must be the one the adapter reads

PROMPT_LENGTHS = (7, 3, 40, 30, 300, 16, 1, 129)
MIN_DECISIVE = 0.5  # share of generated positions where the oracle accepts only one token


def prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def model_of(family: str, window: int | None = None, layers: int = 4):
    """(the fp16 CUDA model generate_batch runs, its float32 copy and a plain fp16 copy for the oracle)."""
    torch.manual_seed(0)
    common = dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=2048)
    reference = "sdpa"
    if family == "llama":
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    elif family == "gemma2":  # logit soft-capping; eager is the reference attention that caps
        config = transformers.Gemma2Config(**common, sliding_window=window, attn_logit_softcapping=2.0,
                                           final_logit_softcapping=None, query_pre_attn_scalar=128)
        model, reference = transformers.Gemma2ForCausalLM(config), "eager"
        with torch.no_grad():
            for layer in model.model.layers:  # logits well past the cap
                layer.self_attn.q_proj.weight.mul_(30)
                layer.self_attn.k_proj.weight.mul_(30)
    elif family == "gpt_oss":  # learned sinks, different in every layer
        config = transformers.GptOssConfig(**common, num_local_experts=4, num_experts_per_tok=2, sliding_window=window)
        model, reference = transformers.GptOssForCausalLM(config), "eager"
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape) * 2)
    else:
        config = transformers.Qwen2Config(**common, use_sliding_window=window is not None, sliding_window=window,
                                          max_window_layers=layers // 2)
        model = transformers.Qwen2ForCausalLM(config)
    model = model.to(device="cuda").eval()
    exact, plain = copy.deepcopy(model), copy.deepcopy(model).to(torch.float16)
    for m in (exact, plain):
        m.set_attn_implementation(reference)
    return model.to(torch.float16), exact, plain


def generate(model, implementation, max_batch_tokens, num_return_sequences=1, new_tokens=40, use_cuda_graph=False):
    """request id -> (prompt ids, generated tokens) of every finished request, forked children included."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    inputs = prompts()
    sampling = dict(do_sample=True, top_k=1) if num_return_sequences > 1 else dict(do_sample=False)
    config = transformers.GenerationConfig(max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0,
                                           num_return_sequences=num_return_sequences, **sampling)
    model.set_attn_implementation(implementation)
    batching = ContinuousBatchingConfig(block_size=256 if max_batch_tokens > 64 else 16, num_blocks=256,
                                        max_batch_tokens=max_batch_tokens, use_cuda_graph=use_cuda_graph)
    results = {}
    with model.continuous_batching_context_manager(generation_config=config, continuous_batching_config=batching,
                                                   block=True, timeout=5) as manager:
        manager.add_requests(inputs=inputs, max_new_tokens=new_tokens)
        while len(results) < len(inputs) * num_return_sequences:
            result = manager.get_result(timeout=60)
            assert result is not None or manager.is_running(), "generation stopped (its error is logged above)"
            if result is not None and result.is_finished():
                results[result.request_id] = (list(result.prompt_ids), list(result.generated_tokens))
    return dict(sorted(results.items()))


def assert_oracle_accepts(outputs, exact, plain, new_tokens=40, min_decisive=MIN_DECISIVE):
    assert outputs and all(len(generated) == new_tokens for _, generated in outputs.values())
    decisive, positions, failures = check_sequences(exact, plain, outputs)
    assert not failures, f"{len(failures)} tokens are no float32 argmax: " + "; ".join(failures[:5])
    assert decisive >= min_decisive * positions, f"only {decisive} of {positions} positions were decisive"


@pytest.mark.parametrize("family, window", [("llama", None), ("qwen2", None), ("qwen2", 64)])
@pytest.mark.parametrize("max_batch_tokens", [512, 12])  # whole prompts; 12-token chunks over a past (multi-token)
def test_greedy_tokens_are_float32_argmaxes_as_paged_sdpas_are(family, window, max_batch_tokens):
    model, exact, plain = model_of(family, window)
    assert_oracle_accepts(generate(model, paged_name("sdpa"), max_batch_tokens), exact, plain)
    assert_oracle_accepts(generate(model, register("jit_gpu_test"), max_batch_tokens), exact, plain)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
@pytest.mark.parametrize("max_batch_tokens", [512, 12])
def test_soft_capped_and_sink_models_give_float32_argmaxes(family, max_batch_tokens):
    """Gemma 2's soft cap and gpt-oss's per-layer sinks on the kernels' variants, sliding layers included."""
    model, exact, plain = model_of(family, window=64)
    assert_oracle_accepts(generate(model, register(f"jit_{family}"), max_batch_tokens), exact, plain, min_decisive=1 / 3)


def test_forked_requests_give_float32_argmaxes():
    model, exact, plain = model_of("llama")
    got = generate(model, register("jit_fork_test"), 512, num_return_sequences=3)
    assert len(got) == 3 * len(PROMPT_LENGTHS)
    assert_oracle_accepts(got, exact, plain)


class NeighbourPages:
    """A BatchDecode that reads every request's pages from the next one's place: a wrong attention."""

    def __init__(self, device):
        self.inner = flashjit_backend(device)

    def plan(self, indptr, indices, *args, **kwargs):
        return self.inner.plan(indptr, indices.roll(1).contiguous(), *args, **kwargs)

    def run(self, *args, **kwargs):
        return self.inner.run(*args, **kwargs)


def test_the_oracle_rejects_an_attention_reading_wrong_pages():
    model, exact, plain = model_of("llama")
    wrong = generate(model, register("jit_wrong_pages", backend_factory=NeighbourPages), 512)
    _, _, failures = check_sequences(exact, plain, wrong)
    assert len(failures) > 10, "the oracle let an attention over the wrong pages pass"


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
    assert_same_rows(got, expected)


def assert_same_rows(got, expected):
    """Every (token, head) row of the adapter's output against the reference backend's (which rounds
    its float32 result to the same type once more): a bound from the dtype, row by row."""
    rows = lambda t: t.reshape(-1, t.shape[-2], t.shape[-1])  # noqa: E731 (each row one head's head_dim)
    assert_exact(rows(got), None, rows(expected).float(), None, tolerance(got.dtype))


@pytest.mark.parametrize("softcap, with_sinks", [(30.0, False), (None, True), (10.0, True)])
def test_soft_cap_and_sinks_match_the_reference_backend_on_one_step(softcap, with_sinks):
    kv_lens, q_lens = [20, 900, 64], [1, 200, 2]  # a long chunk (the gathered fallback) beside decodes
    sinks = torch.randn(32, device="cuda") * 2 if with_sinks else None
    module = SimpleNamespace(layer_idx=0, sinks=sinks)
    extra = {} if softcap is None else {"softcap": softcap}
    cache, kwargs, (q, k, v) = one_step(kv_lens, q_lens)
    q.mul_(4)  # logits past the cap
    original = (cache.key_cache[0].clone(), cache.value_cache[0].clone())
    got, _ = PagedAttention()(module, q, k, v, None, scaling=0.088, **kwargs, **extra)
    cache.key_cache[0].copy_(original[0])
    cache.value_cache[0].copy_(original[1])
    expected, _ = PagedAttention(ReferenceDecode)(module, q, k, v, None, scaling=0.088, **kwargs, **extra)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_capture_without_cuda_graphs_mode_is_refused_by_name():
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
    assert refusal is not None and "cuda_graphs=True" in str(refusal)


# ---- CUDA graphs: a step captured once, replayed for other compositions of the same size -------

BS, CACHE_BLOCKS, HEADS, HEAD_DIM = 16, 96, (32, 8), 128


def step_data(kv_lens, q_lens, seed):
    """(cu_q, cu_k, read index, write index, q, k, v) of a step over random blocks of a fixed cache."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(CACHE_BLOCKS, generator=g).tolist()
    read, write, cu_k, cu_q, at = [], [], [0], [0], 0
    for kv, n in zip(kv_lens, q_lens):
        blocks = order[at:at + -(-kv // BS)]
        at += len(blocks)
        positions = [blocks[p // BS] * BS + p % BS for p in range(kv)]
        read += positions
        write += positions[kv - n:]
        cu_k.append(cu_k[-1] + kv)
        cu_q.append(cu_q[-1] + n)
    tokens = cu_q[-1]
    qkv = [torch.randn(1, h, tokens, HEAD_DIM, generator=g) for h in (HEADS[0], HEADS[1], HEADS[1])]
    return cu_q, cu_k, read, write, qkv


@pytest.mark.parametrize("piece", [16, 4])
def test_a_captured_step_replays_other_compositions_of_its_size(piece):
    """Captured over one composition, replayed over others with the same query rows, requests and
    key positions in all: decodes, short multi-token requests and a long chunk cut into pieces."""
    g = torch.Generator(device="cuda").manual_seed(1)
    shape = ((CACHE_BLOCKS + 2) * BS, HEADS[1], HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda", generator=g).half()
    v_cache = torch.randn(shape, device="cuda", generator=g).half()
    cache = HandMadeCache(layer_index_to_group_indices={0: (0, 0)}, sliding_windows={0: 1}, block_size=BS,
                          sentinel_index=-1, key_cache=[k_cache], value_cache=[v_cache])
    steps = [([40, 300, 17, 90], [1, 1, 1, 37]), ([200, 100, 57, 90], [3, 16, 1, 20]),
             ([447, 0, 0, 0], [40, 0, 0, 0])]  # 40 rows and 447 keys each; padding requests have neither
    static = dict(cu_q=torch.zeros(5, dtype=torch.int32, device="cuda"),
                  cu_k=torch.zeros(5, dtype=torch.int32, device="cuda"),
                  read=torch.zeros(447, dtype=torch.int64, device="cuda"),
                  write=torch.zeros(40, dtype=torch.int64, device="cuda"),
                  q=torch.zeros(1, HEADS[0], 40, HEAD_DIM, dtype=torch.half, device="cuda"),
                  k=torch.zeros(1, HEADS[1], 40, HEAD_DIM, dtype=torch.half, device="cuda"),
                  v=torch.zeros(1, HEADS[1], 40, HEAD_DIM, dtype=torch.half, device="cuda"))

    def load(i):
        cu_q, cu_k, read, write, qkv = step_data(*steps[i], seed=i)
        for name, values in (("cu_q", cu_q), ("cu_k", cu_k), ("read", read), ("write", write)):
            static[name].copy_(torch.tensor(values))
        for name, t in zip("qkv", qkv):
            static[name].copy_(t)

    def call(attention, out=None):
        kwargs = dict(cache=cache, cu_seq_lens_q=static["cu_q"], cu_seq_lens_k=static["cu_k"],
                      read_index=[static["read"]], write_index=[static["write"]])
        result, _ = attention(SimpleNamespace(layer_idx=0), static["q"], static["k"], static["v"], None,
                              scaling=0.088, **kwargs)
        return result if out is None else out.copy_(result)

    attention = PagedAttention(cuda_graphs=True, max_decode_q_len=piece)
    load(0)
    call(attention)  # eager first: makes the decoder, compiles and plans once
    out = torch.zeros(40, HEADS[0], HEAD_DIM, dtype=torch.half, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(attention, out)
    try:
        for i in range(len(steps)):
            load(i)
            graph.replay()
            expected = call(PagedAttention(ReferenceDecode))  # writes the same K/V again, then attends
            rows = sum(steps[i][1])
            assert_same_rows(out[:rows], expected[:rows])
    finally:
        graph.reset()


@pytest.mark.parametrize("max_batch_tokens", [512, 12])
def test_generation_in_cuda_graphs_gives_float32_argmaxes_and_replays(max_batch_tokens):
    model, exact, plain = model_of("llama")
    name = register(f"jit_graph_{max_batch_tokens}", cuda_graphs=True)
    got = generate(model, name, max_batch_tokens, use_cuda_graph=True)
    assert_oracle_accepts(got, exact, plain)
    # Each forward transformers runs in Python plans once; replays do not: 40 decode steps at least.
    assert transformers.AttentionInterface._global_mapping[name].plans < 40


def test_forked_requests_in_cuda_graphs_give_float32_argmaxes():
    model, exact, plain = model_of("llama")
    got = generate(model, register("jit_graph_fork", cuda_graphs=True), 512, num_return_sequences=3,
                   use_cuda_graph=True)
    assert len(got) == 3 * len(PROMPT_LENGTHS)
    assert_oracle_accepts(got, exact, plain)
