"""Ships the CUDA sources inside the package, as DeepSpeed ships its csrc.

The repository keeps the kernel sources in the top-level ``csrc/``; everything else about the package is
in pyproject.toml. A built package (wheel, ``pip install .``) gets a copy of ``csrc/`` as
``echo_ds/_csrc/``, where ``echo_ds.ops.builder.kernel_sources_dir()`` looks first, so that the op builder
can compile outside a checkout. An editable install gets no copy: its builder falls back to the
checkout's ``csrc/`` (which is then the one being edited). MANIFEST.in puts
``csrc/`` in the sdist, so a wheel built from the sdist has it too.

Ahead-of-time build: with ``DS_BUILD_ECHO=1`` (exactly ``1``, DeepSpeed's convention for its own ops) the
package also gets the compiled extension ``echo_ds.ops.echo_ds_ops`` (``echo_ds/ops/echo_ds_ops.*.so``),
the ``CUDAExtension`` of ``echo_ds.ops.builder.EchoBuilder().builder()`` (one source of truth: the
builder's sources, includes and flags), built by torch's ``BuildExtension``; ``echo_ds.ops.load()`` then
imports it instead of JIT-building. That needs torch (a CUDA build), deepspeed and nvcc at build time, so::

    DS_BUILD_ECHO=1 pip install --no-build-isolation .      # pip wheel likewise

A missing requirement stops the build with what is missing (no package without the extension that was
asked for). Without the variable nothing here imports torch or deepspeed, and the package is pure Python.
"""

import importlib.util
import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CSRC = "csrc"
PACKAGE_CSRC = ("echo_ds", "_csrc")
SOURCE_SUFFIXES = (".cu", ".cuh", ".cpp", ".h")
BUILD_VAR = "DS_BUILD_ECHO"  # == EchoBuilder.BUILD_VAR
HERE = Path(__file__).resolve().parent


class build_py_with_csrc(build_py):
    """build_py, then csrc/**/*.{cu,cuh,cpp,h} -> <build_lib>/echo_ds/_csrc/ (not for editable installs)."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        self.copy_csrc()

    def _csrc_files(self):
        root = Path(__file__).resolve().parent / CSRC
        if not root.is_dir():
            raise FileNotFoundError(f"{root}: the kernel sources are missing (an sdist without MANIFEST.in's graft?)")
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES)
        return root, files

    def copy_csrc(self):
        root, files = self._csrc_files()
        target = Path(self.build_lib).joinpath(*PACKAGE_CSRC)
        for src in files:
            dst = target / src.relative_to(root)
            self.mkpath(str(dst.parent))
            self.copy_file(str(src), str(dst), preserve_mode=False)

    def get_outputs(self, include_bytecode=1):
        outputs = list(super().get_outputs(include_bytecode))
        if not getattr(self, "editable_mode", False):
            root, files = self._csrc_files()
            target = Path(self.build_lib).joinpath(*PACKAGE_CSRC)
            outputs += [str(target / f.relative_to(root)) for f in files]
        return outputs


class AOTBuildError(RuntimeError):
    """DS_BUILD_ECHO=1 was given, but this environment cannot build the extension."""


def aot_requested() -> bool:
    return os.environ.get(BUILD_VAR) == "1"


def _load_builder_module():
    """echo_ds/ops/builder.py of this source tree, loaded by path (the echo_ds package is not imported)."""
    path = HERE / "echo_ds" / "ops" / "builder.py"
    spec = importlib.util.spec_from_file_location("_echo_ds_setup_builder", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def echo_ext_modules() -> list:
    """[] without DS_BUILD_ECHO=1; with it, [EchoBuilder().builder()] (or AOTBuildError saying what is missing)."""
    if not aot_requested():
        return []
    hint = (f"{BUILD_VAR}=1 compiles the CUDA extension at install time: install torch (a CUDA build) and "
            f"deepspeed first, then build with `{BUILD_VAR}=1 pip install --no-build-isolation .` (pip's "
            "isolated build environment has neither); unset the variable to JIT-build on first use instead")
    try:
        import torch  # noqa: F401
        import torch.utils.cpp_extension  # noqa: F401
    except ImportError as e:
        raise AOTBuildError(f"torch cannot be imported ({e}). {hint}") from e
    try:
        builder_module = _load_builder_module()
    except ImportError as e:
        raise AOTBuildError(f"the DeepSpeed op builder cannot be imported ({e}). {hint}") from e
    builder = builder_module.EchoBuilder()
    missing = builder.missing_requirements()
    if missing:
        raise AOTBuildError(f"{BUILD_VAR}=1 but {builder.NAME} cannot be built here: missing " + "; ".join(missing))
    ext = builder.builder()
    if builder.build_for_cpu:  # DeepSpeed found no CUDA toolkit after all: it would make a CppExtension of .cu
        raise AOTBuildError(f"{BUILD_VAR}=1 but DeepSpeed's op builder found no CUDA toolkit (CUDA_HOME)")
    # setuptools refuses absolute source paths ("setup script specifies an absolute path"); the builder's
    # are absolute, under this directory, which is the working directory of every setup.py command.
    relative = [os.path.relpath(src, HERE) for src in ext.sources]
    outside = [src for src in relative if src.startswith("..")]
    if outside:
        raise AOTBuildError(f"kernel sources outside {HERE}: {outside}")
    ext.sources = [Path(src).as_posix() for src in relative]
    return [ext]


def setup_kwargs() -> dict:
    cmdclass = {"build_py": build_py_with_csrc}
    ext_modules = echo_ext_modules()
    if not ext_modules:
        return {"cmdclass": cmdclass}
    from torch.utils.cpp_extension import BuildExtension

    cmdclass["build_ext"] = BuildExtension
    return {"cmdclass": cmdclass, "ext_modules": ext_modules}


# setuptools runs this file as __main__ (build_meta, `python setup.py`); a test imports it under another
# name to call the functions above without running setup().
if __name__ == "__main__":
    setup(**setup_kwargs())
