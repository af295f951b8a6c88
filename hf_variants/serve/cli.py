"""`python -m hf_variants.serve.cli`: the server's command line of earlier releases, kept as a launcher of
`hf_variants.commands.serve` (`hf-variants-serve`, `python -m hf_variants.serve`)."""

if __name__ == "__main__":
    import runpy

    runpy.run_module("hf_variants.commands.serve", run_name="__main__", alter_sys=True)
