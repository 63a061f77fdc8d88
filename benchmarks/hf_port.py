"""docs/porting.md, worked example 5: Hugging Face's `run_clm_no_trainer.py` (Accelerate) against
its raytrain port, the built-in `hf-causal-lm` pipeline, on the same model, data and recipe.

Everything is made here, nothing is downloaded: a deterministic synthetic corpus (sentences
from a small grammar, with sums and counts in them), a byte-level BPE tokenizer trained on its
training split (saved as a Hugging Face tokenizer directory), and a tiny GPT-2 config. Then,
for every seed, the original (`benchmarks/hf_port/run_clm_accelerate.py` under `accelerate
launch`, 2 CPU processes) and the port (`raytrain train hf-causal-lm --workers 2`) train with
the same global batch, peak rate, warmup from 0, linear decay to 0, weight decay and steps.
Printed: each side's final validation loss (mean ± standard deviation over the seeds), the
port's difference against the original's spread (max − min over seeds), and each side's wall
time (the whole command, process start to exit). Usage:

    python benchmarks/hf_port.py OUT [--seeds 0,1,2] [--steps 120] [--json OUT/hf_port.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
ORIGINAL = REPO / "benchmarks" / "hf_port" / "run_clm_accelerate.py"

# The recipe both sides run: 2 processes of 8 blocks each, from scratch.
PROCESSES = 2
PER_DEVICE_BATCH = 8
BLOCK_SIZE = 64
LR = 1e-3
WARMUP_STEPS = 12
WEIGHT_DECAY = 0.01
TRAIN_LINES = 16_000  # about 4,500 blocks of 64 tokens: 120 steps of 16 stay within one epoch
VAL_LINES = 1_000
VOCAB_SIZE = 512

NOUNS = "cat dog bird fox horse cow sheep mouse owl frog bee goat".split()
ADJECTIVES = "red green blue small large old young quick lazy bright quiet brown".split()
VERBS = "see chase follow like find hear meet help".split()
PLACES = "river hill forest field garden house road lake barn bridge".split()


def sentence(rng: random.Random) -> str:
    """One sentence: mostly grammar (a verb agrees with its subject's number), else a sum or a count."""
    kind = rng.random()
    if kind < 0.6:
        many = rng.random() < 0.4
        noun = rng.choice(NOUNS) + ("s" if many else "")
        verb = rng.choice(VERBS) + ("" if many else "s")
        thing = f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"
        return f"the {rng.choice(ADJECTIVES)} {noun} {verb} a {thing} near the {rng.choice(PLACES)} ."
    if kind < 0.8:
        a, b = rng.randrange(20), rng.randrange(20)
        return f"{a} plus {b} is {a + b} ."
    start = rng.randrange(50)
    return " ".join(str(start + i) for i in range(rng.randint(3, 8))) + " ."


def corpus(lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(sentence(rng) for _ in range(rng.randint(1, 3))) for _ in range(lines)]


def make_inputs(work: Path) -> dict[str, Path]:
    """train.txt, val.txt (other draws of the same grammar), tokenizer/ and model/ (a config only)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, PreTrainedTokenizerFast

    paths = {name: work / name for name in ("train.txt", "val.txt", "tokenizer", "model")}
    train = corpus(TRAIN_LINES, seed=1)
    paths["train.txt"].write_text("\n".join(train) + "\n")
    paths["val.txt"].write_text("\n".join(corpus(VAL_LINES, seed=2)) + "\n")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(train, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>", model_max_length=BLOCK_SIZE
    )
    tokenizer.save_pretrained(paths["tokenizer"])
    eos = tokenizer.eos_token_id
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=BLOCK_SIZE,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    config.save_pretrained(paths["model"])
    return paths


def timed(command: list[str], env: dict[str, str]) -> float:
    """Run `command`; its wall time in seconds, or a RuntimeError with the end of its output."""
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    wall_s = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command[:8])} ... exit {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        )
    return wall_s


def original(paths: dict[str, Path], out: Path, seed: int, steps: int) -> dict:
    launch = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", str(PROCESSES)]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    launch += ["--main_process_port", "29655"]
    script = [str(ORIGINAL), "--train_file", str(paths["train.txt"]), "--validation_file", str(paths["val.txt"])]
    script += ["--config_name", str(paths["model"]), "--tokenizer_name", str(paths["tokenizer"])]
    script += ["--block_size", str(BLOCK_SIZE), "--per_device_train_batch_size", str(PER_DEVICE_BATCH)]
    script += ["--learning_rate", str(LR), "--weight_decay", str(WEIGHT_DECAY), "--lr_scheduler_type", "linear"]
    script += ["--num_warmup_steps", str(WARMUP_STEPS), "--max_train_steps", str(steps), "--seed", str(seed)]
    script += ["--output_dir", str(out / f"original-s{seed}")]
    wall_s = timed(launch + script, {**ENV, "ACCELERATE_USE_CPU": "true"})
    results = json.loads((out / f"original-s{seed}" / "all_results.json").read_text())
    assert results["steps"] == steps, results
    return {"eval_loss": results["eval_loss"], "wall_s": wall_s}


def port(paths: dict[str, Path], out: Path, seed: int, steps: int) -> dict:
    command = [str(BIN / "raytrain"), "train", "hf-causal-lm", "--workers", str(PROCESSES), "--seed", str(seed)]
    command += ["--global-batch-size", str(PROCESSES * PER_DEVICE_BATCH), "--lr", str(LR), "--lr-scaling", "none"]
    command += ["--warmup-steps", str(WARMUP_STEPS), "--warmup-start-factor", "0", "--schedule", "linear"]
    command += ["--weight-decay", str(WEIGHT_DECAY), "--max-steps", str(steps), "--progress", "off"]
    command += ["--storage", str(out / "runs"), "--name", f"port-s{seed}"]
    for key in ("model", "tokenizer"):
        command += ["--pipeline-arg", f"{key}={paths[key]}"]
    command += ["--pipeline-arg", f"train={paths['train.txt']}", "--pipeline-arg", f"val={paths['val.txt']}"]
    command += ["--pipeline-arg", f"block_size={BLOCK_SIZE}"]
    wall_s = timed(command, ENV)
    summary = json.loads((out / "runs" / f"port-s{seed}" / "summary.json").read_text())
    assert (summary["status"], summary["steps"]) == ("finished", steps), summary
    return {"eval_loss": summary["final_metrics"]["val_loss"], "wall_s": wall_s}


def mean_std(values: list[float]) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.4f} ± {spread:.4f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="a working directory (inputs, runs, results)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, each run on both sides")
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps of every run")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here (default OUT/hf_port.json)")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    paths = make_inputs(args.out)
    rows = []
    for seed in seeds:
        row = {"seed": seed, "original": original(paths, args.out, seed, args.steps)}
        row["port"] = port(paths, args.out, seed, args.steps)
        rows.append(row)
        print(
            f"seed {seed}: eval loss original {row['original']['eval_loss']:.4f} ({row['original']['wall_s']:.1f} s), "
            f"port {row['port']['eval_loss']:.4f} ({row['port']['wall_s']:.1f} s)",
            flush=True,
        )
    figures = {side: [row[side]["eval_loss"] for row in rows] for side in ("original", "port")}
    walls = {side: [row[side]["wall_s"] for row in rows] for side in ("original", "port")}
    spread = max(figures["original"]) - min(figures["original"])
    difference = statistics.mean(figures["port"]) - statistics.mean(figures["original"])
    print(
        f"recipe: global batch {PROCESSES * PER_DEVICE_BATCH} ({PROCESSES} processes × {PER_DEVICE_BATCH}), "
        f"block {BLOCK_SIZE}, lr {LR:g}, warmup {WARMUP_STEPS} steps from 0, linear to 0, weight decay "
        f"{WEIGHT_DECAY:g}, {args.steps} steps; seeds {args.seeds}"
    )
    for side in ("original", "port"):
        print(f"{side:8s} eval loss {mean_std(figures[side])}   wall {mean_std(walls[side])} s")
    verdict = "within" if abs(difference) <= spread else "outside"
    print(f"port − original: {difference:+.4f}; the original's spread (max − min over seeds) {spread:.4f}: {verdict}")
    (args.json or args.out / "hf_port.json").write_text(
        json.dumps({"rows": rows, "spread": spread, "difference": difference}, indent=1)
    )
    return 0 if verdict == "within" else 1


if __name__ == "__main__":
    sys.exit(main())
