"""Builds the transport kernels (csrc/p2p) into a cubin for the current GPU, and caches it.

The transport needs no torch extension: its kernels take one struct by value and are launched through
the driver API, so a build is one ``nvcc -cubin`` of one file (0.56 s on the H200 machine). Without nvcc
the transport is unavailable and EchoBuffer says so (NVRTC is no substitute here: it has no offsetof for
the header's static_asserts, seen on the H200 machine). The cubin lands in ``$ECHO_DS_BUILD_DIR`` (default
``~/.cache/echo_ds``) under a name that hashes the sources, the target and the compiler, so a changed
source rebuilds and an unchanged one loads at once.

    python -m echo_ds.p2p.builder          # build for GPU 0 and print where the cubin is
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Optional, Tuple

from echo_ds.ops.builder import kernel_sources_dir

CSRC_DIR = kernel_sources_dir() / "p2p"
SOURCES = ("echo_p2p_kernels.cu",)
HEADERS = ("echo_p2p.h",)
KERNEL_NAMES = ("echo_p2p_begin_call_kernel", "echo_p2p_put_kernel", "echo_p2p_signal_kernel",
                "echo_p2p_wait_kernel")
_NVCC_FLAGS = ("-O3", "-std=c++17", "-cubin", "-diag-suppress=177")


class BuildError(RuntimeError):
    pass


def build_dir() -> Path:
    return Path(os.environ.get("ECHO_DS_BUILD_DIR", Path.home() / ".cache" / "echo_ds")) / "p2p"


def _find_nvcc() -> Optional[str]:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _sources_digest(arch: str, compiler: str) -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((CSRC_DIR / name).read_bytes())
    h.update(arch.encode())
    h.update(compiler.encode())
    h.update(" ".join(_NVCC_FLAGS).encode())
    return h.hexdigest()[:16]


def _nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    return out.strip().splitlines()[-1] if out.strip() else "nvcc"


def _build_nvcc(nvcc: str, arch: str, out: Path) -> None:
    cmd = [nvcc, *_NVCC_FLAGS, f"-arch={arch}", "-o", str(out), str(CSRC_DIR / SOURCES[0])]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise BuildError(f"{' '.join(cmd)} failed:\n{proc.stderr}")


def build(arch: str = "sm_90", verbose: bool = False) -> Tuple[Path, float]:
    """Path of the cubin for ``arch`` (building it when it is not cached) and the build's seconds."""
    nvcc = _find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc was not found (CUDA_HOME/bin or PATH); the p2p transport kernels need it")
    compiler = _nvcc_version(nvcc)
    out = build_dir() / f"echo_p2p_{arch}_{_sources_digest(arch, compiler)}.cubin"
    if out.exists():
        return out, 0.0
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    t0 = time.perf_counter()
    _build_nvcc(nvcc, arch, tmp)
    os.replace(tmp, out)  # atomic: ranks building at once all end with one good file
    seconds = time.perf_counter() - t0
    if verbose:
        print(f"echo p2p: built {out} with {compiler} in {seconds:.2f} s")
    return out, seconds


def arch_of_device(ordinal: int) -> str:
    from echo_ds.p2p import driver

    driver.init()
    major, minor = driver.compute_capability(ordinal)
    return f"sm_{major}{minor}"


if __name__ == "__main__":
    import torch

    torch.cuda.init()
    path, secs = build(arch_of_device(torch.cuda.current_device()), verbose=True)
    print(f"echo p2p: cubin {path} ({path.stat().st_size} bytes, build {secs:.2f} s)")
