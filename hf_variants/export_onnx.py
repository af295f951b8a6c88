"""`python -m hf_variants.export_onnx` (ONNX export), kept at its documented path.

The code lives in `hf_variants.onnx.export`; this module only re-exports its public names and runs its `main()`.
"""

from .onnx.export import *  # noqa: F401,F403
from .onnx.export import main

if __name__ == "__main__":
    main()
