"""Tiny Hugging Face models and a tokenizer made on this machine (no download): a byte-level
BPE trained on the standard library's sources, GPT-2, Llama and BERT configs saved with
save_pretrained; an hf-causal-lm pipeline that records the packed blocks it trains."""

from __future__ import annotations

import json
import os
import signal
import sysconfig
import time
from pathlib import Path

from pipelines.hf.causal_lm import HFCausalLMPipeline


def stdlib_text(limit_bytes: int = 200_000) -> list[str]:
    """Lines of the standard library's .py sources (every Python has them)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    lines, size = [], 0
    for path in sorted(root.glob("*.py")):
        for line in path.read_text(errors="replace").splitlines():
            if line.strip():
                lines.append(line)
                size += len(line)
        if size >= limit_bytes:
            break
    return lines


def make_tokenizer(directory: Path, vocab_size: int = 300) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(stdlib_text(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.save_pretrained(directory)
    return directory


def make_model(directory: Path, family: str = "gpt2", *, weights: bool = True, vocab_size: int = 300) -> Path:
    """A tiny model of `family` (gpt2, llama, bert) in `directory`: its config.json and, with
    `weights`, a model.safetensors; a copy of the tokenizer beside it."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        LlamaConfig,
    )

    torch.manual_seed(0)
    if family == "gpt2":
        config = GPT2Config(
            vocab_size=vocab_size, n_positions=128, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
        )
        model = AutoModelForCausalLM.from_config(config)
    elif family == "llama":
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=128,
            bos_token_id=0,
            eos_token_id=0,
        )
        model = AutoModelForCausalLM.from_config(config)
    else:
        config = BertConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=128,
            num_labels=2,
            pad_token_id=0,
        )
        model = BertForSequenceClassification(config)
    if weights:
        model.save_pretrained(directory)
    else:
        config.save_pretrained(directory)
    return directory


def block_key(ids) -> str:
    """A packed block's fingerprint: its token ids' bytes, hashed."""
    import hashlib

    import numpy as np

    return hashlib.sha1(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()[:20]


class RecordingCausalLM(HFCausalLMPipeline):
    """hf-causal-lm writing every packed training block's key when its training set is built
    (`blocks.jsonl`, one line per build) and each trained block's key per rank and step
    (`blocks-rank{r}.jsonl`); on the first attempt, rank 0's process is SIGKILLed when the run
    reaches `crash_at_step`. `step_sleep_s` paces every training step."""

    def __init__(self, out_dir: str, crash_at_step: int, step_sleep_s: float = 0.0):
        super().__init__()
        self.out_dir, self.crash_at_step, self.step_sleep_s = out_dir, crash_at_step, step_sleep_s

    def prepare(self, path, split, spec):
        packed = super().prepare(path, split, spec)
        if split == "train":
            keys = [block_key(row["input_ids"]) for row in packed.iter_rows()]
            with open(Path(self.out_dir) / "blocks.jsonl", "a") as handle:
                handle.write(json.dumps(keys) + "\n")
        return packed

    def compute_loss(self, model, batch):
        import raytrain

        ctx = raytrain.context()
        if model.training:
            out = Path(self.out_dir)
            if not hasattr(self, "attempt"):  # a fresh copy of the pipeline in every worker process
                self.attempt = "second" if (out / "killed").exists() else "first"
            if ctx.step == self.crash_at_step and ctx.world_rank == 0 and self.attempt == "first":
                (out / "killed").write_text(str(ctx.step))
                os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or a lost node would
            row = {"attempt": self.attempt, "epoch": ctx.epoch, "step": ctx.step}
            row["blocks"] = [block_key(ids) for ids in batch["input_ids"].cpu().numpy()]
            with open(out / f"blocks-rank{ctx.world_rank}.jsonl", "a") as handle:
                handle.write(json.dumps(row) + "\n")
            time.sleep(self.step_sleep_s)
        return super().compute_loss(model, batch)
