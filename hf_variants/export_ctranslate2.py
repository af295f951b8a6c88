"""`python -m hf_variants.export_ctranslate2` (CTranslate2 export), kept at its documented path.

The code lives in `hf_variants.deploy.ctranslate2`; its command line in
`hf_variants.commands.export_ctranslate2`; this module re-exports the library's public names and runs the command.
"""

from .commands.export_ctranslate2 import cli
from .deploy.ctranslate2 import *  # noqa: F401,F403

if __name__ == "__main__":
    cli()
