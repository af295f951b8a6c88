"""The transformers versions the model code runs on, and the one place where the code differs between them.

A saved model carries this file (it is part of the model closure), so the check below runs under the transformers
of whoever loads the model, not only under the one this package was installed with.

Supported: `SUPPORTED_RANGE` (`>=5.23,<5.26`), the range the test suite runs (5.23, 5.24 and 5.25, each with
transformers' own common model and generation tests). Outside it the code warns once at import, naming the range
and the running version; on a version in `KNOWN_WRONG` (it loads and runs, but decodes wrongly) `generate` refuses,
naming it (`check_generation_supported`).

What differs between the supported versions, each read from transformers itself (its dataclass fields and function
signatures), not inferred from the version number:

- the name of the key/value cache: transformers 5.24 renamed the `past_key_values` argument and output field to
  `cache`. `generate()` passes the cache under `CACHE_NAME` to `forward`, reads it back from the output under
  `CACHE_NAME` and reorders it under that name. The models' own code calls it `cache`; their public `forward`s
  accept both names (`accepts_cache_alias`) and write the output field by its current name (`cache_field`,
  `output_cache`).
- the mask helpers' cache argument (`create_causal_mask(..., cache=)` in 5.24, `past_key_values=` before):
  `causal_mask`. Since 5.25 their signatures list the deprecated `past_key_values` too (so that code which filters
  its arguments by signature keeps passing it), and passing it warns: the current name is `cache` wherever the
  signature has it, whatever else it lists.
- loading: since 5.25 `from_pretrained` applies Hub kernels unless told not to (`use_kernels` defaults to yes) and
  then needs the `kernels` package (a new dependency of transformers; a load without it raises). These models have
  no layer a Hub kernel replaces, so their `from_pretrained` passes `use_kernels=False` unless the caller chose
  (`without_hub_kernels`): the default of 5.23 and 5.24, and on every version a load that needs no `kernels`.

Differences of 5.25 that need nothing here: `PreTrainedModel._is_stateful` is gone (no code of the models reads
it), `generate()`'s prefill reads `get_seq_length()` of every cache instead of only non-linear ones (the ONNX
Runtime caches answer it), and caches gained `get_recurrent_states_to_keep` and `activate_past_recording(**kwargs)`
for assisted decoding (transformers' `EncoderDecoderCache` the models use has them).

The tests that guard each dependency on transformers' internals are listed in docs/transformers-internals.md.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch
import transformers
from packaging.version import Version
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import Seq2SeqLMOutput

# The tested range, as pyproject.toml declares it.
SUPPORTED_RANGE = (">=5.23", "<5.26")
_LOWEST, _ABOVE = Version("5.23"), Version("5.26")
# Releases (or minors, "5.22") on which the models load and run but decode wrongly, with what goes wrong: `generate`
# refuses them. None is known: below the range, 5.20.2 and 5.22.2 pass every model and generation test of the suite
# (cached = uncached, static = dynamic cache, beam search, the pipeline; only the tests that call a newer
# transformers API fail), so they are warned about, not refused.
KNOWN_WRONG: dict[str, str] = {}

TRANSFORMERS_VERSION = transformers.__version__

# ------------------------------------------------------------------------------------------------- the cache name
# The name under which generate() passes the cache to forward and reads it from the output: "cache" since 5.24.
CACHE_NAME = "cache" if "cache" in Seq2SeqLMOutput.__dataclass_fields__ else "past_key_values"
LEGACY_CACHE_NAME = "past_key_values"
# "cache" first: since 5.25 the signature lists the deprecated "past_key_values" beside it
_MASK_CACHE_ARG = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


def cache_field(cache) -> dict:
    """`{name: cache}` for a transformers output class, under the running version's field name."""
    return {CACHE_NAME: cache}


def output_cache(outputs):
    """The cache of a transformers output object (None when it has none)."""
    return getattr(outputs, CACHE_NAME, None)


def accepts_cache_alias(forward):
    """Decorate a public `forward` whose cache argument is named `cache` so that it also takes `past_key_values`
    (the name generate() and callers use with transformers before 5.24; from 5.24 on it is deprecated there, and
    a `DeprecationWarning` says so, as transformers' own models do). Giving both is an error."""

    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        if LEGACY_CACHE_NAME in kwargs:
            if CACHE_NAME != LEGACY_CACHE_NAME and not torch.compiler.is_compiling():
                warnings.warn(
                    f"`{LEGACY_CACHE_NAME}` is deprecated since transformers 5.24: pass the cache as `cache`.",
                    DeprecationWarning,
                    stacklevel=2,
                )
            legacy = kwargs.pop(LEGACY_CACHE_NAME)
            if kwargs.get("cache") is not None and legacy is not None and legacy is not kwargs["cache"]:
                raise ValueError("Pass the key/value cache as `cache` or as `past_key_values`, not both.")
            if kwargs.get("cache") is None:
                kwargs["cache"] = legacy
        return forward(*args, **kwargs)

    return wrapper


def causal_mask(config, inputs_embeds, attention_mask, cache):
    """transformers' `create_causal_mask` with its cache argument under the running version's name."""
    return create_causal_mask(
        config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, **{_MASK_CACHE_ARG: cache}
    )


# ---------------------------------------------------------------------------------------------------- loading
def without_hub_kernels(kwargs: dict) -> dict:
    """`from_pretrained`'s keyword arguments with `use_kernels=False` unless the caller passed it (transformers 5.25
    applies Hub kernels by default and needs the `kernels` package for that; the models have no layer one replaces)."""
    kwargs.setdefault("use_kernels", False)
    return kwargs


# -------------------------------------------------------------------------------------------- the version check
def _release(version: str) -> Version:
    """The release of `version` (5.24.0.dev0 -> 5.24.0): a development build of a minor is that minor."""
    return Version(Version(version).base_version)


def is_supported(version: str | None = None) -> bool:
    return _LOWEST <= _release(version or TRANSFORMERS_VERSION) < _ABOVE


def known_wrong(version: str | None = None) -> str | None:
    """What goes wrong on `version` (default: the running one) when it is in `KNOWN_WRONG` (by release, or by
    minor as "5.22"), else None."""
    release = _release(version or TRANSFORMERS_VERSION)
    for spec, why in KNOWN_WRONG.items():
        spec_version = Version(spec)
        if release == spec_version or (len(spec_version.release) == 2 and release.release[:2] == spec_version.release):
            return why
    return None


def unsupported_message(version: str | None = None) -> str:
    version = version or TRANSFORMERS_VERSION
    return (
        f"hf_variants' model code is tested with transformers {','.join(SUPPORTED_RANGE)}; this is transformers "
        f"{version}. Its generation internals may differ: check translations against a supported version, or "
        f"install one (pip install 'transformers{','.join(SUPPORTED_RANGE)}')."
    )


def check_generation_supported(version: str | None = None) -> None:
    """Raise a RuntimeError naming `version` (default: the running one) when it is known to decode these models
    wrongly."""
    version = version or TRANSFORMERS_VERSION
    why = known_wrong(version)
    if why is not None:
        raise RuntimeError(
            f"transformers {version} decodes hf_variants' models wrongly ({why}); generate() refuses to run on it. "
            f"Install a supported version: pip install 'transformers{','.join(SUPPORTED_RANGE)}'."
        )


def warn_if_unsupported(version: str | None = None) -> bool:
    """Warn once per process and version when `version` (default: the running one) is outside `SUPPORTED_RANGE`;
    True when it warned."""
    return _warn_once(version or transformers.__version__)


@functools.cache
def _warn_once(version: str) -> bool:
    if is_supported(version):
        return False
    warnings.warn(unsupported_message(version), UserWarning, stacklevel=2)
    return True


warn_if_unsupported()
