"""Conversion tooling: MarianMTModel checkpoints (`marian`), folders saved by older releases (`legacy`), and a
variant warm-started from a pretrained Transformer (`warm_start`).

Nothing in a saved model's code imports this package.
"""
