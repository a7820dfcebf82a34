"""``python -m echo_ds.eval <subcommand> ...``: dispatch to the subcommands of :mod:`echo_ds.eval`.

    python -m echo_ds.eval perplexity --help
    python -m echo_ds.eval perplexity --echo-config ds_configs/eval/ --json docs/results/smollm2_tp4_table8.json
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys

from echo_ds.eval import SUBCOMMANDS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m echo_ds.eval",
                                     description="Accuracy evaluation of Echo under emulated tensor parallelism.")
    sub = parser.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.__doc__))
    return parser


def main(argv: list | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.command_line = "python -m echo_ds.eval " + shlex.join(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
