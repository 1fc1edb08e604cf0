"""Kernels fit the shared memory of their arch's blocks: a spec whose kernel would compile and then
fail to launch is refused when it is made, and MLA takes fewer rows a CTA where blocks hold less."""

from __future__ import annotations

import pytest

from flashjit import DecodeSpec
from flashjit.errors import SpecError
from flashjit.kernels.mla.spec import MLASpec
from flashjit.kernels.mla.tiling import mla_tiling
from flashjit.jit.arch import ARCHS, BLOCK_SHARED_BYTES, dynamic_shared_limit
from flashjit.kernels.decode.tiling import decode_tiling


def test_a_decode_kernel_past_its_archs_shared_memory_is_refused_naming_where_it_fits():
    with pytest.raises(SpecError, match=r"arch='sm_89'.*accepted: sm_80, sm_87, sm_90, sm_90a, sm_100 for "
                                        r"decode_d512_bf16_kvbf16.*101376 in all"):
        DecodeSpec(head_dim=512, arch="sm_89")
    for spec in (DecodeSpec(head_dim=512, kv_dtype="e4m3", arch="sm_89"), DecodeSpec(head_dim=512, arch="sm_80")):
        assert decode_tiling(spec).smem_bytes <= dynamic_shared_limit(spec.arch)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256, 512])
@pytest.mark.parametrize("kv_dtype", ["bf16", "e4m3"])
def test_every_tensor_core_spec_made_fits_its_arch(arch, head_dim, kv_dtype):
    """Refused or within the limit, never a spec that cannot launch; what a 99 KB block refuses is
    head_dim 512 over a 16-bit cache alone."""
    for group_size, max_q_len in ((1, 1), (8, 1), (16, 4)):
        try:
            spec = DecodeSpec(head_dim=head_dim, kv_dtype=kv_dtype, group_size=group_size, max_q_len=max_q_len,
                              arch=arch, tensor_cores=True)
        except SpecError:
            assert (head_dim, kv_dtype) == (512, "bf16") and BLOCK_SHARED_BYTES[arch] < 110_000
            continue
        assert decode_tiling(spec).smem_bytes <= dynamic_shared_limit(arch)


@pytest.mark.parametrize("arch, rows", [("sm_90", 64), ("sm_100", 64), ("sm_80", 32), ("sm_87", 32), ("sm_89", 16),
                                        ("sm_86", 16), ("sm_120", 16)])
def test_mla_takes_fewer_rows_a_cta_where_blocks_hold_less(arch, rows):
    spec = MLASpec(num_heads=128, arch=arch)
    tiling = mla_tiling(spec)
    assert tiling.rows == rows and tiling.row_tiles == 128 // rows
    assert tiling.smem_bytes <= dynamic_shared_limit(arch)


def test_an_mla_kernel_that_fits_no_row_count_is_refused():
    with pytest.raises(SpecError, match=r"MLASpec.arch='sm_89'.*mla_c512_r64_h16_bf16_kve4m3"):
        MLASpec(num_heads=16, kv_dtype="e4m3", arch="sm_89")
