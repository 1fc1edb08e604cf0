"""The test-only kernel faults (tests/fault_injection.py) on the CPU: each finds its anchors in the
kernels of every path and the faulted source compiles; with no fault active the engine builds
exactly what render() gives, the package carries no trace of them, and a faulted kernel lives under
keys of its own, so an engine without the fault never gets it from a shared cache."""

from __future__ import annotations

from pathlib import Path

import pytest

import flashjit
from fault_injection import FAULTS, PATHS, AnchorMissing, faulted_engine, inject, parse, path_of
from flashjit import DecodeSpec, Engine
from flashjit.jit.compile import compile_source
from flashjit.jit.family import mask_of, source_of, variant_of
from flashjit.kernels.merge_states.spec import MergeSpec
from flashjit.kernels.mla.spec import MLASpec

SPECS = {  # one kernel of each path, as plan() picks them on an sm_90 GPU
    "cuda_cores": DecodeSpec(128, group_size=1, arch="sm_90", tensor_cores=False),
    "tensor_cores": DecodeSpec(128, group_size=4, mask="causal", arch="sm_90"),
    "fp8": DecodeSpec(128, kv_dtype="e4m3", group_size=4, arch="sm_90"),
    "mla": MLASpec(num_heads=16, arch="sm_90"),
    "shared_prefix": DecodeSpec(128, group_size=4, mask="causal", arch="sm_90", shared_prefix=True),
}
MORE = [DecodeSpec(64, kv_dtype="e5m2", arch="sm_90", tensor_cores=False), MLASpec(num_heads=128, arch="sm_90"),
        MLASpec(num_heads=64, kv_dtype="e4m3", arch="sm_90")]


def source(spec) -> str:
    return source_of(spec, mask_of(spec), variant_of(spec))


def test_every_path_has_a_spec_here():
    assert {path_of(spec) for spec in SPECS.values()} == set(PATHS) == set(SPECS)
    assert path_of(MergeSpec("bf16", arch="sm_90")) is None


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("path", PATHS)
def test_each_fault_edits_each_paths_kernel_and_it_still_compiles(tmp_path, fault, path):
    spec = SPECS[path]
    clean = source(spec)
    broken = inject(clean, fault)
    assert broken != clean and broken.startswith(f"// test fault: {fault}\n")
    changed = [line for line in broken.splitlines() if line not in clean.splitlines()]
    assert changed and all("test fault" in line or "fj_test_fault_page" in line for line in changed)
    compile_source(broken, spec.compile_arch, spec.name, failed_source_dir=tmp_path)  # raises CompileError


@pytest.mark.parametrize("spec", MORE, ids=lambda s: s.name)
def test_faults_reach_the_other_kernel_shapes(spec):
    for fault in FAULTS:
        assert inject(source(spec), fault) != source(spec)


def test_a_source_without_the_anchors_says_so():
    with pytest.raises(AnchorMissing, match="skip_item"):
        inject("// nothing here", "skip_item")
    with pytest.raises(ValueError, match="fault: expected one of"):
        inject("", "flip_bits")
    with pytest.raises(ValueError, match=r"expected FAULT:PATH .*'page_off_by_one'.*'shared_prefix'"):
        parse("page_off_by_one:tensor")
    assert parse("drop_partial:mla") == ("drop_partial", "mla")


def test_no_fault_no_change_and_none_in_the_package():
    engine = Engine(cache_dir="/nonexistent")  # source() renders only
    for spec in [*SPECS.values(), *MORE]:
        assert engine.source(spec) == source(spec)
        assert "test fault" not in engine.source(spec)
        with faulted_engine("skip_item", "tensor_cores" if path_of(spec) != "tensor_cores" else "fp8"):
            assert engine.source(spec) == source(spec)  # another path's fault leaves it alone
    package = Path(flashjit.__file__).resolve().parent
    for folder in (package, package.parent / "templates"):
        for path in folder.rglob("*"):
            if path.suffix in (".py", ".cuh", ".j2", ".cu", ".c"):
                text = path.read_text()
                assert "test fault" not in text and "fault_injection" not in text, path


def test_a_faulted_kernel_has_keys_of_its_own_and_a_clean_engine_never_gets_it(cache_dir, fake_nvrtc):
    spec = SPECS["tensor_cores"]
    with faulted_engine("page_off_by_one", "tensor_cores"):
        faulted = Engine(cache_dir=cache_dir).get_kernel(spec)
        assert "fj_test_fault_page" in Engine(cache_dir=cache_dir).source(spec)
    clean = Engine(cache_dir=cache_dir).get_kernel(spec)  # the faulted entry and index are on disk
    assert clean.key != faulted.key and clean.cubin != faulted.cubin
    assert len(fake_nvrtc) == 2  # the clean engine compiled its own
    stored = (Engine(cache_dir=cache_dir).cache.entry_dir(clean.key) / "source.cu").read_text()
    assert stored == source(spec)
    with faulted_engine("page_off_by_one", "tensor_cores"):
        again = Engine(cache_dir=cache_dir).get_kernel(spec)  # its own index entry, from disk
    assert again.key == faulted.key and len(fake_nvrtc) == 2
    assert Engine(cache_dir=cache_dir).get_kernel(spec).key == clean.key


def test_the_fault_matrix_reads_failures_and_fails_a_fault_no_test_saw(tmp_path, monkeypatch):
    from gpu import fault_matrix

    report = tmp_path / "r.xml"
    report.write_text('<testsuites><testsuite><testcase classname="gpu.test_a" name="t1"><failure/></testcase>'
                      '<testcase classname="gpu.test_a" name="t2"/><testcase classname="gpu.test_b" name="t3">'
                      '<error/></testcase><testcase classname="gpu.test_b" name="t4"><skipped/></testcase>'
                      '</testsuite></testsuites>')
    assert fault_matrix.outcomes(report) == {"failed": ["gpu.test_a::t1"], "errors": ["gpu.test_b::t3"], "passed": 1}
    assert fault_matrix.outcomes(tmp_path / "missing.xml") == {"failed": [], "errors": [], "passed": 0}
    assert set(fault_matrix.SUITES) == set(PATHS)
    caught = {"failed": ["gpu.test_a::t1"], "errors": [], "passed": 3}
    seen = {}
    monkeypatch.setattr(fault_matrix, "run", lambda fault, path, *a: seen.setdefault((fault, path), {
        "rc": 1, "seconds": 1.0, **(caught if (fault, path) != ("skip_item", "mla") else {**caught, "failed": []})}))
    assert fault_matrix.main(["--out", str(tmp_path / "out")]) == 1  # skip_item on mla was caught by nothing
    assert len(seen) == len(FAULTS) * len(PATHS)
    assert "| skip_item | mla | 0:  | 0 |" in (tmp_path / "out" / "faults.md").read_text()
    assert fault_matrix.main(["--out", str(tmp_path / "out"), "--faults", "drop_partial"]) == 0
