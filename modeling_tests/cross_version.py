"""Save tiny models of every type under one transformers version and decode them under another
(`test_transformers_versions.py`). Run as a script in either interpreter:

    python modeling_tests/cross_version.py save TOKENIZER_DIR OUT_DIR   # six folders + OUT_DIR/ids.json
    python modeling_tests/cross_version.py load OUT_DIR                 # the ids of the saved folders, as JSON

`save` builds the models with the package; `load` reads the folders in a process without hf_variants
(`trust_remote_code`, the saved code), as a Hub user does. Both print `{"transformers": version, "ids": {...}}`,
`ids[model_type][decoding]` the generated ids of the same sentences, greedy and beam 3."""

from __future__ import annotations

import json
import sys
from pathlib import Path

SENTENCES = ["A man rides a bike down the street.", "Two dogs play in the snow.", "A woman sings."]
# constituency parses of the sentences (whitespace tokens as leaves) for the syntactic MG-SA, the paper's model
PARSES = {
    SENTENCES[0]: "(ROOT (S (NP (DT A) (NN man)) (VP (VBZ rides) (NP (DT a) (NN bike)) (PP (IN down) (NP (DT the) "
    "(NN street.))))))",
    SENTENCES[1]: "(ROOT (S (NP (CD Two) (NNS dogs)) (VP (VBP play) (PP (IN in) (NP (DT the) (NN snow.))))))",
    SENTENCES[2]: "(ROOT (S (NP (DT A) (NN woman)) (VP (VBZ sings.))))",
}
DECODINGS = {"greedy": {"num_beams": 1, "max_new_tokens": 12}, "beam": {"num_beams": 3, "max_new_tokens": 12}}
# (model type, config overrides, translation kwargs): one model per type, the multilingual ones into German
MODELS = [
    ("transformer_nmt", {}, {}),
    ("mute_nmt", {}, {}),
    ("hysan_nmt", {}, {}),
    ("mgsa_nmt", {}, {"parses": PARSES}),
    ("mimo_nmt", {"languages": ["en", "de"]}, {"tgt_lang": "de"}),
    ("tied_nmt", {"languages": ["en", "de"]}, {"tgt_lang": "de"}),
]


def decode_all(model, tokenizer, translation_kwargs: dict) -> dict:
    inputs = model.prepare_translation_inputs(tokenizer, SENTENCES, **translation_kwargs)
    return {name: model.generate(**inputs, **kwargs).tolist() for name, kwargs in DECODINGS.items()}


def save(tokenizer_dir: str, out_dir: str) -> dict:
    import torch
    import transformers
    from transformers import AutoTokenizer

    from hf_variants import MODEL_CLASSES

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    out, ids = Path(out_dir), {}
    for model_type, overrides, translation_kwargs in MODELS:
        config_class, _, model_class = MODEL_CLASSES[model_type][:3]
        torch.manual_seed(0)
        config = config_class.from_preset("tiny", vocab_size=len(tokenizer), **overrides)
        model = model_class(config).eval()
        model.save_pretrained(out / model_type)
        tokenizer.save_pretrained(out / model_type)
        ids[model_type] = decode_all(model, tokenizer, translation_kwargs)
    result = {"transformers": transformers.__version__, "ids": ids}
    (out / "ids.json").write_text(json.dumps(result))
    return result


def load(out_dir: str) -> dict:
    import transformers
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    ids = {}
    for model_type, _, translation_kwargs in MODELS:
        folder = str(Path(out_dir) / model_type)
        model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        ids[model_type] = decode_all(model, tokenizer, translation_kwargs)
    return {"transformers": transformers.__version__, "ids": ids}


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    print(json.dumps({"save": save, "load": load}[command](*args)))
