"""`python -m hf_variants.convert_marian` (MarianMTModel conversion), kept at its documented path.

The code lives in `hf_variants.convert.marian`; its command line in
`hf_variants.commands.convert_marian`; this module re-exports the library's public names and runs the command.
"""

from .commands.convert_marian import cli
from .convert.marian import *  # noqa: F401,F403

if __name__ == "__main__":
    cli()
