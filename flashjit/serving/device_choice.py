"""The device and arch a decoder serves, shared by BatchDecode and BatchDecodeMLA."""

from __future__ import annotations

from .. import validation


def decoder_device(torch, device, arch: str | None):
    """(device, arch): a CUDA device, its index made explicit (the current device when none is
    given), and arch, by default the device's own (sm_XY). A CPU device needs an explicit arch:
    it serves tests that plan without a GPU."""
    device = torch.device(device)
    if device.type != "cuda" and (arch is None or device.type != "cpu"):
        validation.fail("device", "a CUDA device", device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device, arch if arch is not None else "sm_%d%d" % torch.cuda.get_device_capability(device)
