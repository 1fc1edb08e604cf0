"""The Python<->CUDA ABI (the families' args.py, worklist/record.py, checked by jit/abi_checks.py) is checked where it is compiled: a layout that differs
between the host's ctypes definitions and the CUDA structs fails the NVRTC compile, naming the
field, and the C planner does not build without the record width."""

from __future__ import annotations

import ctypes
import subprocess

import pytest

from flashjit import CompileError, DecodeSpec
from flashjit.serving import buffers, plan_state
from flashjit.worklist import host as host_planner
from flashjit.deploy.mask_check import host_replay
from flashjit.jit import host_library
from flashjit.kernels.decode import args as decode_args
from flashjit.worklist import record
from flashjit.jit.compile import compile_source
from flashjit.jit.render import render
from flashjit.masks import params, registry

# CUDA cores, so flashjit_merge is in the source, and a mask with int and pointer parameters.
SPEC = DecodeSpec(64, mask="block_sparse", arch="sm_80", tensor_cores=False)  # CUDA cores: both Args structs
HOST_PLAN = record.HOST_PLAN_SOURCE


def compile_log(tmp_path) -> str:
    """NVRTC's log of compiling SPEC's source: '' when it compiles."""
    try:
        compile_source(render(SPEC), SPEC.arch, SPEC.name, failed_source_dir=tmp_path)
    except CompileError as exc:
        return exc.log
    return ""


def like(struct: type[ctypes.Structure], fields) -> type[ctypes.Structure]:
    """A ctypes struct that claims to be struct's CUDA struct, with other fields."""
    return type(struct.__name__, (ctypes.Structure,), {"_c_name_": struct._c_name_, "_fields_": fields})


def swapped(fields, a: str, b: str) -> list:
    names = [name for name, _ in fields]
    fields = list(fields)
    i, j = names.index(a), names.index(b)
    fields[i], fields[j] = fields[j], fields[i]
    return fields


def test_every_field_of_the_argument_structs_is_checked_in_the_source():
    source = render(SPEC)
    for struct in (decode_args.DecodeArgs, decode_args.MergeArgs):
        assert f"static_assert(sizeof({struct._c_name_}) == {ctypes.sizeof(struct)}," in source
        for name, _ in struct._fields_:
            offset = getattr(struct, name).offset
            assert f"FJ_OFFSETOF({struct._c_name_}, {name}) == {offset} &&" in source
    for p in registry.masks.get("block_sparse").params:
        assert f"sizeof(MaskParams::{p.name}) == {ctypes.sizeof(params.MASK_PARAM_CTYPES[p.kind])}" in source
    assert f"#define FJ_ITEM_INTS {record.ITEM_INTS}" in source


def test_a_fused_merge_source_checks_no_merge_args():
    spec = DecodeSpec(128, group_size=4, arch="sm_90")  # tensor cores: the decode kernel merges
    assert "merge::Args" not in render(spec) and "static_assert(sizeof(decode::Args)" in render(spec)


def test_the_real_layouts_compile(tmp_path):
    assert compile_log(tmp_path) == ""


def test_two_swapped_fields_fail_the_compile(tmp_path, monkeypatch):
    monkeypatch.setattr(decode_args, "DecodeArgs", like(decode_args.DecodeArgs, swapped(decode_args.DecodeArgs._fields_,
                                                                         "num_qo_heads", "sm_scale_log2")))
    log = compile_log(tmp_path)
    assert "static assertion failed" in log
    assert "ABI: decode::Args::num_qo_heads is not flashjit.jit.abi.DecodeArgs.num_qo_heads (offset 148" in log
    assert "ABI: decode::Args::sm_scale_log2" in log


def test_two_swapped_fields_of_one_type_fail_the_compile(tmp_path, monkeypatch):
    monkeypatch.setattr(decode_args, "DecodeArgs", like(decode_args.DecodeArgs, swapped(decode_args.DecodeArgs._fields_, "k", "v")))
    log = compile_log(tmp_path)
    assert "ABI: decode::Args::k is not" in log and "ABI: decode::Args::v is not" in log


def test_a_retyped_field_fails_the_compile(tmp_path, monkeypatch):
    fields = [(name, ctypes.c_int if name == "k_scale" else ctype) for name, ctype in decode_args.DecodeArgs._fields_]
    monkeypatch.setattr(decode_args, "DecodeArgs", like(decode_args.DecodeArgs, fields))
    log = compile_log(tmp_path)
    assert "ABI: decode::Args::k_scale is not flashjit.jit.abi.DecodeArgs.k_scale" in log and "integer)" in log


def test_a_missing_merge_field_fails_the_compile(tmp_path, monkeypatch):
    monkeypatch.setattr(decode_args, "MergeArgs", like(decode_args.MergeArgs, decode_args.MergeArgs._fields_[:-1]))
    assert "ABI: merge::Args is not 72 bytes" in compile_log(tmp_path)


def test_a_mask_parameter_of_another_size_fails_the_compile(tmp_path, monkeypatch):
    monkeypatch.setitem(params.MASK_PARAM_CTYPES, "int", ctypes.c_int64)
    assert "ABI: MaskParams::block_size is not" in compile_log(tmp_path)


def test_another_record_width_fails_the_compile(tmp_path, monkeypatch):
    monkeypatch.setattr(record, "ITEM_INTS", record.ITEM_INTS + 4)
    assert "ABI: a work-item record is not the three int4 WorkItem reads" in compile_log(tmp_path)


def test_each_definition_has_one_source():
    assert buffers.DecodeArgs is plan_state.DecodeArgs is decode_args.DecodeArgs
    assert buffers.MergeArgs is plan_state.MergeArgs is decode_args.MergeArgs
    assert buffers.MASK_PARAM_CTYPES is params.MASK_PARAM_CTYPES is host_replay.MASK_PARAM_CTYPES
    assert buffers.ITEM_INTS == host_planner.ITEM_INTS == record.ITEM_INTS == len(record.WORK_ITEM_FIELDS)
    assert registry.PARAM_CTYPES is params.PARAM_CTYPES
    assert set(params.PARAM_CTYPES) == set(params.MASK_PARAM_CTYPES) == set(params.PARAM_KINDS)
    assert record.HOST_PLAN_DEFINES == (f"-DFJ_ITEM_INTS={record.ITEM_INTS}",)


@pytest.mark.skipif(host_library.compiler() is None, reason="no C compiler on this machine")
@pytest.mark.parametrize("define", [None, record.ITEM_INTS + 4, record.ITEM_INTS])
def test_the_c_planner_builds_only_with_the_record_width(define):
    flags = [] if define is None else [f"-DFJ_ITEM_INTS={define}"]
    result = subprocess.run([*host_library.compiler(), "-std=c99", "-fsyntax-only", *flags, str(HOST_PLAN)],
                            capture_output=True, text=True, timeout=60)
    if define == record.ITEM_INTS:
        assert result.returncode == 0, result.stderr
    else:
        assert result.returncode != 0 and "FJ_ITEM_INTS" in result.stderr


@pytest.mark.parametrize("block_bytes, static_bytes, batch", [
    (232_448, 17_000, record.PLAN_MAX_BATCH),  # an H100/H200's 227 KB a block: every batch the planner takes
    (101_376, 17_000, 3012),                # sm_86/sm_89's 99 KB: what fits beside the static arrays
    (17_000, 17_000, 0),                    # not one request
])
def test_the_gpu_planners_batch_fits_the_devices_shared_memory(block_bytes, static_bytes, batch):
    fits = lambda requests: record.plan_smem_bytes(requests) + static_bytes <= block_bytes  # noqa: E731
    assert record.plan_batch_limit(block_bytes, static_bytes) == batch
    assert batch == 0 or fits(batch)
    assert batch == record.PLAN_MAX_BATCH or not fits(batch + 1)  # the limit, not less


def test_the_planners_limit_reads_the_devices_opt_in_and_the_functions_static_shared_memory(monkeypatch):
    from cupy.cuda import driver, runtime

    from flashjit.kernels import worklist_kernel

    asked = []
    monkeypatch.setattr(runtime, "deviceGetAttribute",
                        lambda attribute, device: asked.append(("device", attribute, device)) or 101_376)
    monkeypatch.setattr(driver, "funcGetAttribute",
                        lambda attribute, function: asked.append(("function", attribute, function)) or 17_000)
    assert worklist_kernel.planner_batch_limit(0xF0, 3) == 3012
    assert sorted(asked) == [("device", runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, 3),
                             ("function", driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, 0xF0)]
