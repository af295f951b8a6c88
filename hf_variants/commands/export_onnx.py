"""`hf-variants-export-onnx` (`python -m hf_variants.export_onnx`): export a saved model to ONNX Runtime graphs,
fp32 and optionally int8. What the export writes: `hf_variants.onnx.export`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..onnx import export as library
from ..onnx.export import COMMAND, MANIFEST, MIN_OPSET, export
from ..onnx.quantization import DEFAULT_INT8_ACTIVATIONS, DEFAULT_INT8_WEIGHTS, INT8_ACTIVATIONS, INT8_WEIGHTS
from ..outputs import discard_output_dir, int_in_range
from .common import UsageError, add_model_folder_flags, add_output_dir_flags, exits_on_refusal
from .loading import check_export_paths, load_model_folder

# the calibration sentences translated when --calibration_sentences is not given
CALIBRATION_SENTENCES = 1000


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-variants-export-onnx",
        description=library.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_folder_flags(parser, "saved hf_variants model folder")
    add_output_dir_flags(parser, COMMAND)
    parser.add_argument("--int8", action="store_true", help="also write int8 graphs (dynamic quantization)")
    parser.add_argument(
        "--int8_weights",
        choices=sorted(INT8_WEIGHTS),
        default=DEFAULT_INT8_WEIGHTS,
        help="int8 weight format (see INT8_WEIGHTS): s8_reduce_range (default; VNNI's fast kernel, right on every "
        "CPU) or u8 (about half the error, 2-4x slower MatMuls on VNNI CPUs)",
    )
    parser.add_argument(
        "--int8_activations",
        choices=list(INT8_ACTIVATIONS),
        default=DEFAULT_INT8_ACTIVATIONS,
        help="how the int8 graphs quantize activations: per_row (default: one scale per token, so a sentence gets "
        "the same translation in any batch), calibrated (one fixed scale per activation, the largest value it took "
        "translating --calibration_data; batch-independent too and faster, a Relu's output per row) or per_tensor "
        "(one scale per call over the whole batch, as onnxruntime's quantize_dynamic: a sentence's translation can "
        "depend on its batch)",
    )
    parser.add_argument(
        "--calibration_data",
        metavar="FILE",
        help="with --int8_activations calibrated: source sentences, one per line (plain or .gz), like the text the "
        "model will translate (its validation set); a value beyond what they reach saturates",
    )
    parser.add_argument(
        "--calibration_src_lang",
        metavar="CODE",
        help="with --calibration_data: its sentences' language, for a model that marks the source language with a "
        "token and translates from several (a converted M2M100 / NLLB-200)",
    )
    parser.add_argument(
        "--calibration_sentences",
        type=int_in_range(1),
        help=f"with --calibration_data: translate at most its first N sentences (default {CALIBRATION_SENTENCES})",
    )
    parser.add_argument(
        "--opset", type=int_in_range(MIN_OPSET), help=f"ONNX opset (>= {MIN_OPSET}; default: the exporter's)"
    )
    parser.add_argument(
        "--no_fuse_attention",
        dest="fuse_attention",
        action="store_false",
        help="keep attention as generic ONNX ops (default: plain scaled dot-product attention becomes ONNX "
        "Runtime's com.microsoft::MultiHeadAttention; the manifest's attention_fusion says which modules)",
    )
    parser.add_argument(
        "--no_shared_cache",
        dest="shared_cache",
        action="store_false",
        help="do not write the shared-cache step graph (default: written where every decoder attention is "
        "fused; the manifest's shared_cache says whether, or why not)",
    )
    parser.add_argument(
        "--scoring_graph",
        action="store_true",
        help="also write the scoring graph: forced decoding of whole targets in one run (`hf-variants-score "
        "--onnx`), instead of the step graph one position at a time",
    )
    return parser


@exits_on_refusal("hf-variants-export-onnx")
def main(argv=None) -> Path:
    args = build_parser().parse_args(argv)
    check_export_paths(args.model, args.tokenizer, args.output_dir, COMMAND, args.force)
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as error:
        raise SystemExit(
            f"The ONNX export needs onnx, onnxscript and onnxruntime: pip install 'hf-variants[onnx]' ({error})."
        ) from error
    calibration = calibration_sources(args)
    model, tokenizer = load_model_folder(args.model, args.tokenizer)
    try:
        out = export(
            model,
            tokenizer,
            args.output_dir,
            int8=args.int8,
            int8_weights=args.int8_weights,
            int8_activations=args.int8_activations,
            opset=args.opset,
            force=args.force,
            fuse_attention=args.fuse_attention,
            shared_cache=args.shared_cache,
            scoring=args.scoring_graph,
            calibration_sources=calibration,
            calibration_src_lang=args.calibration_src_lang,
        )
    except (ValueError, FileExistsError) as error:
        raise UsageError(str(error)) from None
    finally:
        discard_output_dir(args.output_dir, COMMAND)  # an export that failed leaves no temporary folder
    manifest = json.loads((out / MANIFEST).read_text())
    print(
        f"Saved the ONNX model to {out} (export {manifest['export_seconds']} s"
        + (f", int8 {manifest['quantize_seconds']} s" if args.int8 else "")
        + ")"
    )
    return out


def calibration_sources(args) -> list[str] | None:
    """The first `--calibration_sentences` non-empty lines of `--calibration_data` for `--int8_activations
    calibrated` (a UsageError naming the flag where one is missing or misplaced, or the file where it is unreadable
    or has no sentence); None for the other schemes."""
    from ..training.corpus import DataError, read_lines

    calibrated = args.int8 and args.int8_activations == "calibrated"
    if args.int8_activations == "calibrated" and not args.int8:
        raise UsageError("--int8_activations calibrated: add --int8 (the activations of the int8 graphs)")
    if not calibrated:
        for flag in ("calibration_data", "calibration_sentences", "calibration_src_lang"):
            if getattr(args, flag) is not None:
                raise UsageError(f"--{flag}: only with --int8 --int8_activations calibrated")
        return None
    if not args.calibration_data:
        raise UsageError(
            "--int8_activations calibrated: pass --calibration_data FILE (source sentences, one per line, like the "
            "text the model will translate)"
        )
    try:
        lines = [line for line in read_lines(args.calibration_data) if line.strip()]
    except DataError as error:
        raise UsageError(f"--calibration_data: {error}") from None
    if not lines:
        raise UsageError(f"--calibration_data {args.calibration_data}: the file has no sentence")
    return lines[: args.calibration_sentences or CALIBRATION_SENTENCES]


def cli() -> None:
    main()


if __name__ == "__main__":
    cli()
