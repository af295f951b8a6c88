"""`python -m hf_variants.convert_legacy` (folders saved by older releases), kept at its documented path.

The code lives in `hf_variants.convert.legacy`; its command line in
`hf_variants.commands.convert_legacy`; this module re-exports the library's public names and runs the command.
"""

from .commands.convert_legacy import cli
from .convert.legacy import *  # noqa: F401,F403

if __name__ == "__main__":
    cli()
