"""`python -m hf_variants.warm_start` (a variant warm-started from a pretrained model), kept at this path.

The code lives in `hf_variants.convert.warm_start`; its command line in
`hf_variants.commands.warm_start`; this module re-exports the library's public names and runs the command.
"""

from .commands.warm_start import cli
from .convert.warm_start import *  # noqa: F401,F403

if __name__ == "__main__":
    cli()
