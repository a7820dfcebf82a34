"""The transport's C++ side: the header's static_asserts hold under the host compiler and its layout
equals the ctypes mirror; the kernels compile for sm_90 (skipped without the compilers)."""

import shutil
import subprocess

import pytest

from echo_ds.p2p import layout as L
from echo_ds.p2p.builder import CSRC_DIR, SOURCES, _find_nvcc

PRINT_LAYOUT = r"""
#include <cstdio>
#include "echo_p2p.h"
int main() {
#define PRINT(v) std::printf("%llu\n", static_cast<unsigned long long>(v));
  ECHO_P2P_LAYOUT_LIST(PRINT)
  return 0;
}
"""


def test_header_layout_equals_the_python_mirror(tmp_path):
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    src = tmp_path / "layout.cc"
    src.write_text(PRINT_LAYOUT)
    exe = tmp_path / "layout"
    subprocess.run([cxx, "-std=c++17", f"-I{CSRC_DIR}", str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    assert tuple(int(v) for v in out) == L.expected_layout()


def test_kernels_compile_for_sm90(tmp_path):
    nvcc = _find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    out = tmp_path / "k.cubin"
    proc = subprocess.run([nvcc, "-cubin", "-arch=sm_90", "-O3", "-std=c++17", "-o", str(out),
                           str(CSRC_DIR / SOURCES[0])], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    data = out.read_bytes()
    for name in (b"echo_p2p_put_kernel", b"echo_p2p_wait_kernel", b"echo_p2p_signal_kernel",
                 b"echo_p2p_begin_call_kernel", b"echo_p2p_layout"):
        assert name in data
