"""CPU CI for the CUDA kernels: every csrc/ translation unit must compile (nvcc -c, sm_90).

No GPU is needed: each .cu is compiled to an object with the flags the op builder uses
(echo_ds/ops/builder.py) plus PyTorch's own extension flags, its PTX is kept and checked for fused
multiply-adds (the kernels' numerics forbid them), and the torch binding is compiled against the headers
of the installed torch package (a CPU wheel will do). The compile test skips with a reason where nvcc is
absent; the source-list and spill-parser tests run everywhere.
"""

from __future__ import annotations

import os
import re
import subprocess
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from echo_ds.ops.builder import CSRC_DIR, EXACT_FP_NVCC_FLAGS, SOURCES, cxx_std, find_nvcc

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


def _compile(cmd, cwd):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


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
def test_translation_units_compile_without_fma():
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
        for name, keep, _, log in results:
            spills = _spilled_functions(log)
            assert not spills, f"{name} spills registers in {len(spills)} kernels:\n" + "\n".join(spills)
            if keep is None:
                continue
            ptx_files = list(keep.glob("*.ptx"))
            assert ptx_files, f"{name}: nvcc --keep left no PTX"
            for ptx in ptx_files:
                text = ptx.read_text()
                assert not re.search(r"\bfma\.", text), f"{name}: fused multiply-add in {ptx.name}"
                assert not re.search(r"\b(mul|add|sub)\.f32\b", text), \
                    f"{name}: fp32 mul/add without an explicit rounding mode in {ptx.name} (may be contracted)"
                assert ".ftz" not in text, f"{name}: flush-to-zero in {ptx.name}"
                assert "div.approx" not in text and "div.full" not in text, f"{name}: approximate division"


def test_spill_lines_are_recognised():
    """The spill check itself: every count is read, not only those that happen to end in a 0 digit."""
    line = ("ptxas warning : Registers are spilled to local memory in function '_Z3fooILi8EEvv', "
            "400 bytes spill stores, 388 bytes spill loads")
    assert _spilled_functions(line) == ["_Z3fooILi8EEvv: 400 B stored, 388 B loaded"]
    assert len(_spilled_functions(line + "\n" + line.replace("400", "8"))) == 2
    assert _spilled_functions("ptxas info    : Used 64 registers, used 0 barriers") == []
    assert _spilled_functions("some other spill message") == ["(unparsed) some other spill message"]
    assert _spilled_functions(line + "\nsome other spill message")[1] == "(unparsed) some other spill message"
