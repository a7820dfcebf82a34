"""CPU CI for the CUDA kernels: every csrc/ translation unit must compile (nvcc -c, sm_90).

No GPU is needed: each .cu is compiled to an object with the flags the op builder uses
(echo_ds/ops/builder.py) plus PyTorch's own extension flags, its PTX is kept and checked for fused
multiply-adds (the kernels' numerics forbid them, but for products by +-1, which round once like the
addition they are), and the torch binding is compiled against the headers
of the installed torch package (a CPU wheel will do). The compile test skips with a reason where nvcc is
absent; the source-list and spill-parser tests run everywhere. The p2p transport's layout header
(csrc/echo_p2p.h) is compiled with the host compiler, and what it exports is compared with the Python
side (skipped without a host compiler).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from echo_ds.ops.builder import CSRC_DIR, EXACT_FP_NVCC_FLAGS, SOURCES, cxx_std, find_nvcc
from echo_ds.p2p import layout as L
from echo_ds.p2p import transport

NVCC = find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (set CUDA_HOME or PATH)")

# PyTorch's extension builds add these (torch.utils.cpp_extension.COMMON_NVCC_FLAGS); the kernels must
# compile under them.
TORCH_NVCC_FLAGS = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
                    "--expt-relaxed-constexpr"]


def _cuda_sources():
    return [s for s in SOURCES if s.endswith(".cu")]


def test_every_cu_file_is_built():
    on_disk = sorted(p.name for p in CSRC_DIR.glob("*.cu"))
    assert on_disk == sorted(_cuda_sources()), "every csrc/*.cu must be a source of EchoBuilder"


_SPILL_LINE = re.compile(r"spilled to local memory in function '([^']+)', (\d+) bytes spill stores, (\d+) bytes spill loads")


def _spilled_functions(log: str) -> list:
    """Every line of ``log`` that speaks of spills: the ptxas -warn-spills lines ("Registers are spilled to
    local memory in function ..., N bytes spill stores, M bytes spill loads") shortened to the function and
    the byte counts, any other such line whole (marked unparsed)."""
    found = []
    for line in log.splitlines():
        if "spill" not in line.lower():
            continue
        m = _SPILL_LINE.search(line)
        found.append(f"{m[1]}: {m[2]} B stored, {m[3]} B loaded" if m else "(unparsed) " + line)
    return found


_PTX_FUNCTION = re.compile(r"^(?:\.visible\s+|\.weak\s+)?\.(?:entry|func)\b", re.M)
_FMA = re.compile(r"^\s*(fma\S*)\s+(%\w+),\s*(\S+),\s*(\S+),\s*(\S+);", re.M)
_UNIT = {"0f3F800000", "0fBF800000"}  # +1.0f and -1.0f
_UNIT_SELECT = re.compile(r"^\s*selp\.f32\s+(%\w+),\s*(0f[0-9A-F]{8}),\s*(0f[0-9A-F]{8}),\s*%p\w*;", re.M)


def _inexact_fmas(ptx: str) -> list:
    """Every fused multiply-add of ``ptx`` that may round differently from the separate operations: all but
    ``fma.rn.f32`` whose multiplier is +-1.0, given as an immediate or as a register defined in its function
    only by ``selp.f32 r, +-1.0, +-1.0, p`` (fwht's cross-lane butterflies). A product by +-1 is exact, so
    the one rounding of the fused operation is the addition's."""
    bad = []
    starts = sorted({0, *(m.start() for m in _PTX_FUNCTION.finditer(ptx))}) + [len(ptx)]
    for begin, end in zip(starts, starts[1:]):
        body = ptx[begin:end]
        units = {m[1] for m in _UNIT_SELECT.finditer(body) if {m[2], m[3]} <= _UNIT}
        defined = {}  # register -> number of instructions writing it
        for m in re.finditer(r"^\s*[a-z][\w.]*\s+(%\w+)\s*,", body, re.M):
            defined[m[1]] = defined.get(m[1], 0) + 1
        selects = {}
        for m in _UNIT_SELECT.finditer(body):
            selects[m[1]] = selects.get(m[1], 0) + 1
        unit_regs = {r for r in units if selects.get(r) == defined.get(r)}
        for m in _FMA.finditer(body):
            op, _, a, b, _ = m.groups()
            if op != "fma.rn.f32" or not ({a, b} & (_UNIT | unit_regs)):
                bad.append(m[0].strip())
    return bad


def _compile(cmd, cwd):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def _undefined_echo_symbols(objects) -> list:
    """The echo:: functions that some object uses and none defines: what loading the extension would report
    as an undefined symbol (a launcher declared `extern template` in a header and instantiated by no unit)."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) not found: the cross-unit symbol check needs it")

    def symbols(flag):
        out = subprocess.run([nm, "-C", flag, *map(str, objects)], capture_output=True, text=True, check=True).stdout
        names = (re.match(r"\s*(?:[0-9a-fA-F]+\s+)?[A-Za-z]\s+(.*)", line) for line in out.splitlines())
        return {m[1] for m in names if m and "echo::" in m[1]}

    return sorted(symbols("--undefined-only") - symbols("--defined-only"))


def _torch_include_args():
    import torch
    from torch.utils.cpp_extension import include_paths

    args = []
    for p in include_paths():
        args += ["-I", p]
    args += ["-I", sysconfig.get_paths()["include"]]
    args += [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", "-DTORCH_EXTENSION_NAME=echo_ds_ops"]
    return args


@needs_nvcc
def test_translation_units_compile_exact():
    with tempfile.TemporaryDirectory() as tmp:
        jobs = []
        for name in _cuda_sources():
            keep = Path(tmp) / name.replace(".", "_")
            keep.mkdir()
            cmd = [NVCC, "-c", "-O3", cxx_std(), "-arch=sm_90", *EXACT_FP_NVCC_FLAGS, *TORCH_NVCC_FLAGS,
                   "-I", str(CSRC_DIR), "--keep", "--keep-dir", str(keep), "-Xptxas", "-warn-spills",
                   "-o", str(Path(tmp) / (name + ".o")), str(CSRC_DIR / name)]
            jobs.append((name, cmd, keep))
        binding = "echo_binding.cpp"
        jobs.append((binding, [NVCC, "-c", "-O1", cxx_std(), "-I", str(CSRC_DIR), *_torch_include_args(),
                               "-o", str(Path(tmp) / (binding + ".o")), str(CSRC_DIR / binding)], None))
        with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
            results = list(pool.map(lambda j: (j[0], j[2], *_compile(j[1], tmp)), jobs))
        failures = [f"{name}:\n{log}" for name, _, rc, log in results if rc != 0]
        assert not failures, "compilation failed:\n" + "\n".join(failures)
        missing = _undefined_echo_symbols(sorted(Path(tmp).glob("*.o")))
        assert not missing, "echo symbols that no unit defines (an instantiation missing):\n" + "\n".join(missing)
        for name, keep, _, log in results:
            spills = _spilled_functions(log)
            assert not spills, f"{name} spills registers in {len(spills)} kernels:\n" + "\n".join(spills)
            if keep is None:
                continue
            ptx_files = list(keep.glob("*.ptx"))
            assert ptx_files, f"{name}: nvcc --keep left no PTX"
            for ptx in ptx_files:
                text = ptx.read_text()
                inexact = _inexact_fmas(text)
                assert not inexact, f"{name}: fused multiply-add in {ptx.name}: {inexact[:3]}"
                assert not re.search(r"\b(mul|add|sub)\.f32\b", text), \
                    f"{name}: fp32 mul/add without an explicit rounding mode in {ptx.name} (may be contracted)"
                assert ".ftz" not in text, f"{name}: flush-to-zero in {ptx.name}"
                assert "div.approx" not in text and "div.full" not in text, f"{name}: approximate division"


@pytest.mark.skipif(shutil.which("g++") is None or shutil.which("nm") is None, reason="needs g++ and nm")
def test_symbol_check_finds_what_no_object_defines():
    """The cross-unit symbol check itself, on two host objects: one uses echo::a() and echo::b(), the other
    defines echo::a() only."""
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"user.cpp": "namespace echo { void a(); void b(); void user() { a(); b(); } }\n",
                   "maker.cpp": "namespace echo { void a() {} }\n"}
        for name, text in sources.items():
            (Path(tmp) / name).write_text(text)
            subprocess.run(["g++", "-c", "-o", str(Path(tmp) / (name + ".o")), str(Path(tmp) / name)], check=True)
        objects = sorted(Path(tmp).glob("*.o"))
        assert _undefined_echo_symbols(objects) == ["echo::b()"]
        assert _undefined_echo_symbols([Path(tmp) / "maker.cpp.o"]) == []


def test_fma_check_admits_only_products_by_unit():
    """The fused multiply-add check itself, on hand-written PTX."""
    head = ".visible .entry k(\n)\n{\n"
    select = "\tselp.f32 \t%f9, 0fBF800000, 0f3F800000, %p1;\n"
    fma = "\tfma.rn.f32 \t%f3, %f1, %f9, %f2;\n"
    assert _inexact_fmas(head + select + fma + "}\n") == []
    assert _inexact_fmas(head + "\tfma.rn.f32 \t%f3, %f1, 0f3F800000, %f2;\n}\n") == []
    # a multiplier that is not +-1, a second definition of the select's register, another rounding mode,
    # the select in another function
    assert _inexact_fmas(head + fma + "}\n") == ["fma.rn.f32 \t%f3, %f1, %f9, %f2;"]
    assert len(_inexact_fmas(head + "\tselp.f32 \t%f9, 0f40000000, 0f3F800000, %p1;\n" + fma + "}\n")) == 1
    assert len(_inexact_fmas(head + select + "\tadd.rn.f32 \t%f9, %f1, %f2;\n" + fma + "}\n")) == 1
    assert len(_inexact_fmas(head + select + fma.replace("fma.rn", "fma.rz") + "}\n")) == 1
    assert len(_inexact_fmas(head + select + "}\n" + head + fma + "}\n")) == 1
    assert len(_inexact_fmas(fma)) == 1  # outside any function header


def test_spill_lines_are_recognised():
    """The spill check itself: every count is read, not only those that happen to end in a 0 digit."""
    line = ("ptxas warning : Registers are spilled to local memory in function '_Z3fooILi8EEvv', "
            "400 bytes spill stores, 388 bytes spill loads")
    assert _spilled_functions(line) == ["_Z3fooILi8EEvv: 400 B stored, 388 B loaded"]
    assert len(_spilled_functions(line + "\n" + line.replace("400", "8"))) == 2
    assert _spilled_functions("ptxas info    : Used 64 registers, used 0 barriers") == []
    assert _spilled_functions("some other spill message") == ["(unparsed) some other spill message"]
    assert _spilled_functions(line + "\nsome other spill message")[1] == "(unparsed) some other spill message"


# ----------------------------------------------------------------------------------------------------
# The p2p transport's layout: csrc/echo_p2p.h under the host compiler against echo_ds/p2p/layout.py
# ----------------------------------------------------------------------------------------------------

PRINT_LAYOUT = r"""
#include <cstdio>
#include "echo_p2p.h"
int main() {
#define PRINT(name, value) std::printf("%s %llu\n", name, static_cast<unsigned long long>(value));
  ECHO_P2P_LAYOUT_LIST(PRINT)
  return 0;
}
"""


def test_transport_layout_header_equals_the_python_side(tmp_path):
    """The header's static_asserts hold under the host compiler; the values it exports (the extension's
    p2p_transport_layout(), from the same list) are layout.py's and name every word the CUDA transport
    reads or writes. (EchoBuffer compares layout.py with the loaded extension itself: L.check_layout.)"""
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    src, exe = tmp_path / "layout.cc", tmp_path / "layout"
    src.write_text(PRINT_LAYOUT)
    subprocess.run([cxx, "-std=c++17", "-I", str(CSRC_DIR), str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    header = {name: int(value) for name, value in (line.split() for line in out.splitlines())}
    assert {k: header.get(k) for k in L.SIGNALS_LAYOUT} == L.SIGNALS_LAYOUT
    used = {"control_bytes", "control.call_index", "control.poisoned", "error_bytes"}
    used |= {"error." + w for w in transport._RECORD_WORDS + transport._RECORD_EXTRA}
    assert used <= header.keys(), sorted(used - header.keys())
