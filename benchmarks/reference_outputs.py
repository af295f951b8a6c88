"""Reference outputs of every model type, to check that a refactoring changes no behaviour.

    python benchmarks/reference_outputs.py save /tmp/ref.pt      # with the code before the change
    python benchmarks/reference_outputs.py check /tmp/ref.pt     # after it: exit 1 on any difference

18 tiny configurations (every mechanism of each paper switched on somewhere: units, merges, links, memories,
phrase types and compositions, branches and fusions, relative positions, tied/untied embeddings), fixed seeds:
state-dict keys and shapes, parameter order, eval logits / loss / aux losses / attentions / hidden states, the
eager kernel's logits, the skip_logits loss, greedy and beam-2 generations with their scores, and a training step
with dropout (loss and every gradient, both loss paths). Tolerance 1e-6 absolute. CPU, about 10 s.
"""

import sys

import torch

from hf_variants.model_classes import MODEL_CLASSES
from hf_variants.phrases import ngram_phrase_index

V, B, S, T = 61, 3, 9, 7
L2 = dict(languages=["en", "de"])
CASES = {
    "nmt_post": ("transformer_nmt", {}),
    "nmt_pre_rel": (
        "transformer_nmt",
        dict(
            normalize_before=True,
            max_relative_positions=3,
            relative_position_values=True,
            position_embedding_type="learned",
            output_bias=True,
            label_smoothing=0.1,
        ),
    ),
    "nmt_untied": (
        "transformer_nmt",
        dict(tie_word_embeddings=False, share_encoder_decoder_embeddings=False, max_relative_positions=2),
    ),
    "mute_seq": ("mute_nmt", dict(max_relative_positions=3, label_smoothing=0.1)),
    "mute_plain": ("mute_nmt", dict(max_relative_positions=3, merge="plain", normalize_before=False)),
    "mimo_mix": ("mimo_nmt", dict(num_transformations=2, mixing_init_std=0.5, **L2)),
    "mimo_merge": ("mimo_nmt", dict(num_transformations=3, mixing_init_std=0.5, mimo_memory="merge", **L2)),
    "mimo_plain": ("mimo_nmt", dict(num_transformations=2, mimo=False, task_attention=False, **L2)),
    "mimo_rel": (
        "mimo_nmt",
        dict(
            num_transformations=2, mixing_init_std=0.5, lipschitz_init=False, position_embedding_type="learned", **L2
        ),
    ),
    "mgsa_syn": ("mgsa_nmt", dict(max_relative_positions=3, relative_position_values=True, mgsa_layers=[0, 1])),
    "mgsa_syn_proj": ("mgsa_nmt", dict(mgsa_phrase_kv="project", phrase_composition="lstm", tag_classifier="shared")),
    "mgsa_ngram": (
        "mgsa_nmt",
        dict(phrase_type="ngram", ngram_sizes=[3, 2], phrase_composition="lstm", phrase_interaction="lstm"),
    ),
    "mgsa_ngram_pool": (
        "mgsa_nmt",
        dict(phrase_type="ngram", ngram_sizes=[2], phrase_composition="max_pool", phrase_interaction="none"),
    ),
    "tied": ("tied_nmt", dict(max_relative_positions=3, **L2)),
    "tied_untied": ("tied_nmt", dict(tie_word_embeddings=False, **L2)),
    "hysan_gated": (
        "hysan_nmt",
        dict(local_k=2, max_relative_positions=3, relative_position_values=True, gate_reduction=4),
    ),
    "hysan_concat": ("hysan_nmt", dict(local_k=2, fusion="concat")),
    "hysan_sum": ("hysan_nmt", dict(local_k=[1, 2], fusion="sum", normalize_before=False)),
}


def build(name, **extra):
    model_type, kw = CASES[name]
    config_class, _, gen_class = MODEL_CLASSES[model_type]
    config = config_class.from_preset("tiny", vocab_size=V, **{**kw, **extra})
    torch.manual_seed(0)
    return gen_class(config)


def batch(model):
    config = model.config
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, V, (B, S), generator=g)
    mask = torch.ones_like(ids)
    for row, length in enumerate((9, 6, 4)):
        mask[row, length:] = 0
    ids = ids.masked_fill(mask == 0, config.pad_token_id)
    labels = torch.randint(4, V, (B, T), generator=g)
    labels[0, -2:] = -100
    inputs = {"input_ids": ids, "attention_mask": mask}
    mt = config.model_type
    if mt in ("mimo_nmt", "tied_nmt"):
        inputs["tgt_lang_ids"] = torch.tensor([1, 0, 1])
    if mt == "mgsa_nmt" and config.phrase_type == "syntactic":
        index = ngram_phrase_index(mask, [4, 2, 1][: config.syntactic_levels])
        tags = torch.randint(0, len(config.tag_labels), (*index.shape[:2], index.shape[-1]), generator=g)
        slots = torch.arange(index.shape[-1])
        inputs["phrase_index"] = index
        inputs["phrase_tags"] = tags.masked_fill(slots[None, None, :] > index.max(-1, keepdim=True).values, -100)
    return inputs, labels


def flat(out, prefix, res):
    if isinstance(out, torch.Tensor):
        res[prefix] = out.detach().float().clone()
    elif isinstance(out, dict):
        for k, v in out.items():
            if v is not None:
                flat(v, f"{prefix}.{k}", res)
    elif isinstance(out, (tuple, list)):
        for i, v in enumerate(out):
            flat(v, f"{prefix}.{i}", res)


def record(name):
    res = {}
    model = build(name).eval()
    res["keys"] = sorted((k, tuple(v.shape)) for k, v in model.state_dict().items())
    res["order"] = [k for k, _ in model.named_parameters()]
    inputs, labels = batch(model)
    with torch.no_grad():
        out = model(**inputs, labels=labels, output_attentions=True, output_hidden_states=True)
        flat({k: v for k, v in out.items() if k not in ("cache", "past_key_values")}, "eval", res)
        out = model(**inputs, labels=labels, output_attentions=False, skip_logits=True)
        res["eval_skip_loss"] = out.loss.clone()
        model.config._attn_implementation = "eager"
        flat(model(**inputs, labels=labels).logits, "eager", res)
        model.config._attn_implementation = "sdpa"
        for beams in (1, 2):
            g = model.generate(
                **inputs, num_beams=beams, max_new_tokens=6, output_scores=True, return_dict_in_generate=True
            )
            res[f"gen{beams}"] = g.sequences.clone()
            flat(list(g.scores), f"gen{beams}.scores", res)
    # training step with dropout
    model = build(name, dropout=0.1, attention_dropout=0.1, activation_dropout=0.1).train()
    torch.manual_seed(5)
    out = model(**inputs, labels=labels)
    out.loss.backward()
    res["train_loss"] = out.loss.detach().clone()
    for k, p in model.named_parameters():
        if p.grad is not None:
            res[f"grad.{k}"] = p.grad.clone()
    torch.manual_seed(6)
    model.zero_grad()
    out = model(**inputs, labels=labels, skip_logits=True)
    out.loss.backward()
    res["train_skip_loss"] = out.loss.detach().clone()
    for k, p in model.named_parameters():
        if p.grad is not None:
            res[f"grad2.{k}"] = p.grad.clone()
    return res


def main():
    mode, path = sys.argv[1], sys.argv[2]
    names = sys.argv[3:] or list(CASES)
    if mode == "save":
        torch.save({n: record(n) for n in names}, path)
        print("saved", len(names))
        return
    ref = torch.load(path)
    bad = 0
    for n in names:
        before = bad
        got = record(n)
        want = ref[n]
        if got["keys"] != want["keys"]:
            print(n, "KEYS DIFFER", set(got["keys"]) ^ set(want["keys"]))
            bad += 1
        for k in set(got) | set(want):
            if k == "order":
                if got[k] != want[k]:
                    print(n, "PARAMETER ORDER DIFFERS")
                    bad += 1
                continue
            if k == "keys":
                continue
            if k not in got or k not in want:
                print(n, "missing", k, k in got, k in want)
                bad += 1
                continue
            a, b = got[k], want[k]
            if a.shape != b.shape or not torch.allclose(a.float(), b.float(), atol=1e-6, rtol=0, equal_nan=True):
                d = (a.float() - b.float()).abs().max().item() if a.shape == b.shape else "shape"
                print(n, "DIFF", k, d)
                bad += 1
        print(n, "ok" if bad == before else "differs")
    print("FAILURES", bad)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
