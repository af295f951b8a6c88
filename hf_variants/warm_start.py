"""`python -m hf_variants.warm_start` (a variant warm-started from a pretrained model), kept at this path.

The code lives in `hf_variants.convert.warm_start`; this module only re-exports its public names and runs its `main()`.
"""

from .convert.warm_start import *  # noqa: F401,F403
from .convert.warm_start import main

if __name__ == "__main__":
    main()
