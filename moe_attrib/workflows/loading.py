"""Loading what users name on the command line: `tiny:<family>` models, `save_pretrained`
directories and hub ids, and their tokenizers (or a separate `--tokenizer DIR`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from moe_attrib.data import hub_offline, looks_like_hub_id
from moe_attrib.workflows.checks import UsageError, check_model_spec

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def resolve_precision(precision: str, device: torch.device) -> torch.dtype:
    if precision == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def checkpoint_numel(spec: str) -> int | None:
    """Elements of every tensor of a local safetensors checkpoint, read from the files' headers alone
    (no weight is read); None where that is not known beforehand (`tiny:`, hub ids, `.bin` files)."""
    directory = Path(spec)
    if not directory.is_dir():
        return None
    index = directory / "model.safetensors.index.json"
    if index.exists():  # only the files transformers loads (repos may hold other copies, e.g. consolidated.*)
        files = sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
    elif (directory / "model.safetensors").exists():
        files = [directory / "model.safetensors"]
    else:
        files = sorted(directory.glob("*.safetensors"))
    total = 0
    for path in files:
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total if files else None


def device_free_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device (None for other devices: their memory is not ours to judge)."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


def load_model(spec: str, dtype: str | torch.dtype = "fp32") -> torch.nn.Module:
    """`tiny:<family>` (a bundled tiny random model), a local `save_pretrained` directory or a hub id."""
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else resolve_precision(dtype, torch.device("cpu"))
    try:
        check_model_spec(spec)
    except UsageError as err:
        raise UsageError(f"cannot load model: {err}") from err
    if spec.startswith("tiny:"):
        from moe_attrib.model.zoo import tiny_model

        return tiny_model(spec.split(":", 1)[1], dtype=torch_dtype)
    from transformers import AutoModelForCausalLM

    local = Path(spec).is_dir()
    try:
        return AutoModelForCausalLM.from_pretrained(spec, dtype=torch_dtype, local_files_only=local).eval()
    except (OSError, ValueError) as err:
        where = (
            "the local directory"
            if local
            else "the hub id (offline: HF_HUB_OFFLINE is set)"
            if hub_offline()
            else "the hub id"
        )
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UsageError(
            f"cannot load model {spec!r} from {where}: {first} Give a local save_pretrained directory, a hub id "
            "(with network access), or tiny:<family>."
        ) from err


def has_tokenizer_files(directory: Path) -> bool:
    return any((directory / name).exists() for name in TOKENIZER_FILES)


def load_tokenizer(model: str, tokenizer: str | None = None):
    """The tokenizer of `--tokenizer` (which must load) or of the model directory (None when it has
    none: pretokenized data still works and text data is an error naming the row)."""
    from transformers import AutoTokenizer

    if tokenizer is not None:
        if not Path(tokenizer).exists() and not looks_like_hub_id(tokenizer):
            raise UsageError(f"--tokenizer {tokenizer}: no such directory.")
        if Path(tokenizer).is_dir() and not has_tokenizer_files(Path(tokenizer)):
            raise UsageError(f"--tokenizer {tokenizer}: no tokenizer files in it ({', '.join(TOKENIZER_FILES)}).")
        try:
            return AutoTokenizer.from_pretrained(tokenizer, local_files_only=Path(tokenizer).exists())
        except (OSError, ValueError) as err:
            raise UsageError(f"--tokenizer {tokenizer}: cannot load a tokenizer from it ({err}).") from err
    if model.startswith("tiny:"):
        return None
    local = Path(model).exists()
    if local and not has_tokenizer_files(Path(model)):
        return None  # transformers would build an empty tokenizer from the config alone
    try:
        return AutoTokenizer.from_pretrained(model, local_files_only=local)
    except (OSError, ValueError, TypeError) as err:
        if local:
            return None
        offline = " (HF_HUB_OFFLINE is set)" if hub_offline() else ""
        raise UsageError(
            f"cannot load model {model!r}: its tokenizer cannot be fetched from the hub{offline} ({err}); "
            "give a local model directory, or --tokenizer DIR."
        ) from err


def model_name(spec: str) -> str:
    return str(Path(spec).resolve()) if Path(spec).exists() else spec
