"""The original side of docs/porting.md's worked example 5: Hugging Face's
`transformers/examples/pytorch/language-modeling/run_clm_no_trainer.py` (Accelerate), in its shape and with
its argument names, stripped to local files: text files in, a model built from a local config
(or loaded from a local directory), a local tokenizer, no Hub, no tracking, no checkpointing.

What it keeps, as the original does it: `load_dataset("text", ...)`, tokenizing with `map`,
`group_texts` (concatenate each `map` batch of 1,000 rows, cut it into blocks of `block_size`,
drop the remainder), a shuffled `DataLoader` of `per_device_train_batch_size` per process,
AdamW over two groups (`no_decay = ["bias", "layer_norm.weight"]`), `get_scheduler` with
`num_warmup_steps` (both counts × the process count: Accelerate's prepared scheduler steps once
per process), Accelerate's `prepare` and `accumulate`, and the perplexity pass over the
validation set at the end of each epoch. It writes `all_results.json` (perplexity, eval_loss,
completed steps) in `--output_dir`, as the original writes its perplexity there.

    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 \\
        benchmarks/hf_port/run_clm_accelerate.py --train_file T.txt --validation_file V.txt \\
        --config_name MODEL_DIR --tokenizer_name TOKENIZER_DIR --block_size 64 \\
        --per_device_train_batch_size 8 --learning_rate 1e-3 --weight_decay 0.01 \\
        --num_warmup_steps 12 --max_train_steps 120 --seed 0 --output_dir OUT
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from itertools import chain

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, default_data_collator, get_scheduler


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train a causal LM on local text files with Accelerate")
    parser.add_argument("--train_file", required=True, help="A .txt file of training text (one row per line).")
    parser.add_argument("--validation_file", required=True, help="A .txt file of validation text.")
    parser.add_argument("--model_name_or_path", default=None, help="A local model directory with weights.")
    parser.add_argument("--config_name", default=None, help="A local config directory (the model built from it).")
    parser.add_argument("--tokenizer_name", required=True, help="A local tokenizer directory.")
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=5e-5)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--num_train_epochs", type=int, default=3)
    parser.add_argument("--max_train_steps", type=int, default=None)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--lr_scheduler_type", default="linear")
    parser.add_argument("--num_warmup_steps", type=int, default=0)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--block_size", type=int, default=None)
    args = parser.parse_args()
    if (args.model_name_or_path is None) == (args.config_name is None):
        parser.error("give one of --model_name_or_path (weights) or --config_name (a model from its config)")
    return args


def main() -> None:
    started = time.perf_counter()
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    if args.seed is not None:
        set_seed(args.seed)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    data_files = {"train": args.train_file, "validation": args.validation_file}
    raw_datasets = load_dataset("text", data_files=data_files, keep_linebreaks=False)

    config = AutoConfig.from_pretrained(args.config_name or args.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
    if args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, config=config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    embedding_size = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > embedding_size:
        model.resize_token_embeddings(len(tokenizer))

    column_names = raw_datasets["train"].column_names
    text_column_name = "text" if "text" in column_names else column_names[0]

    def tokenize_function(examples):
        return tokenizer(examples[text_column_name])

    with accelerator.main_process_first():
        tokenized_datasets = raw_datasets.map(tokenize_function, batched=True, remove_columns=column_names)
    block_size = min(args.block_size or 1024, tokenizer.model_max_length)

    def group_texts(examples):
        concatenated_examples = {k: list(chain(*examples[k])) for k in examples.keys()}
        total_length = len(concatenated_examples[list(examples.keys())[0]])
        total_length = (total_length // block_size) * block_size
        result = {
            k: [t[i : i + block_size] for i in range(0, total_length, block_size)]
            for k, t in concatenated_examples.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    with accelerator.main_process_first():
        lm_datasets = tokenized_datasets.map(group_texts, batched=True)
    train_dataset = lm_datasets["train"]
    eval_dataset = lm_datasets["validation"]

    train_dataloader = DataLoader(
        train_dataset, shuffle=True, collate_fn=default_data_collator, batch_size=args.per_device_train_batch_size
    )
    eval_dataloader = DataLoader(
        eval_dataset, collate_fn=default_data_collator, batch_size=args.per_device_eval_batch_size
    )

    no_decay = ["bias", "layer_norm.weight"]
    optimizer_grouped_parameters = [
        {
            "params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)

    overrode_max_train_steps = False
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
        overrode_max_train_steps = True
    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps
        if overrode_max_train_steps
        else args.max_train_steps * accelerator.num_processes,
    )

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    # The dataloader is shorter once prepared (each process has its share): count again.
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if overrode_max_train_steps:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)

    total_batch_size = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    accelerator.print(
        f"{len(train_dataset)} blocks of {block_size} tokens, global batch {total_batch_size}, "
        f"{args.max_train_steps} steps over {args.num_train_epochs} epoch(s)"
    )
    completed_steps = 0
    eval_loss = perplexity = float("nan")
    for epoch in range(args.num_train_epochs):
        model.train()
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps += 1
            if completed_steps >= args.max_train_steps:
                break

        model.eval()
        losses = []
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            loss = outputs.loss
            losses.append(accelerator.gather_for_metrics(loss.repeat(args.per_device_eval_batch_size)))
        losses = torch.cat(losses)
        eval_loss = torch.mean(losses).item()
        try:
            perplexity = math.exp(eval_loss)
        except OverflowError:
            perplexity = float("inf")
        accelerator.print(f"epoch {epoch}: perplexity: {perplexity} eval_loss: {eval_loss}")

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(args.output_dir, save_function=accelerator.save)
        tokenizer.save_pretrained(args.output_dir)
        results = {
            "perplexity": perplexity,
            "eval_loss": eval_loss,
            "steps": completed_steps,
            "script_time_s": time.perf_counter() - started,
        }
        with open(os.path.join(args.output_dir, "all_results.json"), "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
