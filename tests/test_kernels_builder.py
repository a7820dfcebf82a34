"""The op builder's flags (CPU; no GPU or nvcc needed except where a test says so)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import echo_ds
from echo_ds.ops.builder import (CSRC_DIR, EXACT_FP_NVCC_FLAGS, HEADERS, SOURCES, EchoBuilder, cxx_std,
                                 find_nvcc, kernel_sources_dir)

REPO = Path(__file__).resolve().parents[1]


def _nvcc_args(monkeypatch, extra=None):
    if extra is None:
        monkeypatch.delenv("ECHO_DS_NVCC_EXTRA", raising=False)
    else:
        monkeypatch.setenv("ECHO_DS_NVCC_EXTRA", extra)
    builder = EchoBuilder()
    if builder.build_for_cpu:
        pytest.skip("DeepSpeed builds for the CPU here: no nvcc flags")
    return builder.nvcc_args()


def test_exact_fp_flags_and_no_fast_math(monkeypatch):
    args = _nvcc_args(monkeypatch)
    for flag in EXACT_FP_NVCC_FLAGS:
        assert flag in args
    assert not any("fast_math" in a or "use_fast" in a for a in args), args
    assert not any(a.startswith("-DECHO_") for a in args), "no kernel variant without ECHO_DS_NVCC_EXTRA"


def test_extra_flags_come_last(monkeypatch):
    args = _nvcc_args(monkeypatch, "-DECHO_CHUNK_ELEMS=4  -DECHO_MIN_BLOCKS_PER_SM=5")
    assert args[-2:] == ["-DECHO_CHUNK_ELEMS=4", "-DECHO_MIN_BLOCKS_PER_SM=5"]
    for flag in EXACT_FP_NVCC_FLAGS:
        assert flag in args


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found (set CUDA_HOME or PATH)")
def test_a_chunk_size_the_layout_does_not_take_fails_to_build(tmp_path):
    cmd = [find_nvcc(), "-c", cxx_std(), "-arch=sm_90", "-DECHO_CHUNK_ELEMS=2", "-I", str(CSRC_DIR),
           "-o", str(tmp_path / "x.o"), str(CSRC_DIR / "pow2_amax.cu")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "chunks of 4, 8 or 16 elements" in proc.stdout + proc.stderr


def test_the_builder_takes_its_sources_from_one_place():
    root = kernel_sources_dir()
    assert CSRC_DIR == root
    if Path(echo_ds.__file__).resolve().parent == REPO / "echo_ds" and not (REPO / "echo_ds" / "_csrc").exists():
        # A checkout (editable install): the top-level csrc/, edited in place, no copy.
        # (An installed wheel's echo_ds/_csrc is tested by test_packaging.py.)
        assert root == REPO / "csrc"
    builder = EchoBuilder()
    for path in builder.sources() + [str(CSRC_DIR / h) for h in HEADERS]:
        assert Path(path).is_file(), path
    assert builder.include_paths() == [str(root)]
    assert not any("kernel source" in m for m in builder.missing_requirements())


def test_every_source_and_header_of_csrc_is_the_builders():
    """One extension: csrc/ holds the builder's files and nothing else (no second build)."""
    on_disk = sorted(p.relative_to(CSRC_DIR).as_posix() for p in CSRC_DIR.rglob("*") if p.is_file())
    assert on_disk == sorted(SOURCES + HEADERS)


# ----------------------------------------------------------------------------------------------------
# Ahead-of-time build (DS_BUILD_ECHO=1) and load()'s use of the prebuilt module

def _setup_module():
    """setup.py imported under another name: its functions, without running setup()."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_echo_ds_setup_under_test", REPO / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("value", [None, "0", ""])
def test_without_ds_build_echo_setup_declares_no_extension_and_needs_no_torch(monkeypatch, value):
    import sys

    if value is None:
        monkeypatch.delenv("DS_BUILD_ECHO", raising=False)
    else:
        monkeypatch.setenv("DS_BUILD_ECHO", value)
    setup = _setup_module()
    # As in pip's isolated build environment: neither torch nor deepspeed can be imported.
    for name in ("torch", "torch.utils.cpp_extension", "deepspeed"):
        monkeypatch.setitem(sys.modules, name, None)
    assert setup.echo_ext_modules() == []
    kwargs = setup.setup_kwargs()
    assert "ext_modules" not in kwargs
    assert kwargs["cmdclass"] == {"build_py": setup.build_py_with_csrc}


def test_ds_build_echo_without_torch_says_no_build_isolation(monkeypatch):
    import sys

    monkeypatch.setenv("DS_BUILD_ECHO", "1")
    setup = _setup_module()
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(setup.AOTBuildError, match="--no-build-isolation"):
        setup.echo_ext_modules()


def test_ds_build_echo_gives_the_builders_extension_or_says_what_is_missing(monkeypatch):
    monkeypatch.setenv("DS_BUILD_ECHO", "1")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")  # the builder rewrites it; restored afterwards
    setup = _setup_module()
    builder = EchoBuilder()
    missing = builder.missing_requirements()
    if missing:  # e.g. this CPU machine: a CPU build of torch
        with pytest.raises(setup.AOTBuildError, match="cannot be built here: missing") as info:
            setup.echo_ext_modules()
        assert missing[0] in str(info.value)
        return
    (ext,) = setup.echo_ext_modules()
    assert ext.name == builder.absolute_name() == "echo_ds.ops.echo_ds_ops"
    assert [str(REPO / s) for s in ext.sources] == builder.sources()
    nvcc = ext.extra_compile_args["nvcc"]
    for flag in EXACT_FP_NVCC_FLAGS:
        assert flag in nvcc
    assert "-gencode=arch=compute_90,code=sm_90" in nvcc
    assert not any("fast_math" in a for a in nvcc)
    from torch.utils.cpp_extension import BuildExtension

    assert setup.setup_kwargs()["cmdclass"]["build_ext"] is BuildExtension


def test_the_extension_names_its_sources_relative_to_setup_py(monkeypatch):
    """setuptools rejects absolute source paths; the builder's are absolute (a CUDA-free stand-in here)."""
    import types

    from setuptools import Extension

    class Builder(EchoBuilder):
        def missing_requirements(self):
            return []

        def builder(self):
            return Extension(self.absolute_name(), sources=self.sources())

    if not kernel_sources_dir().is_relative_to(REPO):
        pytest.skip("echo_ds is imported from an installed copy, not this checkout")
    monkeypatch.setenv("DS_BUILD_ECHO", "1")
    setup = _setup_module()
    monkeypatch.setattr(setup, "_load_builder_module", lambda: types.SimpleNamespace(EchoBuilder=Builder))
    (ext,) = setup.echo_ext_modules()
    root = kernel_sources_dir().relative_to(REPO).as_posix()  # csrc (or a leftover echo_ds/_csrc)
    assert ext.sources == [f"{root}/{s}" for s in SOURCES]


@pytest.fixture
def fresh_ops(monkeypatch):
    """echo_ds.ops with no module loaded, an empty DeepSpeed op cache, and a JIT build that must not run."""
    import echo_ds.ops as ops
    from deepspeed.ops.op_builder.builder import OpBuilder

    monkeypatch.setattr(ops, "_module", None)
    monkeypatch.setattr(ops, "_load_seconds", None)
    monkeypatch.setattr(ops, "_load_kind", None)
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})
    monkeypatch.delenv("ECHO_DS_FORCE_JIT", raising=False)

    def no_jit(self, verbose=True):
        raise AssertionError("the JIT build ran")

    monkeypatch.setattr(OpBuilder, "jit_load", no_jit)
    return ops


def test_load_takes_the_prebuilt_module_without_jit(monkeypatch, fresh_ops):
    import math
    import sys
    import types

    name = EchoBuilder().absolute_name()
    fake = types.ModuleType(name)
    fake.__file__ = "/site/echo_ds/ops/echo_ds_ops.so"
    monkeypatch.setitem(sys.modules, name, fake)
    monkeypatch.setattr(fresh_ops, "unavailable_reason", lambda: None)  # no CUDA device needed here
    assert fresh_ops.load() is fake
    assert fresh_ops.load_kind() == "prebuilt"
    assert math.isfinite(fresh_ops.load_seconds())
    assert fresh_ops.build_directory() == f"prebuilt: {fake.__file__}"
    assert EchoBuilder().load() is fake  # DeepSpeed's per-process cache holds it too


def test_force_jit_skips_the_prebuilt_module(monkeypatch, fresh_ops):
    import sys
    import types

    from deepspeed.ops.op_builder.builder import OpBuilder

    name = EchoBuilder().absolute_name()
    monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setenv("ECHO_DS_FORCE_JIT", "1")
    jit = types.ModuleType(EchoBuilder.NAME)  # torch's JIT module has the bare name
    monkeypatch.setattr(OpBuilder, "jit_load", lambda self, verbose=True: jit)
    monkeypatch.setattr(fresh_ops, "unavailable_reason", lambda: None)
    assert EchoBuilder().prebuilt_spec() is None
    assert fresh_ops.load() is jit
    assert fresh_ops.load_kind() == "jit"
    assert fresh_ops.build_directory() != "prebuilt" and not fresh_ops.build_directory().startswith("prebuilt")


def test_no_prebuilt_module_means_jit_without_a_warning(fresh_ops):
    import warnings

    builder = EchoBuilder()
    if builder.prebuilt_spec() is not None:
        pytest.skip("this environment has an ahead-of-time build installed")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert builder.load_prebuilt() is None
    with pytest.raises(AssertionError, match="the JIT build ran"):
        builder.load()


def test_a_prebuilt_module_that_fails_to_import_warns_once_and_jit_builds(monkeypatch, fresh_ops):
    import importlib
    import types
    import warnings

    from deepspeed.ops.op_builder.builder import OpBuilder

    name = EchoBuilder().absolute_name()
    real = importlib.import_module

    def import_module(mod, package=None):
        if mod == name:
            raise ImportError("/site/echo_ds/ops/echo_ds_ops.so: undefined symbol: _ZN3c104cuda9SetDeviceEa")
        return real(mod, package)

    monkeypatch.setattr(importlib, "import_module", import_module)
    jit = types.ModuleType(EchoBuilder.NAME)
    monkeypatch.setattr(OpBuilder, "jit_load", lambda self, verbose=True: jit)
    monkeypatch.setattr(fresh_ops, "unavailable_reason", lambda: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fresh_ops.load() is jit
    assert fresh_ops.load_kind() == "jit"
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "failed to import" in msgs[0] and "undefined symbol" in msgs[0], msgs


def test_with_a_prebuilt_module_nvcc_is_not_required(monkeypatch):
    import torch

    import echo_ds.ops as ops
    from echo_ds.ops import builder as ops_builder

    monkeypatch.setattr(ops_builder, "find_nvcc", lambda: None)
    without = ops.unavailable_reason()
    assert without is not None and "nvcc" in without
    monkeypatch.setattr(EchoBuilder, "prebuilt_spec", lambda self: object())
    with_prebuilt = ops.unavailable_reason()
    assert "nvcc" not in (with_prebuilt or "")
    if torch.version.cuda is None:
        assert "a CUDA build of torch" in with_prebuilt
