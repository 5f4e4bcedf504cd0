"""Regenerate the coverage table of docs/supported-models.md: `python docs/gen_supported_models.py`.

Tiny models come from `moe_attrib.model.zoo`; "default config" models are built on the meta device
from each family's default transformers config (real-model sizes, no weights allocated).
"""

from __future__ import annotations

import warnings

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import moe_attrib as ma
from moe_attrib.model.zoo import FAMILIES, tiny_model

warnings.simplefilter("ignore")


def coverage(model) -> tuple[float, float, ma.CoverageReport]:
    on = ma.discover(model, track_moe_experts=True)
    off = ma.discover(model, track_moe_experts=False, warn=False)
    return on.coverage, off.coverage, on


def full_size(family: str):
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.for_model(family))
    except Exception as err:  # noqa: BLE001 - reported in the table
        return err


def main() -> None:
    print("| family | experts class | layout | tiny: tracked on | tiny: off | default config: params | on | off |")
    print("|---|---|---|---|---|---|---|---|")
    for family in FAMILIES:
        on, off, report = coverage(tiny_model(family))
        lay = report.experts[0]
        layout = ", ".join(
            [
                "gated" if lay.has_gate else "non-gated",
                "transposed" if lay.transposed else "[E,out,in]",
                "bias" if lay.has_bias else "no bias",
                lay.family + ("" if lay.decorated else " (undecorated)"),
            ]
        )
        big = full_size(family)
        if isinstance(big, Exception):
            cells = f"n/a ({type(big).__name__}) | | "
        else:
            b_on, b_off, b_rep = coverage(big)
            cells = f"{b_rep.total_params / 1e9:.1f}B | {b_on:.2%} | {b_off:.2%}"
        print(f"| {family} | {type(lay.module).__name__} | {layout} | {on:.2%} | {off:.2%} | {cells} |")


if __name__ == "__main__":
    main()
