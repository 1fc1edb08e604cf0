"""Engine: memory, then disk, then compile; one log line per compile; prewarm; strict mode; threads."""

from __future__ import annotations

import os
import threading

import pytest

import flashjit.jit.engine as engine_module
from flashjit import DecodeSpec, Engine, KernelNotPrewarmed, PrewarmResult, register_mask
from flashjit.jit.engine import prewarm_command


def test_memory_hit_returns_same_object(warm, compile_log):
    assert warm.engine.get_kernel(warm.spec) is warm.kernel
    assert warm.engine.get_kernel(DecodeSpec.from_name(warm.spec.name)) is warm.kernel  # equal spec, same kernel
    assert compile_log() == []


def test_kernel_fields(warm):
    kernel = warm.kernel
    assert kernel.spec == warm.spec and kernel.mask.name == warm.spec.mask
    assert kernel.cubin[:4] == b"\x7fELF" and len(kernel.key) == 64
    assert warm.spec.name in repr(kernel)


def test_second_engine_loads_from_disk_without_compiling(warm, compile_log):
    other = Engine(cache_dir=warm.cache_dir)
    (result,) = other.prewarm([warm.spec])
    assert result.source == "disk"
    kernel = other.get_kernel(warm.spec)
    assert kernel is not warm.kernel
    assert kernel.cubin == warm.kernel.cubin and kernel.key == warm.kernel.key
    assert compile_log() == []


def test_every_compile_logs_one_info_line(engine, compile_log):
    specs = [DecodeSpec(128, mask="causal", arch="sm_90"), DecodeSpec(128, mask="causal", arch="sm_80")]
    for n, spec in enumerate(specs, 1):
        engine.get_kernel(spec)
        engine.get_kernel(spec)
        assert len(compile_log()) == n
        assert spec.name in compile_log()[-1] and spec.arch in compile_log()[-1]


def test_prewarm_reports_compiled_then_disk_then_memory(engine, cache_dir, compile_log):
    specs = [DecodeSpec(64, mask="causal", arch="sm_80"), DecodeSpec(64, mask="sliding_window", arch="sm_80")]
    seen = []
    first = engine.prewarm(specs + specs[:1], jobs=2, on_done=seen.append)  # duplicates are built once
    assert [r.spec for r in first] == specs
    assert [r.source for r in first] == ["compiled", "compiled"]
    assert all(isinstance(r, PrewarmResult) and r.seconds > 0 for r in first)
    assert sorted(r.spec.name for r in seen) == sorted(s.name for s in specs)
    assert len(compile_log()) == 2

    assert [r.source for r in engine.prewarm(specs, jobs=2)] == ["memory", "memory"]
    assert [r.source for r in Engine(cache_dir=cache_dir).prewarm(specs, jobs=2)] == ["disk", "disk"]
    assert len(compile_log()) == 2


def test_allow_compile_false_on_empty_cache(cache_dir, compile_log):
    spec = DecodeSpec(128, mask="causal", arch="sm_90")
    engine = Engine(cache_dir=cache_dir, allow_compile=False)
    with pytest.raises(KernelNotPrewarmed) as info:
        engine.get_kernel(spec)
    message = str(info.value)
    assert spec.name in message and "flashjit prewarm" in message and str(cache_dir) in message
    assert prewarm_command(spec, cache_dir) in message
    assert compile_log() == []
    assert engine.cache.entries() == []


def test_no_compile_env(cache_dir, monkeypatch):
    monkeypatch.setenv("FLASHJIT_NO_COMPILE", "1")
    assert Engine(cache_dir=cache_dir).allow_compile is False
    assert Engine(cache_dir=cache_dir, allow_compile=True).allow_compile is True  # the argument wins
    with pytest.raises(KernelNotPrewarmed):
        Engine(cache_dir=cache_dir).get_kernel(DecodeSpec(64, arch="sm_90"))
    monkeypatch.setenv("FLASHJIT_NO_COMPILE", "0")
    assert Engine(cache_dir=cache_dir).allow_compile is True


def test_allow_compile_false_still_serves_the_cache(warm, compile_log):
    strict = Engine(cache_dir=warm.cache_dir, allow_compile=False)
    assert strict.get_kernel(warm.spec).cubin == warm.kernel.cubin
    with pytest.raises(KernelNotPrewarmed):
        strict.get_kernel(warm.spec.replace(group_size=2))
    assert compile_log() == []


def test_threads_compile_once(engine, compile_log):
    spec = DecodeSpec(128, mask="sliding_window", group_size=4, arch="sm_90")
    barrier, kernels, errors = threading.Barrier(4), [], []

    def worker():
        try:
            barrier.wait(10)
            kernels.append(engine.get_kernel(spec))
        except Exception as exc:  # surfaced below; a thread's exception is otherwise lost
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert len(kernels) == 4 and all(k is kernels[0] for k in kernels)
    assert len(compile_log()) == 1


def test_source_is_the_rendered_kernel(warm):
    source = warm.engine.source(warm.spec)
    assert warm.spec.name in source and "flashjit_decode" in source


def test_warm_process_skips_render_and_nvrtc(warm, monkeypatch, compile_log):
    """The cache index finds a compiled kernel from the spec and template digests alone."""
    def forbidden(*args, **kwargs):
        raise AssertionError("a warm lookup must not render or load NVRTC")

    monkeypatch.setattr(engine_module, "source_of", forbidden)  # every family renders through it
    monkeypatch.setattr(engine_module, "nvrtc_version", forbidden)
    (result,) = Engine(cache_dir=warm.cache_dir, allow_compile=False).prewarm([warm.spec])
    assert result.source == "disk"
    assert compile_log() == []


def test_edited_user_mask_is_not_served_stale(isolated_masks, tmp_path, cache_dir, compile_log):
    path = tmp_path / "edit_me.cuh.j2"
    path.write_text('{% extends "masks/base.cuh.j2" %}\n{% block visible %}  return kv_pos < 8;{% endblock %}\n')
    register_mask("edit_me", path)
    spec = DecodeSpec(64, mask="edit_me", arch="sm_90")
    before = Engine(cache_dir=cache_dir).get_kernel(spec)
    path.write_text('{% extends "masks/base.cuh.j2" %}\n{% block visible %}  return kv_pos < 9;{% endblock %}\n')
    os.utime(path, ns=(1, 1))
    after = Engine(cache_dir=cache_dir).get_kernel(spec)  # a fresh process would see the edit too
    assert after.key != before.key and after.cubin != before.cubin
    assert len(compile_log()) == 2


def test_a_mask_replaced_in_the_process_is_not_served_stale(isolated_masks, cache_dir, mask_file, tmp_path,
                                                            fake_nvrtc):
    """register_mask(replace=True) after get_kernel: the same engine builds the new definition, and
    keeps the kernels of the masks left alone."""
    register_mask("swap_me", mask_file(tmp_path / "1", "swap_me", "return kv_pos < 8;"))
    engine = Engine(cache_dir=cache_dir)
    spec, other = DecodeSpec(64, mask="swap_me", arch="sm_90"), DecodeSpec(64, mask="causal", arch="sm_90")
    before, kept = engine.get_kernel(spec), engine.get_kernel(other)
    register_mask("swap_me", mask_file(tmp_path / "2", "swap_me", "return kv_pos < 9;"), replace=True)
    after = engine.get_kernel(spec)
    assert after.cubin != before.cubin and after.mask == isolated_masks.get("swap_me")
    assert engine.get_kernel(other) is kept and len(fake_nvrtc) == 3


def test_nvrtc_upgrade_is_not_served_a_stale_cubin(warm, cache_dir, monkeypatch, fake_nvrtc):
    """The index key holds the compiler fingerprint: after a CuPy/NVRTC upgrade the index misses,
    and the full key (with the new NVRTC version) finds no entry, so the kernel is rebuilt."""
    warm.copy_entry_to(cache_dir)
    assert Engine(cache_dir=cache_dir, allow_compile=False).get_kernel(warm.spec).key == warm.kernel.key
    monkeypatch.setattr(engine_module, "compiler_fingerprint", lambda: "cupy-cuda12x=99.0;nvidia-cuda-nvrtc-cu12=99.0")
    monkeypatch.setattr(engine_module, "nvrtc_version", lambda: (99, 0))
    kernel = Engine(cache_dir=cache_dir).get_kernel(warm.spec)
    assert fake_nvrtc == [warm.spec.name]
    assert kernel.key != warm.kernel.key and kernel.cubin != warm.kernel.cubin


def test_strict_mode_serves_a_cubin_built_by_another_nvrtc(cache_dir, monkeypatch, fake_nvrtc):
    """A bundle from a build box with another CUDA: strict serving takes its cubin (valid for the
    arch) instead of failing; with compiling allowed, this host's NVRTC rebuilds it."""
    spec = DecodeSpec(128, "bf16", group_size=4, page_size=16, arch="sm_90")
    built = Engine(cache_dir=cache_dir).get_kernel(spec)
    monkeypatch.setattr(engine_module, "compiler_fingerprint", lambda: "cupy-cuda13x=99.0;nvidia-cuda-nvrtc=99.0")
    monkeypatch.setattr(engine_module, "nvrtc_version", lambda: (99, 0))
    served = Engine(cache_dir=cache_dir, allow_compile=False).get_kernel(spec)
    assert served.key == built.key and served.cubin == built.cubin and fake_nvrtc == [spec.name]
    rebuilt = Engine(cache_dir=cache_dir).get_kernel(spec)
    assert rebuilt.key != built.key and fake_nvrtc == [spec.name, spec.name]


def test_index_naming_another_specs_entry_is_a_miss(warm, cache_dir, monkeypatch, fake_nvrtc):
    """A damaged (or foreign) index file never hands out another spec's kernel."""
    warm.copy_entry_to(cache_dir)
    other = warm.spec.replace(page_size=32)
    spec_key = engine_module._spec_key(other, engine_module.masks.get(other.mask))
    Engine(cache_dir=cache_dir).cache.store_index(spec_key, warm.kernel.key)
    kernel = Engine(cache_dir=cache_dir).get_kernel(other)
    assert fake_nvrtc == [other.name] and kernel.key != warm.kernel.key


def test_prewarm_command_quotes_the_cache_dir(tmp_path):
    spec = DecodeSpec(64, arch="sm_90")
    assert prewarm_command(spec, tmp_path / "a b") == f"flashjit prewarm --spec {spec.name} --cache-dir '{tmp_path}/a b'"


def test_strict_error_for_a_mask_registered_from_python(tmp_path, cache_dir, isolated_masks, mask_file):
    path = mask_file(tmp_path, "some_file", "return kv_pos != 3;")
    register_mask("not_three", path)
    spec = DecodeSpec(64, mask="not_three", arch="sm_90")
    with pytest.raises(KernelNotPrewarmed) as info:
        Engine(cache_dir=cache_dir, allow_compile=False).get_kernel(spec)
    assert prewarm_command(spec, cache_dir).startswith("flashjit prewarm")  # no template folder would find it
    assert "registered from Python" in str(info.value) and str(path) in str(info.value)
