"""``python -m echo_ds.eval.pretrain ...``: the same as ``python -m echo_ds.eval pretrain ...``."""

import sys

from echo_ds.eval.pretrain.cli import main

if __name__ == "__main__":
    sys.exit(main())
