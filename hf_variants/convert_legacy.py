"""`python -m hf_variants.convert_legacy` (folders saved by older releases), kept at its documented path.

The code lives in `hf_variants.convert.legacy`; this module only re-exports its public names and runs its `main()`.
"""

from .convert.legacy import *  # noqa: F401,F403
from .convert.legacy import main

if __name__ == "__main__":
    main()
