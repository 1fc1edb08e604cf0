"""The C host planner's structs (worklist/native/host_plan.c) have the layout of their ctypes mirrors
(worklist/host.py), as the kernels' argument structs have theirs (tests/test_abi.py): a check file
includes the C source and _Static_asserts each struct's size and each field's offset, size and kind,
generated from the mirror; a mirror that differs from the C side fails the compile, naming the field."""

from __future__ import annotations

import ctypes
import subprocess

import pytest

from flashjit.jit import host_library
from flashjit.worklist import host, record

MIRRORS = (host.PlanParams, host.SharedParams, host.StagingLayout)
KINDS = {ctypes.c_void_p: ("FJ_IS_POINTER", "a pointer"), ctypes.c_int64: ("FJ_IS_INT64", "int64_t")}
PRELUDE = f"""\
#include <stddef.h>
#include "{record.HOST_PLAN_SOURCE}"
#define FJ_IS_INT64(x) _Generic((x), int64_t: 1, default: 0)
#define FJ_IS_POINTER(x) _Generic((x), int64_t: 0, int32_t: 0, double: 0, float: 0, default: 1)
"""

needs_cc = pytest.mark.skipif(host_library.compiler() is None, reason="no C compiler on this machine")


def layout_asserts(struct: type[ctypes.Structure]) -> list[str]:
    """_Static_asserts that the C struct struct._c_name_ has struct's size and, field by field, its
    offsets, sizes and kinds."""
    c_struct, origin = struct._c_name_, f"flashjit.worklist.host.{struct.__name__}"
    size = ctypes.sizeof(struct)
    checks = [f'_Static_assert(sizeof({c_struct}) == {size}, "{c_struct} is not {size} bytes ({origin})");']
    for name, ctype in struct._fields_:
        offset, is_kind, kind = getattr(struct, name).offset, *KINDS[ctype]
        member = f"(({c_struct} *)0)->{name}"
        checks.append(f"_Static_assert(offsetof({c_struct}, {name}) == {offset} && sizeof({member}) == "
                      f"{ctypes.sizeof(ctype)} && {is_kind}({member}), "
                      f'"{c_struct}.{name} is not {origin}.{name} (offset {offset}, {kind})");')
    return checks


def compile_errors(tmp_path, mirrors=MIRRORS) -> str:
    """The C compiler's errors on the check file ('' when the layouts agree)."""
    check = tmp_path / "layout_check.c"
    check.write_text(PRELUDE + "\n".join(line for mirror in mirrors for line in layout_asserts(mirror)) + "\n")
    result = subprocess.run([*host_library.compiler(), "-std=c11", "-fsyntax-only", *record.HOST_PLAN_DEFINES,
                             str(check)], capture_output=True, text=True, timeout=120)
    return "" if result.returncode == 0 else result.stderr


def like(struct, fields):
    return type(struct.__name__, (ctypes.Structure,), {"_c_name_": struct._c_name_, "_fields_": fields})


def test_every_mirror_names_its_c_struct_and_covers_each_field():
    assert [m._c_name_ for m in MIRRORS] == ["fj_plan_t", "fj_shared_t", "fj_layout_t"]
    source = record.HOST_PLAN_SOURCE.read_text()
    for mirror in MIRRORS:
        assert f"}} {mirror._c_name_};" in source
        assert len(layout_asserts(mirror)) == len(mirror._fields_) + 1


@needs_cc
def test_the_c_structs_have_the_mirrors_layout(tmp_path):
    assert compile_errors(tmp_path) == ""


@needs_cc
def test_two_swapped_fields_fail_the_check_naming_them(tmp_path):
    fields = list(host.PlanParams._fields_)
    names = [name for name, _ in fields]
    i, j = names.index("page_size"), names.index("q_len")
    fields[i], fields[j] = fields[j], fields[i]
    errors = compile_errors(tmp_path, (like(host.PlanParams, fields),))
    assert "fj_plan_t.page_size is not flashjit.worklist.host.PlanParams.page_size" in errors
    assert "fj_plan_t.q_len is not" in errors


@needs_cc
def test_a_pointer_mirrored_as_an_integer_fails_the_check(tmp_path):
    fields = [(name, ctypes.c_int64 if name == "slots" else ctype) for name, ctype in host.SharedParams._fields_]
    assert "fj_shared_t.slots is not flashjit.worklist.host.SharedParams.slots" in compile_errors(
        tmp_path, (like(host.SharedParams, fields),))


@needs_cc
def test_a_field_missing_from_the_mirror_fails_the_check(tmp_path):
    errors = compile_errors(tmp_path, (like(host.StagingLayout, host.StagingLayout._fields_[:-1]),))
    assert "fj_layout_t is not 40 bytes" in errors
