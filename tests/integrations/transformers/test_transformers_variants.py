"""Gemma 2 (logit soft-capping) and gpt-oss (learned sinks per layer) through the transformers adapter
on the CPU, end to end with the float32 reference backend: gpt-oss's tokens equal transformers' own
paged eager attention's (which applies the sinks); Gemma 2's, which no paged attention of
transformers soft-caps, are checked token by token against the float32 model
(flashjit.integrations.transformers.greedy_oracle), which also accepts tokens gpt-oss's router
sends across a near tie to the other expert, and only those."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_transformers_integration import generate, greedy_batch  # noqa: E402  (skips outside the supported releases)

from flashjit.integrations.transformers import ReferenceDecode, register  # noqa: E402

COMMON = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=512)


def gpt_oss():
    torch.manual_seed(0)
    config = transformers.GptOssConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=20)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # sinks large enough to matter, different in every layer
            layer.self_attn.sinks.copy_(torch.randn(COMMON["num_attention_heads"]) * 2)
    return model


def gemma2():
    torch.manual_seed(0)
    config = transformers.Gemma2Config(**COMMON, sliding_window=20, attn_logit_softcapping=2.0,
                                       final_logit_softcapping=None, query_pre_attn_scalar=64)
    model = transformers.Gemma2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # logits well past the cap, so the cap changes the tokens
            layer.self_attn.q_proj.weight.mul_(30)
            layer.self_attn.k_proj.weight.mul_(30)
    return model


@pytest.mark.parametrize("max_batch_tokens", [64, 12])
def test_gpt_oss_sinks_give_paged_eager_tokens(max_batch_tokens):
    model = gpt_oss()
    expected = generate(model, "paged|eager", max_batch_tokens)
    got = generate(model, register("jit_sinks", backend_factory=ReferenceDecode), max_batch_tokens)
    assert got == expected and all(len(t) == 20 for t in got.values())


def test_gemma2_soft_capped_tokens_are_float32_argmaxes():
    from flashjit.integrations.transformers.greedy_oracle import check_sequences

    model = gemma2()
    exact = copy.deepcopy(model)
    exact.set_attn_implementation("eager")  # Gemma 2's eager attention soft-caps
    plain = copy.deepcopy(exact).to(torch.bfloat16)
    model.set_attn_implementation(register("jit_softcap", backend_factory=ReferenceDecode))
    outputs = greedy_batch(model, max_batch_tokens=12)
    decisive, positions, failures = check_sequences(exact, plain, outputs)
    # A third of the positions leave one token acceptable; with the cap dropped, some of them fail.
    assert positions == 48 and failures == [] and decisive >= positions // 3


def test_the_oracle_accepts_tokens_routed_across_a_near_tie_and_rejects_a_runner_up(monkeypatch):
    """gpt-oss routes each token to its top-2 experts; where two router logits nearly tie, another
    fp16 path may take the other expert and move the logits far past the plain fp16 forward's error.
    A model with such a tie (layer 1, the prompt's last token) generates in float32 with that
    routing flipped: the plain check rejects the tokens, the check with routing ties accepts them
    by flipping exactly that routing, and a runner-up token still fails."""
    from flashjit.integrations.transformers import greedy_oracle
    from flashjit.integrations.transformers.greedy_oracle import check_sequence, teacher_forced_logits
    from flashjit.integrations.transformers.moe_routing import flipped, recorded_router_logits, routers

    exact, layer = gpt_oss(), 1
    exact.set_attn_implementation("eager")
    prompt = torch.randint(3, 250, (9,), generator=torch.Generator().manual_seed(0)).tolist()
    tie = (layer, len(prompt) - 1)
    with recorded_router_logits(exact) as router_logits:
        teacher_forced_logits(exact, prompt)
    router = routers(exact)[layer]
    values, experts = router_logits[layer][tie[1]].topk(router.top_k + 1)
    with torch.no_grad():  # the (k+1)-th expert 1e-5 below the k-th at that token
        router.bias[experts[-1]] += values[-2] - values[-1] - 1e-5
    plain = copy.deepcopy(exact).to(torch.float16)

    generated = []
    with flipped(exact, [tie]):
        for _ in range(12):
            generated.append(int(teacher_forced_logits(exact, prompt + generated, 1)[-1].argmax()))
        flipped_logits = teacher_forced_logits(exact, prompt + generated, len(generated) + 1)[:-1]

    with monkeypatch.context() as m:
        m.setattr(greedy_oracle, "MAX_FLIPPED_TIES", 0)
        assert check_sequence(exact, plain, prompt, generated).failures  # the tie matters here
    result = check_sequence(exact, plain, prompt, generated)
    assert result.failures == [] and result.flipped == (tie,) and result.decisive >= 6

    top2 = flipped_logits.topk(2, dim=-1)
    clearest = int((top2.values[:, 0] - top2.values[:, 1]).argmax())  # the widest margin under that routing
    wrong = generated[:clearest] + [int(top2.indices[clearest, 1])] + generated[clearest + 1:]
    assert check_sequence(exact, plain, prompt, wrong).failures
