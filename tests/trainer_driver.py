"""A `Trainer` run with `AttributionCallback`, as torchrun runs it (tests/test_trainer.py):

torchrun --nproc_per_node=2 tests/trainer_driver.py DATA_DIR OUT_DIR
"""

import sys

from transformers import AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments

import moe_attrib as ma
from moe_attrib.data import load_examples
from moe_attrib.model.zoo import tiny_model
from moe_attrib.workflows.trainer import trainer_rows


def main(data: str, out: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(data)
    examples = load_examples(f"{data}/train.jsonl", tokenizer)
    model = tiny_model("qwen3_moe", seed=0, vocab_size=len(tokenizer), hidden_size=32, head_dim=8,
                       moe_intermediate_size=16)  # fmt: skip
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_train_epochs=2,
        learning_rate=3e-3, save_strategy="no", report_to=[], seed=0, use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=trainer_rows(examples), processing_class=tokenizer,
                      data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True),
                      callbacks=[ma.AttributionCallback([2], projection_dim=8, token_batch_size=64)])  # fmt: skip
    trainer.train()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
