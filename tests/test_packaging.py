"""A built wheel carries the kernel sources: its builder finds them without a checkout (CPU, no network).

The packaging inputs are copied to a temporary directory (so that the build leaves no build/ or
echo_ds/_csrc/ in the checkout), built with ``pip wheel --no-deps --no-build-isolation``, installed with
``pip install --no-deps --target``, and imported by a Python whose only path to echo_ds is that target
and whose working directory is outside the repository. Every source file, header and include directory
that the builder names must then exist under the target, and none under the repository.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What `pip wheel .` reads from a checkout: pyproject.toml (and the README it names), setup.py, MANIFEST.in,
# the package and the kernel sources.
PACKAGING_INPUTS = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "echo_ds", "csrc")
MARK = "ECHO_PACKAGING_REPORT "

# Runs in the installed copy: what the builder would compile, as absolute paths.
REPORT = r"""
import json, echo_ds
from echo_ds.ops import builder as ops_builder

b = ops_builder.EchoBuilder()
print(MARK + json.dumps({
    "package": echo_ds.__file__,
    "kernel_sources_dir": str(ops_builder.kernel_sources_dir()),
    "ops_sources": b.sources(),
    "ops_includes": b.include_paths(),
    "ops_headers": [str(ops_builder.CSRC_DIR / h) for h in ops_builder.HEADERS],
    "ops_missing": b.missing_requirements(),
}))
"""


def _pip(*args, cwd):
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *args]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}"


def _under(path: str, root: Path) -> bool:
    return Path(path).resolve().is_relative_to(root.resolve())


def test_wheel_ships_the_kernel_sources_and_its_builder_finds_them(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.py[cod]", "*.so", "*.o", "_csrc", "*.egg-info")
    for name in PACKAGING_INPUTS:
        path = REPO / name
        (shutil.copytree(path, src / name, ignore=ignore) if path.is_dir() else shutil.copy2(path, src / name))

    wheels, target, outside = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    outside.mkdir()
    _pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), ".", cwd=src)
    (wheel,) = wheels.glob("echo_ds-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"echo_ds/_csrc/{p.relative_to(REPO / 'csrc').as_posix()}" for p in (REPO / "csrc").rglob("*")
               if p.is_file() and p.suffix in (".cu", ".cuh", ".cpp", ".h")}
    assert shipped and shipped <= names, sorted(shipped - names)
    _pip("install", "--no-deps", "--no-index", "-q", "--target", str(target), str(wheel), cwd=outside)

    env = dict(os.environ, PYTHONPATH=str(target))
    proc = subprocess.run([sys.executable, "-c", f"MARK = {MARK!r}\n" + REPORT], cwd=outside, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    r = json.loads(line[len(MARK):])

    assert _under(r["package"], target), r["package"]  # the installed copy, not the editable checkout
    assert Path(r["kernel_sources_dir"]) == target / "echo_ds" / "_csrc"
    assert not any("kernel source" in m for m in r["ops_missing"]), r["ops_missing"]
    files = r["ops_sources"] + r["ops_headers"]
    dirs = r["ops_includes"]
    assert r["ops_sources"] and dirs
    for path in files + dirs:
        assert _under(path, target) and not _under(path, REPO), path
    for path in files:
        assert Path(path).is_file(), path
    for path in dirs:
        assert Path(path).is_dir(), path
