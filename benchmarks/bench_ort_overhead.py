#!/usr/bin/env python
"""Where ONNX Runtime's decoding time goes: the BeamSearch op (`hf_variants.onnx_generation`) against the same
graph work run alone, side by side.

The baseline of a dims class (bench_inference's random MarianMTModel weights converted to ours) is exported once
(fused attention, fp32 and int8). For each precision and decoding (`--batch` 32 sources of up to `--src_len` 15
tokens, exactly `--new_tokens` 20 new tokens, greedy and beam 4 with length penalty 0.6), four timings at
`--threads` threads, interleaved, after one warm-up each, medians of `--reps` (process CPU time and wall time):

- `generate`: `OrtModelForSeq2SeqLM.generate` with `use_search_op=True` (the op; the default on this folder is
  `onnx_bound`, greedy and beam search bound on the shared-cache graph, timed by bench_ort_search_op.py);
- `op`: the op's session run alone, on the feeds that generate() passed it;
- `graphs`: the work inside the op without the op: the source graph once at `batch` rows, then the step graph
  `new_tokens` times on the concatenated cache (past lengths 0 .. new_tokens - 1; the first step at `batch` rows,
  the others at `batch * beams`, as the op runs them), each run through `InferenceSession.run` on inputs prepared
  beforehand;
- `source`: the source graph alone.

`op - graphs` is what the op adds per decoding: per step, log-softmax over `rows x vocabulary`, the vocabulary mask,
the top-2k selection and the scorer, feeding present to past (beam search: each layer's cache gathered per beam),
and the subgraph calls. `generate - op`: transformers' generate() around the op (input checks, the processors'
mapping, the output's conversion).

    python benchmarks/bench_ort_overhead.py [--size small] [--reps 5] [--threads 1]

Prints milliseconds per decoding and the shares, the CPU model; writes benchmarks/results/ort_overhead.json.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_inference import _Vocabulary, marian_and_ours  # noqa: E402
from bench_ort_fusion import cpu_model, decoding_parser, generation_settings, write_results  # noqa: E402
from timing import random_batch  # noqa: E402


def captured_op_call(model, inputs: dict, gen: dict):
    """(session, feeds) of the BeamSearch op run that `model.generate(**inputs, **gen)` makes."""
    runner = model.search_op_runner()
    original, seen = runner.session, {}

    class _Recorder:
        def __init__(self, session):
            self.session = session

        def run(self, names, feeds):
            seen.update(session=self.session, feeds=dict(feeds))
            return self.session.run(names, feeds)

    runner.session = lambda attributes: _Recorder(original(attributes))
    try:
        model.generate(**inputs, **gen, use_search_op=True)
    finally:
        runner.session = original
    if model.last_decoding["path"] != "search_op":
        raise RuntimeError(f"generate() did not run the op: {model.last_decoding}")
    return seen["session"], seen["feeds"]


def graph_runs(folder: Path, precision: str, options, inputs: dict, beams: int, new_tokens: int):
    """`run()`: the source graph once, then the step graph `new_tokens` times on the concatenated cache, as the op
    runs them; and `source()`: the source graph alone. Inputs are prepared here, outside the timed calls."""
    import json

    import numpy as np

    from hf_variants.onnx.generation import inference_session

    manifest = json.loads((folder / "onnx_manifest.json").read_text())
    files = manifest["graphs"][precision]
    providers = ["CPUExecutionProvider"]
    source = inference_session(str(folder / files["encoder"]), options, providers)  # the op's optimizers
    step = inference_session(str(folder / files["decoder"]), options, providers)
    source_feeds = {"input_ids": inputs["input_ids"].numpy(), "attention_mask": inputs["attention_mask"].numpy()}
    encoded = dict(zip([o.name for o in source.get_outputs()], source.run(None, source_feeds)))
    batch = source_feeds["input_ids"].shape[0]
    wanted = {i.name for i in step.get_inputs()}
    steps = []
    for past in range(new_tokens):
        rows = batch if past == 0 else batch * beams

        def expand(array, rows=rows):
            return np.repeat(array, rows // batch, axis=0)

        feeds = {
            "decoder_input_ids": np.full((rows, 1), 5, dtype=np.int64),
            "encoder_attention_mask": expand(source_feeds["attention_mask"]),
        }
        feeds.update({name: expand(value) for name, value in encoded.items()})
        for layer in range(manifest["num_layers"]):
            key = encoded[f"cross_key.{layer}"]
            for kind in ("key", "value"):
                feeds[f"past_{kind}.{layer}"] = np.zeros((rows, key.shape[1], past, key.shape[3]), np.float32)
        steps.append({name: value for name, value in feeds.items() if name in wanted})

    def run():
        source.run(None, source_feeds)
        for feeds in steps:
            step.run(None, feeds)

    return run, lambda: source.run(None, source_feeds)


def main(argv=None) -> dict:
    args = decoding_parser(__doc__, 5, "ort_overhead.json").parse_args(argv)

    from hf_variants import OrtModelForSeq2SeqLM
    from hf_variants.onnx.export import export
    from hf_variants.onnx.modeling import default_session_options

    torch.set_num_threads(args.threads)
    _, ours = marian_and_ours(args.size, args.vocab)
    inputs, _ = random_batch(args.batch, args.src_len, 2, args.vocab)
    scratch = tempfile.TemporaryDirectory(prefix="bench_ort_overhead-")
    folder = export(ours, _Vocabulary(args.vocab), Path(scratch.name) / "onnx", int8=True)
    options = default_session_options(args.threads, spinning=True)  # the op's sessions' options
    results = {"cpu": cpu_model(), "size": args.size, "threads": args.threads, "batch": args.batch, "rows": {}}
    for beams in args.beams:
        gen = generation_settings(beams, args.new_tokens)
        calls = {}
        for precision in ("fp32", "int8"):
            model = OrtModelForSeq2SeqLM.from_pretrained(folder, precision=precision, num_threads=args.threads)
            session, feeds = captured_op_call(model, inputs, gen)
            graphs, source = graph_runs(folder, precision, options, inputs, beams, args.new_tokens)
            calls[f"generate_{precision}"] = lambda model=model: model.generate(**inputs, **gen, use_search_op=True)
            calls[f"op_{precision}"] = lambda session=session, feeds=feeds: session.run(None, feeds)
            calls[f"graphs_{precision}"] = graphs
            calls[f"source_{precision}"] = source
        cpu, wall = {name: [] for name in calls}, {name: [] for name in calls}
        for name, call in calls.items():
            call()  # warm-up
        for _ in range(args.reps):
            for name, call in calls.items():
                c, w = time.process_time(), time.perf_counter()
                call()
                cpu[name].append(time.process_time() - c)
                wall[name].append(time.perf_counter() - w)
        key = "greedy" if beams == 1 else f"beam{beams}"
        row = {
            "cpu_ms": {name: round(1000 * statistics.median(t), 2) for name, t in cpu.items()},
            "wall_ms": {name: round(1000 * statistics.median(t), 2) for name, t in wall.items()},
        }
        for precision in ("fp32", "int8"):
            ms = row["cpu_ms"]
            op, graphs = ms[f"op_{precision}"], ms[f"graphs_{precision}"]
            row[f"shares_{precision}"] = {
                "graphs / op": round(graphs / op, 3),
                "op overhead per step (ms)": round((op - graphs) / args.new_tokens, 3),
                "generate / op": round(ms[f"generate_{precision}"] / op, 3),
            }
            print(
                f"[{args.size} {key} {precision}] cpu ms: generate {ms[f'generate_{precision}']} | op {op} | "
                f"graphs {graphs} (source {ms[f'source_{precision}']}) | {row[f'shares_{precision}']}",
                flush=True,
            )
        results["rows"][key] = row
    scratch.cleanup()
    return write_results(results, args.output)


if __name__ == "__main__":
    main()
