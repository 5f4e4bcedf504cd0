"""LDS of the run-averaged default against the last checkpoint alone, collected by `AttributionCallback` during
a `transformers.Trainer` run (not by hand), on the cached benchmark configurations.

The full-data model of a configuration is trained again with `Trainer`: the same initial weights
(`lds.make_model`), data, epochs, batch size, peak learning rate and linear decay to 0 as `lds.train`, AdamW
without weight decay or gradient clipping; the data order is the Trainer's own sampler (seeded with the
configuration's seed), not `lds.train`'s. The prompt is masked in each row's `labels` and a stock
`DataCollatorForSeq2Seq` pads them, so the callback reads the loss from the batches. It collects index rows
and EK-FAC factors (the library's defaults, p=32) at the ends of epochs `--epochs`; `ma.score_run` then
scores the queries against every checkpoint with the default pipeline (EK-FAC, coupling, output balance).
The ground truth is the cached subset models' query losses (`lds.py`); the subset models were trained by
`lds.train`. Run `python benchmarks/lds.py --config NAME` first:

    nice -n 10 python benchmarks/lds_trainer.py cpu cpu-shared
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import lds  # noqa: E402

import moe_attrib as ma  # noqa: E402
from moe_attrib.workflows.trainer import trainer_rows  # noqa: E402


def trainer_run(cfg: lds.Config, cached: lds.Cached, out: Path, epochs: list[int]) -> list[int]:
    """Train the full model with `Trainer` + `AttributionCallback` into `out`; returns the collection steps."""
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

    examples = cached.examples
    per_epoch = -(-len(examples) // cfg.batch)
    steps = [e * per_epoch for e in epochs]
    rows = trainer_rows(examples)
    model = lds.make_model(cfg, len(cached.tokenizer), "cpu").train()
    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=cfg.batch, num_train_epochs=cfg.epochs, learning_rate=cfg.lr,
        lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, seed=cfg.seed,
        data_seed=cfg.seed, save_strategy="no", logging_steps=per_epoch, report_to=[], use_cpu=True,
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    callback = ma.AttributionCallback(steps)
    collator = DataCollatorForSeq2Seq(cached.tokenizer, padding=True)
    trainer = Trainer(model=model, args=args, train_dataset=rows, processing_class=cached.tokenizer,
                      data_collator=collator, callbacks=[callback])  # fmt: skip
    trainer.train()
    return steps


def run(name: str, root: Path, epochs: list[int], results: Path) -> dict:
    cfg = lds.CONFIGS[name]
    cached = lds.load_cached(name, root)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lds-trainer-") as tmp:
        steps = trainer_run(cfg, cached, Path(tmp) / "run", epochs)
        trained = time.perf_counter() - start
        scored = ma.score_run(Path(tmp) / "run", cached.queries, out=Path(tmp) / "scores", device="cpu")
        mats = [np.load(p) for p in scored.matrices]
    assert [p.name for p in scored.checkpoints] == [f"checkpoint-{s}" for s in steps]
    variants = {
        f"default, last checkpoint (epoch {epochs[-1]})": lds.per_query_lds(mats[-1], cached.subsets, cached.losses),
        f"default, mean over epochs {epochs} (score --run)": lds.per_query_lds(
            np.mean(mats, axis=0), cached.subsets, cached.losses
        ),
    }
    lds.print_variants(cached.title + ", Trainer + AttributionCallback", variants, cached.domains, "last", 62)
    last, mean = variants.values()
    lo, hi = lds.bootstrap(mean - last)
    result = {
        "config": name,
        "epochs": epochs,
        "steps": steps,
        "queries": len(cached.queries),
        "subset_models": len(cached.subsets),
        "variants": {k: {"lds": float(v.mean()), "ci95": list(lds.bootstrap(v))} for k, v in variants.items()},
        "mean_minus_last": {"value": float(mean.mean() - last.mean()), "ci95": [lo, hi]},
        "seconds": {"train_and_collect": trained, "total": time.perf_counter() - start},
        "torch": torch.__version__,
    }
    print(f"  mean over checkpoints - last checkpoint: {mean.mean() - last.mean():+.3f} [{lo:+.3f}, {hi:+.3f}]")
    (results / f"lds-trainer-{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main() -> None:
    parser = lds.cached_configs_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--epochs", default="2,4,6,8,10", help="collect at the end of these epochs (the last: the model)"
    )
    parser.add_argument("--results", default=str(lds.ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    for name in args.configs:
        run(name, Path(args.cache), [int(e) for e in args.epochs.split(",")], Path(args.results))


if __name__ == "__main__":
    main()
