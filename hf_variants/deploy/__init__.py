"""Deployment outside the model closure: CTranslate2 export (`ctranslate2`) and torch int8 CPU inference (`int8`).

Nothing in a saved model's code imports this package.
"""
