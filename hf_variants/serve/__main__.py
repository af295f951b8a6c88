"""`python -m hf_variants.serve`: the same as `hf-variants-serve`."""

from .cli import cli

cli()
