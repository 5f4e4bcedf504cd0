"""Wall time of a `transformers.Trainer` run with `AttributionCallback` against the same run without it.

The run is an LDS benchmark configuration's full-data training (`lds.CONFIGS`, default `cpu`: a 2-layer,
8-expert qwen3_moe on 256 prompt/completion rows, batch 16, 10 epochs = 160 optimizer steps). The callback
collects at the ends of epochs `--epochs` (default 2,4,6,8,10: five collections, the schedule whose
average `benchmarks/lds_trainer.py` measures), each the whole training set's index rows (p=32) and EK-FAC
factors (two more passes), the library's defaults. Runs alternate (plain, callback, callback, plain, ...)
so drift hits both alike; the ratio's CI is a bootstrap over the paired repeats.

    nice -n 10 python benchmarks/trainer_overhead.py                       # CPU
    python benchmarks/trainer_overhead.py --device cuda --config gpu       # a GPU, side by side in one process
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import lds  # noqa: E402

import moe_attrib as ma  # noqa: E402
from moe_attrib.data import load_examples  # noqa: E402
from moe_attrib.model.zoo import train_tokenizer  # noqa: E402
from moe_attrib.synthetic import multi_domain_corpus, texts  # noqa: E402
from moe_attrib.workflows.trainer import trainer_rows  # noqa: E402


def data(cfg: lds.Config, root: Path):
    train, _ = multi_domain_corpus(cfg.people, cfg.arithmetic, cfg.sequences, cfg.queries_per_domain, cfg.seed,
                                   fact_queries="statement", shared_vocab=cfg.shared_vocab)  # fmt: skip
    tokenizer = train_tokenizer(texts(train))
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    return tokenizer, load_examples(str(root / "train.jsonl"), tokenizer)


def one_run(
    cfg: lds.Config, tokenizer, examples, device: str, out: Path, steps: list[int] | None
) -> tuple[float, float]:
    """Wall and process CPU seconds of `trainer.train()` (with the callback collecting at `steps`, or none); the CPU
    time is what a machine shared with other jobs measures more steadily."""
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

    rows = trainer_rows(examples)
    model = lds.make_model(cfg, len(tokenizer), device).train()
    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=cfg.batch, num_train_epochs=cfg.epochs, learning_rate=cfg.lr,
        lr_scheduler_type="linear", weight_decay=0.0, max_grad_norm=0.0, seed=cfg.seed, save_strategy="no",
        logging_strategy="no", report_to=[], use_cpu=device == "cpu", disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    callbacks = [ma.AttributionCallback(steps)] if steps else []
    trainer = Trainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer,
                      data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True), callbacks=callbacks)  # fmt: skip
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start, cpu = time.perf_counter(), time.process_time()
    trainer.train()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="cpu", choices=sorted(lds.CONFIGS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--epochs", default="2,4,6,8,10", help="collect at the end of these epochs")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs")
    parser.add_argument("--no_warmup", action="store_true", help="skip the untimed first run (imports, allocator)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--results", default=str(lds.ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = lds.CONFIGS[args.config]
    with tempfile.TemporaryDirectory(prefix="trainer-overhead-") as tmp:
        tokenizer, examples = data(cfg, Path(tmp))
        per_epoch = -(-len(examples) // cfg.batch)
        steps = [int(e) * per_epoch for e in args.epochs.split(",")]
        if not args.no_warmup:
            one_run(cfg, tokenizer, examples, args.device, Path(tmp) / "warmup", None)  # imports, allocator, kernels
        plain, collected = [], []
        for r in range(args.repeats):
            order = [None, steps] if r % 2 == 0 else [steps, None]
            for s in order:
                t = one_run(cfg, tokenizer, examples, args.device, Path(tmp) / f"run-{r}-{bool(s)}", s)
                (collected if s else plain).append(t)
                print(
                    f"repeat {r}: {'callback' if s else 'plain   '} {t[0]:7.2f} s wall, {t[1]:7.2f} s cpu", flush=True
                )
    plain_a, coll_a = np.array(plain), np.array(collected)  # [repeats, (wall, cpu)]
    ratios = coll_a / plain_a
    rng = np.random.default_rng(0)
    boot = np.array([ratios[rng.integers(0, len(ratios), len(ratios))].mean(0) for _ in range(2000)])
    lo, hi = np.quantile(boot, [0.025, 0.975], axis=0)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu ({args.threads} threads)"
    result = {
        "config": args.config,
        "device": device_name,
        "examples": len(examples),
        "optimizer_steps": cfg.epochs * per_epoch,
        "collection_steps": steps,
        "plain_wall_s": plain_a[:, 0].tolist(),
        "callback_wall_s": coll_a[:, 0].tolist(),
        "plain_cpu_s": plain_a[:, 1].tolist(),
        "callback_cpu_s": coll_a[:, 1].tolist(),
        "wall_ratio_mean": float(ratios[:, 0].mean()),
        "wall_ratio_ci95": [float(lo[0]), float(hi[0])],
        "cpu_ratio_mean": float(ratios[:, 1].mean()),
        "cpu_ratio_ci95": [float(lo[1]), float(hi[1])],
        "wall_seconds_per_collection": float((coll_a - plain_a)[:, 0].mean() / len(steps)),
        "load_average_1min_at_end": os.getloadavg()[0],
    }
    for k, what in enumerate(("wall", "process CPU")):
        print(f"{device_name}: callback / plain {what} time {ratios[:, k].mean():.3f} [{lo[k]:.3f}, {hi[k]:.3f}]")
    print(f"({len(steps)} collections of {len(examples)} rows in {result['optimizer_steps']} steps; "
          f"{result['wall_seconds_per_collection']:.2f} s wall per collection)")  # fmt: skip
    tag = "cpu" if args.device == "cpu" else "gpu"
    (Path(args.results) / f"trainer-overhead-{args.config}-{tag}.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
