"""The layer row's pieces on the CPU: the projections around attention, SDPA reading a live q, the speed-ups."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

from benchmarks import layer, peers
from benchmarks.cases import Case
from benchmarks.inputs import build_inputs, reference
from benchmarks.measure import row_problem
from flashjit.deploy.random_batches import rel_error

CASE = Case("layer b3 L40", 3, 40, heads_qo=4, heads_kv=2, head_dim=64)


def cpu_layer():
    proj = layer.Projections(torch, CASE, device="cpu")
    batch = build_inputs(torch, CASE, device="cpu")
    batch.q = proj.q
    return proj, batch


def test_attention_reads_q_in_place_from_the_qkv_projection():
    proj, _ = cpu_layer()
    proj.project_qkv()
    assert proj.q.data_ptr() == proj.qkv.data_ptr() and proj.q.shape == (3, 4, 64)
    assert torch.equal(proj.q.reshape(3, -1), (proj.x @ proj.w_qkv)[:, :256])


def test_a_layer_step_is_qkv_gemm_attention_output_gemm():
    proj, batch = cpu_layer()
    step = layer.layer_step(proj, peers.sdpa(torch, batch, CASE, backend=SDPBackend.MATH, live_q=True).eager)
    y = step.call()
    assert y.data_ptr() == proj.y.data_ptr()
    expected = proj.reference(reference(batch, CASE, None))
    assert row_problem(y, expected, layer.LAYER_TOLERANCE)[1] is None
    y[1, :64] = 0  # one head of one token's attention lost: that token's row is off
    assert "(token, head) (1, 0)" in row_problem(y, expected, layer.LAYER_TOLERANCE)[1]
    gemms = layer.layer_step(proj, None)
    assert row_problem(gemms.call(), proj.reference(proj.q), layer.LAYER_TOLERANCE)[1] is None
    assert gemms.before_replay is None


def test_live_q_sdpa_follows_q_and_the_default_keeps_its_copy():
    proj, batch = cpu_layer()
    proj.project_qkv()
    live = peers.sdpa(torch, batch, CASE, backend=SDPBackend.MATH, live_q=True).eager
    copied = peers.sdpa(torch, batch, CASE, backend=SDPBackend.MATH).eager
    before = copied.call().clone()
    proj.x.mul_(-1)
    proj.project_qkv()
    assert torch.equal(copied.call(), before)
    assert rel_error(live.call(), reference(batch, CASE, None)) < 1e-2
    assert not torch.allclose(live.call(), before)


def test_speedups_are_peer_time_over_flashjit_time_for_timed_peers():
    row = {"impls": {"flashjit": 50.0, layer.GEMMS_ONLY: 30.0, "sdpa-cudnn": 55.0, "fa3": "rel error 1e-1"}}
    assert layer.speedups(row) == {"sdpa-cudnn": 1.1}
    assert layer.speedups({"impls": {"flashjit": "failed", "fa3": 10.0}}) == {}


@pytest.mark.parametrize("batches", ["0", "1,x", ""])
def test_bad_batches_are_refused_by_name(batches, capsys):
    with pytest.raises(SystemExit):
        layer.main(["--batches", batches])
    assert "--batches" in capsys.readouterr().err
