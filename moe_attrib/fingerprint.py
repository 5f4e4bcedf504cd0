"""Fingerprints of a model's weights and of a tokenizer, and the checks that compare them.

An index and its EK-FAC factors record both fingerprints; scoring or fitting with a model or
tokenizer that is not the one they were made with is an error before any work, instead of
scores that are silently wrong. The fingerprints are cheap (a strided sample of every tensor,
not a full hash) and stable: the same checkpoint gives the same value on every load and device.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import torch
from torch import nn

from moe_attrib.errors import MoeAttribError
from moe_attrib.model.sharding import sample_values

SAMPLES_PER_TENSOR = 1024


class FingerprintError(MoeAttribError, ValueError):
    """A model, tokenizer or factors that do not belong to the index or factors they are used with."""


def model_fingerprint(model: nn.Module) -> str:
    """sha256 over every state_dict tensor's name, shape and a strided sample of its values.

    Call it on the model as loaded (before `expand_moe`). Values are hashed as float32, so a
    model stored in bf16 and loaded in fp32 hashes like the same model loaded in bf16; the
    dtype is not part of the hash (record it separately). Same value on CPU and GPU, and for a
    model sharded with FSDP2 (`--fsdp`; every rank must call it then: samples are gathered).
    """
    h = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
                continue
            numel = tensor.numel()
            stride = max(1, numel // SAMPLES_PER_TENSOR)
            sample = sample_values(tensor, torch.arange(0, numel, stride)[:SAMPLES_PER_TENSOR])
            sample = sample.float() if sample.is_floating_point() or sample.is_complex() else sample.long()
            h.update(f"{name}|{tuple(tensor.shape)}|".encode())
            h.update(np.ascontiguousarray(sample.cpu().numpy()).tobytes())
    return h.hexdigest()


PROBE = "moe-attrib fingerprint probe: Hello, world! 12345"


def tokenizer_fingerprint(tokenizer) -> str | None:
    """sha256 over the vocabulary, the special tokens and the ids of a probe text (which
    captures added BOS/EOS); None for no tokenizer (pretokenized data)."""
    if tokenizer is None:
        return None
    state = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", [])),
        "probe": list(tokenizer(PROBE, add_special_tokens=True)["input_ids"]),
    }
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()


def check_model(settings: dict, model: nn.Module | None = None, tokenizer=None, *, what: str = "the index") -> None:
    """Raise `FingerprintError` when `model` (weights) or `tokenizer` differ from those
    recorded in `settings` (an index manifest's or ekfac.json's settings).

    A fingerprint that was not recorded (an index from an older version) is not compared."""
    problems = []
    if model is not None and settings.get("model_fingerprint"):
        now = model_fingerprint(model)
        if now != settings["model_fingerprint"]:
            dtype = str(next(model.parameters()).dtype)
            hint = (
                f"; {what} was made in {settings['dtype']}, this model is loaded in {dtype}: load it the same way"
                if settings.get("dtype") and settings["dtype"] != dtype
                else ""
            )
            problems.append(
                f"the model's weights differ from those {what} was made with "
                f"(weights fingerprint {now[:12]} vs {settings['model_fingerprint'][:12]}, "
                f"made from {settings.get('model')!r}{hint})"
            )
    if tokenizer is not None and settings.get("tokenizer_fingerprint"):
        now = tokenizer_fingerprint(tokenizer)
        if now != settings["tokenizer_fingerprint"]:
            problems.append(
                f"the tokenizer differs from the one {what} was made with "
                f"(tokenizer fingerprint {now[:12]} vs {settings['tokenizer_fingerprint'][:12]})"
            )
    if problems:
        raise FingerprintError("; ".join(problems) + f". Use the model and tokenizer {what} was made with, or rebuild.")


def check_settings_match(a: dict, b: dict, *, a_name: str, b_name: str) -> None:
    """Raise `FingerprintError` when two recorded settings (index vs EK-FAC factors) name
    different weights or tokenizers; fingerprints missing on either side are not compared."""
    for key, label in (("model_fingerprint", "model weights"), ("tokenizer_fingerprint", "tokenizer")):
        if a.get(key) and b.get(key) and a[key] != b[key]:
            dtypes = f", dtype {b['dtype']} vs {a['dtype']}" if a.get("dtype") != b.get("dtype", a.get("dtype")) else ""
            raise FingerprintError(
                f"{b_name} was made with other {label} than {a_name} ({key} {b[key][:12]} vs {a[key][:12]}{dtypes}); "
                f"fit them with the model {a_name} was made from ({a.get('model')!r})."
            )
