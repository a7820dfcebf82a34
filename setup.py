"""Ships the CUDA sources inside the package, as DeepSpeed ships its csrc.

The repository keeps the kernel sources in the top-level ``csrc/``; everything else about the package is
in pyproject.toml. A built package (wheel, ``pip install .``) gets a copy of ``csrc/`` as
``echo_ds/_csrc/``, where ``echo_ds.ops.builder.kernel_sources_dir()`` looks first, so that the op builder
and the p2p transport's builder can compile outside a checkout. An editable install gets no copy: its
builders fall back to the checkout's ``csrc/`` (which is then the one being edited). MANIFEST.in puts
``csrc/`` in the sdist, so a wheel built from the sdist has it too.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CSRC = "csrc"
PACKAGE_CSRC = ("echo_ds", "_csrc")
SOURCE_SUFFIXES = (".cu", ".cuh", ".cpp", ".h")


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


setup(cmdclass={"build_py": build_py_with_csrc})
