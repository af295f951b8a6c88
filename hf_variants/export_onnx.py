"""`python -m hf_variants.export_onnx` (ONNX export), kept at its documented path.

The code lives in `hf_variants.onnx.export`; its command line in
`hf_variants.commands.export_onnx`; this module re-exports the library's public names and runs the command.
"""

from .commands.export_onnx import cli
from .onnx.export import *  # noqa: F401,F403

if __name__ == "__main__":
    cli()
