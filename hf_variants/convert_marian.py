"""`python -m hf_variants.convert_marian` (MarianMTModel conversion), kept at its documented path.

The code lives in `hf_variants.convert.marian`; this module only re-exports its public names and runs its `main()`.
"""

from .convert.marian import *  # noqa: F401,F403
from .convert.marian import main

if __name__ == "__main__":
    main()
