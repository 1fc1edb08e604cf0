"""Random bit flips in every metadata file of a small cache (meta.json, index and portable files):
no exception escapes get_kernel, `flashjit list`, prune or export, and no wrong kernel is served.

The cache holds two entries, WARM_SPEC's real one and a second spec's fake one, with their index
and portable files. Each flip is made on a fresh copy of it; the seed is fixed so a failure repeats.
"""

from __future__ import annotations

import argparse
import functools
import random
import shutil
import tarfile

import pytest

import flashjit.jit.engine as engine_module
from flashjit import Engine, KernelNotPrewarmed
from flashjit.deploy.cli_cache import cmd_list
from flashjit.deploy.bundle import export_bundle
from flashjit.jit.cache import KernelCache
from flashjit.jit.compile import CompiledKernel
from flashjit.jit.render import render

from fake_cubins import fake_cubin

FLIPS = 320
SEED = 21


@pytest.fixture(scope="module")
def small_cache(warm, tmp_path_factory):
    """(cache dir, {spec: cubin}, {entry key: cubin}) of a two-entry cache; not modified by the tests."""
    cache_dir = tmp_path_factory.mktemp("fuzz-cache")
    warm.copy_entry_to(cache_dir)
    shutil.copytree(warm.engine.cache.base / "portable", KernelCache(cache_dir).base / "portable", dirs_exist_ok=True)
    other = warm.spec.replace(page_size=32)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module, "compile_source",
                      lambda source, arch, name, **kwargs: CompiledKernel(fake_cubin(source, arch), ""))
        other_kernel = Engine(cache_dir=cache_dir).get_kernel(other)
    assert other_kernel.cubin == fake_cubin(render(other), other.arch)
    cubins = {warm.spec: warm.kernel.cubin, other: other_kernel.cubin}
    by_key = {warm.kernel.key: warm.kernel.cubin, other_kernel.key: other_kernel.cubin}
    return cache_dir, cubins, by_key


def metadata_files(cache_dir):
    base = KernelCache(cache_dir).base
    return sorted([*base.glob("entries/*/meta.json"), *base.glob("index/*"), *base.glob("portable/*")])


def test_bit_flips_in_metadata_never_raise_nor_serve_a_wrong_kernel(small_cache, tmp_path, capsys, monkeypatch):
    pristine, cubins, by_key = small_cache
    # the fastest gzip level: the bundle's compression is not under test, and level 9 is most of the run time
    monkeypatch.setattr(tarfile, "open", functools.partial(tarfile.open, compresslevel=1))
    files = [path.relative_to(pristine) for path in metadata_files(pristine)]
    assert len(files) == 6  # two entries, each with meta.json, an index file and a portable file
    rng = random.Random(SEED)
    served = misses = 0
    work = tmp_path / "cache"
    for flip in range(FLIPS):
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(pristine, work)
        target = work / rng.choice(files)
        data = bytearray(target.read_bytes())
        position, bit = rng.randrange(len(data)), rng.randrange(8)
        data[position] ^= 1 << bit
        target.write_bytes(bytes(data))
        where = f"flip {flip}: {target.relative_to(work)} byte {position} bit {bit} (seed {SEED})"

        engine = Engine(cache_dir=work, allow_compile=False)
        for spec, cubin in cubins.items():
            try:
                assert engine.get_kernel(spec).cubin == cubin, where
                served += 1
            except KernelNotPrewarmed:
                misses += 1
        cache = KernelCache(work)
        for entry in cache.entries():
            assert cache.load(entry["key"])[0] == by_key[entry["key"]], where
        assert cmd_list(argparse.Namespace(cache_dir=work, json=flip % 2 == 0)) == 0, where  # `flashjit list`
        assert cache.usage()["entries"] == len(cache.entries()), where  # `flashjit cache info`
        assert export_bundle(tmp_path / "out.tar.gz", work).entries, where
        cache.prune(max_bytes=1 << 30)
        capsys.readouterr()
    assert served > misses > 0  # most flips leave a way to the right kernel; some leave none
