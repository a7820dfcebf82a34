"""The pretraining data: the Shakespeare corpus as bytes (the tokenizer), its held-out plays, the batches."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import torch

kRepo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# --data default: the first of these that exists (a copy inside the repo first: it travels to a device).
kDataSearch = (os.path.join(kRepo, ".data", "shakespeare"),)
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


def default_data_dir() -> str | None:
    env = os.environ.get("ECHO_SHAKESPEARE_DIR")
    for path in ((env,) if env else ()) + kDataSearch:
        if path and os.path.isdir(path):
            return path
    return None


def parse_plays(text: str) -> tuple:
    """``--val-plays``: comma-separated file stems."""
    return tuple(p.strip() for p in text.split(",") if p.strip())


def load_corpus(directory: str, val_plays=kDefaultValPlays) -> Corpus:
    """Training bytes: every ``*.txt`` except ``val_plays`` (file stems), in name order, blank-line
    joined; validation bytes: the ``val_plays`` in the order given, joined the same way."""
    if not directory or not os.path.isdir(directory):
        raise SystemExit(f"--data {directory!r}: not a directory (the Shakespeare corpus, one .txt per play)")
    files = sorted(f for f in os.listdir(directory) if f.endswith(".txt"))
    stems = {os.path.splitext(f)[0]: f for f in files}
    missing = [p for p in val_plays if p not in stems]
    if missing:
        raise SystemExit(f"--val-plays: {missing} not in {directory}")
    val_files = [stems[p] for p in val_plays]
    train_files = [f for f in files if f not in val_files]
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
