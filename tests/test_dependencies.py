"""The requirements pyproject.toml declares hold what is installed, and cuda-python's major is CUDA's.

Read from pyproject.toml and importlib.metadata only (no import of the packages, no network, well under
a second):

* every requirement of ``[project.dependencies]`` is installed at a version inside its range, and every
  requirement of an extra that is installed is too (an extra's package that is not installed is not
  this environment's business);
* the installed echo_ds metadata declares what pyproject.toml declares (an editable install made before
  pyproject.toml changed says otherwise: reinstall it);
* cuda-python's range spans exactly one major, the installed cuda-python (or, where only its bindings
  are installed, cuda-bindings) is of that major, and where torch is a CUDA build, so is torch's CUDA.
  cuda-bindings N calls the CUDA N driver API, so a CUDA 12 torch beside cuda-python 13 is the mismatch
  an open ``>=12`` let pip make.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip's own copy of the same parser
    from pip._vendor import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
CUDA_PYTHON = "cuda-python"


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def declared(extras: bool = True) -> list:
    """[(extra or None, Requirement)] of pyproject.toml."""
    project = pyproject()
    out = [(None, Requirement(r)) for r in project["dependencies"]]
    if extras:
        for extra, reqs in project.get("optional-dependencies", {}).items():
            out += [(extra, Requirement(r)) for r in reqs]
    return out


def installed_version(name: str):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def violations(requirements: list, versions: dict) -> list:
    """What ``versions`` ({canonical name: version or None}) breaks of ``requirements`` ([(extra, req)]):
    a missing or out-of-range base requirement, an out-of-range installed extra."""
    bad = []
    for extra, req in requirements:
        version = versions.get(canonicalize_name(req.name))
        if version is None:
            if extra is None:
                bad.append(f"{req}: not installed")
            continue
        if not req.specifier.contains(version, prereleases=True):
            bad.append(f"{req}{f' (extra {extra})' if extra else ''}: {version} is installed")
    return bad


def majors(specifier) -> set:
    """The majors (0..99) of which a specifier set admits some version."""
    return {m for m in range(100) for minor in (0, 1, 3, 6, 9, 99)
            if specifier.contains(f"{m}.{minor}.0", prereleases=True)}


def cuda_python_requirement() -> Requirement:
    reqs = [r for extra, r in declared(extras=False) if canonicalize_name(r.name) == CUDA_PYTHON]
    assert len(reqs) == 1, f"pyproject.toml declares {CUDA_PYTHON} {len(reqs)} times"
    return reqs[0]


def test_declared_ranges_hold_what_is_installed():
    reqs = declared()
    versions = {canonicalize_name(r.name): installed_version(r.name) for _, r in reqs}
    if versions[canonicalize_name(CUDA_PYTHON)] is None and installed_version("cuda-bindings"):
        versions[canonicalize_name(CUDA_PYTHON)] = installed_version("cuda-bindings")  # bindings only (GPU image)
    bad = violations(reqs, versions)
    assert not bad, "installed versions outside pyproject.toml's ranges: " + "; ".join(bad)


def test_the_check_finds_what_is_out_of_range():
    reqs = [(None, Requirement("cuda-python>=13.3,<14")), (None, Requirement("numpy")),
            ("eval", Requirement("gguf>=0.10")), ("eval", Requirement("accelerate"))]
    assert violations(reqs, {"cuda-python": "13.4.4", "numpy": "2.0", "gguf": "0.19.0"}) == []
    assert violations(reqs, {"cuda-python": "12.9.0", "numpy": None, "gguf": "0.9"}) == [
        "cuda-python<14,>=13.3: 12.9.0 is installed", "numpy: not installed",
        "gguf>=0.10 (extra eval): 0.9 is installed"]
    assert majors(Requirement("cuda-python>=12").specifier) == set(range(12, 100))
    assert majors(Requirement("cuda-python>=13.3,<14").specifier) == {13}


def test_installed_metadata_is_pyprojects():
    if installed_version("echo_ds") is None:
        pytest.skip("echo_ds is not installed (a checkout on PYTHONPATH): no metadata to compare")
    from importlib.util import find_spec

    origin = Path(find_spec("echo_ds").origin).resolve()
    if REPO not in origin.parents:
        pytest.skip(f"the echo_ds imported is not this checkout's ({origin})")
    # What pip installed (its dist-info has an INSTALLER file), not a stale echo_ds.egg-info of an older
    # build that the checkout on sys.path may also show.
    installed = [d for d in metadata.distributions(name="echo_ds") if d.read_text("INSTALLER")]
    if not installed:
        pytest.skip("no echo_ds installed by pip")
    want = sorted(str(Requirement(str(r) if extra is None else f'{r}; extra == "{extra}"')) for extra, r in declared())
    for dist in installed:
        have = sorted(str(Requirement(r)) for r in dist.requires or [])
        assert have == want, (f"the installed echo_ds ({getattr(dist, '_path', dist)}) declares other requirements than "
                              f"pyproject.toml: reinstall it (pip install -e . --no-deps)")


def test_cuda_python_is_one_major_the_cuda_major_of_torch():
    torch = pytest.importorskip("torch")
    req = cuda_python_requirement()
    allowed = majors(req.specifier)
    assert len(allowed) == 1, f"{req}: admits the majors {sorted(allowed)}; cuda-python's major must be CUDA's"
    (major,) = allowed
    have = installed_version(CUDA_PYTHON) or installed_version("cuda-bindings")
    if have is None:
        pytest.skip("neither cuda-python nor cuda-bindings is installed")
    assert Version(have).major == major, f"cuda-python {have} is installed, {req} is declared"
    bindings = installed_version("cuda-bindings")
    assert bindings is None or Version(bindings).major == major
    if torch.version.cuda is not None:  # a CUDA build of torch: the driver API it was built for
        assert int(re.match(r"\d+", torch.version.cuda).group(0)) == major, \
            f"torch {torch.__version__} is built for CUDA {torch.version.cuda}, and {req} binds CUDA {major}"
