"""The op builder's flags (CPU; no GPU or nvcc needed except where a test says so)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import echo_ds
from echo_ds.ops.builder import (CSRC_DIR, EXACT_FP_NVCC_FLAGS, HEADERS, EchoBuilder, cxx_std, find_nvcc,
                                 kernel_sources_dir)

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


def test_both_builders_take_their_sources_from_one_place():
    from echo_ds.p2p import builder as p2p

    root = kernel_sources_dir()
    assert CSRC_DIR == root and p2p.CSRC_DIR == root / "p2p"
    if Path(echo_ds.__file__).resolve().parent == REPO / "echo_ds" and not (REPO / "echo_ds" / "_csrc").exists():
        # A checkout (editable install): the top-level csrc/, edited in place, no copy.
        # (An installed wheel's echo_ds/_csrc is tested by test_packaging.py.)
        assert root == REPO / "csrc"
    builder = EchoBuilder()
    for path in builder.sources() + [str(CSRC_DIR / h) for h in HEADERS]:
        assert Path(path).is_file(), path
    assert builder.include_paths() == [str(root)]
    for name in p2p.SOURCES + p2p.HEADERS:
        assert (p2p.CSRC_DIR / name).is_file(), name
    assert not any("kernel source" in m for m in builder.missing_requirements())
