"""On a machine without a usable CUDA device, the entry points that need one say so, naming what is
missing and what to do instead, before anything is created: not torch's raw "not compiled with CUDA"."""

from __future__ import annotations

import pytest
import torch

from flashjit import validation
from flashjit.masks.sink_window import sink_window_params
from flashjit.masks.tree import pack_tree_mask
from flashjit.serving import batch_decode, batch_mla
from flashjit.serving import decoder as decoder_module

needs_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is usable here")
NO_CUDA = r"^no CUDA device: {who} needs one \((torch .* is built without CUDA|torch finds no CUDA GPU)"


@pytest.fixture
def no_engine_made(monkeypatch):
    """Fails the test if a decoder makes its default engine (the state a refused device must not touch)."""
    made = []
    monkeypatch.setattr(decoder_module, "default_engine", lambda: made.append(1))
    yield
    assert made == []


@needs_cpu_only
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)])
@pytest.mark.parametrize("decoder", [batch_decode.BatchDecode, batch_mla.BatchDecodeMLA])
def test_a_decoder_on_cuda_names_what_is_missing(no_engine_made, decoder, device):
    with pytest.raises(RuntimeError, match=NO_CUDA.format(who=decoder.__name__)) as info:
        decoder(device=device)
    assert "decode_reference computes the same attention" in str(info.value)
    assert "flashjit prewarm --arch sm_90" in str(info.value)


@needs_cpu_only
def test_the_default_device_is_refused_the_same_way(no_engine_made):
    with pytest.raises(RuntimeError, match=NO_CUDA.format(who="BatchDecode")):
        batch_decode.BatchDecode()


@needs_cpu_only
@pytest.mark.parametrize("make, who", [
    (lambda: pack_tree_mask([[-1, 0]]), "pack_tree_mask\\(device='cuda'\\)"),
    (lambda: sink_window_params([100], num_sink=4, window_left=16), "sink_window_params\\(device='cuda'\\)"),
])
def test_mask_parameter_builders_name_what_is_missing(make, who):
    with pytest.raises(RuntimeError, match=NO_CUDA.format(who=who)) as info:
        make()
    assert str(info.value).endswith("pass device='cpu' to build the parameters on the CPU")


def test_mask_parameter_builders_build_on_the_cpu():
    assert pack_tree_mask([[-1, 0]], device="cpu")["tree_mask"].device.type == "cpu"
    assert sink_window_params([100], num_sink=4, window_left=16, device="cpu")["first_q_pos"].tolist() == [99]


@pytest.mark.parametrize("version, available, count, why", [
    (None, False, 0, r"torch .* is built without CUDA"),
    ("12.8", False, 0, r"torch finds no CUDA GPU: check the driver and CUDA_VISIBLE_DEVICES"),
    ("12.8", True, 2, r"cuda:3 does not exist: torch finds 2 CUDA devices"),
])
def test_require_cuda_says_which_part_is_missing(monkeypatch, version, available, count, why):
    monkeypatch.setattr(torch.version, "cuda", version)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    with pytest.raises(RuntimeError, match=rf"^no CUDA device: X needs one \({why}\); do Y$"):
        validation.require_cuda(torch, torch.device("cuda", 3), "X", "do Y")
    validation.require_cuda(torch, torch.device("cpu"), "X", "do Y")  # not a CUDA device: nothing to check
