"""The device and arch a decoder serves, shared by BatchDecode and BatchDecodeMLA."""

from __future__ import annotations

from .. import validation


# What a machine without a CUDA device can do instead of decoding on it.
ON_THE_CPU = ("on the CPU, flashjit.serving.reference.decode_reference computes the same attention in torch, and "
              "`flashjit prewarm --arch sm_90` compiles the kernels for a GPU host")


def decoder_device(torch, device, arch: str | None, who: str = "BatchDecode"):
    """(device, arch): a CUDA device, its index made explicit (the current device when none is
    given), and arch, by default the device's own (sm_XY). A CPU device needs an explicit arch:
    it serves tests that plan without a GPU. A CUDA device torch cannot use is refused naming
    what is missing (validation.require_cuda)."""
    device = torch.device(device)
    if device.type != "cuda" and (arch is None or device.type != "cpu"):
        validation.fail("device", "a CUDA device", device)
    validation.require_cuda(torch, device, who, ON_THE_CPU)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device, arch if arch is not None else "sm_%d%d" % torch.cuda.get_device_capability(device)
