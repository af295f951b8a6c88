#!/usr/bin/env python
"""`accelerate launch training/translate.py` / `python training/translate.py` from a clone of the repository.

The command lives in the package, `hf_variants.commands.translate` (installed: `hf-variants-translate`, or
`accelerate launch -m hf_variants.commands.translate`); this script puts the clone first on `sys.path` (so the
checkout's code runs even where another copy is installed) and runs it. Options: `--help`, and training/README.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_variants.commands.translate import cli  # noqa: E402

if __name__ == "__main__":
    cli()
