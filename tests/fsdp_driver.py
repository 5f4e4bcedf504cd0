"""Run under torchrun by tests/test_sharding.py: `build --fsdp` and `ekfac --fsdp` of several model
directories in one launch (each launch costs seconds), through the CLI's own commands.

usage: torchrun --nproc_per_node K tests/fsdp_driver.py WORK DATA FAMILY [FAMILY ...]
writes WORK/<family>/fsdp_index, fsdp_ekfac and fsdp_scores.jsonl (DATA's rows as queries against
fsdp_index, query gradients sharded) from the model in WORK/<family>/model. 9 token batches: with 2
ranks one rank runs a filler step (Dist.lockstep).
EK-FAC is fitted on the MoE blocks (EKFAC_ARGS): on deepseek_v4, modules off the loss path (its attention
compressor) break `ekfac` also without --fsdp (main's bug, not sharding's)."""

import sys

from moe_attrib.app.cli import build_parser
from moe_attrib.model.distributed import teardown

EKFAC_ARGS = ["--filter_modules", "*.mlp.*"]
COMMON = ["--track_moe_experts", "--projection_dim", "8", "--token_batch_size", "80", "--precision", "fp32"]


def run(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    args.argv = argv
    code = args.func(args)
    if code != 0:
        raise SystemExit(f"fsdp_driver: {' '.join(argv)} exited {code}")


def main() -> None:
    work, data, families = sys.argv[1], sys.argv[2], sys.argv[3:]
    try:
        for family in families:
            model = f"{work}/{family}/model"
            run(
                [
                    "build",
                    model,
                    data,
                    "--index",
                    f"{work}/{family}/fsdp_index",
                    "--fsdp",
                    "--overwrite",
                    "--quiet",
                    *COMMON,
                ]
            )
            ekfac = f"{work}/{family}/fsdp_ekfac"
            run(["ekfac", model, data, "--out", ekfac, "--fsdp", "--overwrite", "--quiet", *COMMON, *EKFAC_ARGS])
            scores = f"{work}/{family}/fsdp_scores.jsonl"
            run(["score", "--index", f"{work}/{family}/fsdp_index", model, data, "--out", scores, "--fsdp"])
    finally:
        teardown()


if __name__ == "__main__":
    main()
