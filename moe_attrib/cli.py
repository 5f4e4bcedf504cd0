"""The `moe-attrib` command."""

from __future__ import annotations

import argparse
import sys
import warnings

import torch


def load_model(spec: str, dtype: str = "fp32") -> torch.nn.Module:
    """`tiny:<family>` (a bundled tiny random model), a local `save_pretrained` directory or a hub id."""
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    if spec.startswith("tiny:"):
        from moe_attrib.zoo import tiny_model

        return tiny_model(spec.split(":", 1)[1], dtype=torch_dtype)
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(spec, dtype=torch_dtype).eval()
    except OSError as err:
        raise SystemExit(
            f"moe-attrib: cannot load model {spec!r}: {err}\n"
            "Give a local save_pretrained directory, a hub id (with network access), or tiny:<family>."
        ) from err


def cmd_inspect(args: argparse.Namespace) -> int:
    from moe_attrib.discovery import discover

    model = load_model(args.model, args.precision)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = discover(model, track_moe_experts=args.track_moe_experts)
    for w in caught:
        print(f"WARNING: {w.message}", file=sys.stderr)
    print(report)
    if report.experts:
        print("\nfused experts modules:")
        for lay in report.experts:
            flags = [
                "gated" if lay.has_gate else "non-gated",
                "transposed" if lay.transposed else "[E, out, in]",
                "bias" if lay.has_bias else "no bias",
                lay.family,
            ]
            print(f"  {lay.name}: {lay.num_experts} experts, {', '.join(lay.projections)} ({', '.join(flags)})")
    if report.routers:
        print("\nrouters: " + ", ".join(report.routers))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-attrib", description="Per-example gradient attribution for Mixture-of-Experts language models."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="coverage table: what will be attributed, what not and why")
    inspect.add_argument("model", help="tiny:<family>, a save_pretrained directory, or a hub id")
    inspect.add_argument("--track_moe_experts", action="store_true", help="attribute every expert of fused MoE layers")
    inspect.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    inspect.set_defaults(func=cmd_inspect)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
