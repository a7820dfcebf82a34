"""The op builder's flags (CPU; no GPU or nvcc needed except where a test says so)."""

from __future__ import annotations

import subprocess

import pytest

from echo_ds.ops.builder import CSRC_DIR, EXACT_FP_NVCC_FLAGS, EchoBuilder, cxx_std, find_nvcc


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
