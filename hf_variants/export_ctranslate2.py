"""`python -m hf_variants.export_ctranslate2` (CTranslate2 export), kept at its documented path.

The code lives in `hf_variants.deploy.ctranslate2`; this module only re-exports its public names and runs its `main()`.
"""

from .deploy.ctranslate2 import *  # noqa: F401,F403
from .deploy.ctranslate2 import main

if __name__ == "__main__":
    main()
