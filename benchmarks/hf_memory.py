"""Peak RSS per worker under `--strategy fsdp`, the model built on the meta device and filled
shard by shard (meta) against built whole on every worker, then sharded (plain).

    python benchmarks/hf_memory.py OUT_DIR --models charlm|gpt2-100m[,...] [--workers 1,2,4]
        [--paths meta,plain] [--steps 2]

Models (Hugging Face GPT-2 configs, `raytrain train hf-causal-lm`, made on this machine; no
download):
- charlm: charlm's 768 × 8 shape (benchmarks/RESULTS.md §13), vocabulary 300: 57.0 M
  parameters, a config only (fresh weights: `raytrain.meta.UnitInit` on the meta path).
- gpt2-100m: 768 × 12, vocabulary 32,000: 109.9 M parameters, saved with save_pretrained
  (model.safetensors: the meta path reads each rank's rows of it).

For each model, path and worker count: a short fsdp run (--steps steps, global batch 4, blocks
of 32 tokens); each worker's peak RSS after the first step (the run's `memory` event, the
process's ru_maxrss: it includes the build, the sharding and AdamW's first step), and the
process's base: its RSS when build_model is entered, after torch and transformers are
imported, before any model. Target: peak RSS per worker ≤ 1.3 × (the path's 1-worker figure ÷
N) + the base. Prints a Markdown table and writes OUT_DIR/hf_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for entry in (REPO, REPO / "tests"):
    if str(entry) not in sys.path:
        sys.path.insert(0, str(entry))

import raytrain  # noqa: E402
from pipelines.hf import HFCausalLMPipeline  # noqa: E402
from raytrain.observe.render import markdown_table  # noqa: E402
from raytrain.rundir import Kind, RunDir  # noqa: E402

MODELS = {
    "charlm": {"n_embd": 768, "n_layer": 8, "n_head": 12, "vocab_size": 300, "weights": False},
    "gpt2-100m": {"n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 32_000, "weights": True},
}
MIB = 2**20


class MeasuredMeta(HFCausalLMPipeline):
    """hf-causal-lm that writes each rank's base RSS (on entering build_model) to a file."""

    def __init__(self, base_dir: str):
        super().__init__()
        self.base_dir = base_dir

    def build_model(self, cfg):
        import psutil
        import transformers  # noqa: F401  (imported before the base is taken: part of the process)

        rank = raytrain.context().world_rank
        path = Path(self.base_dir) / f"base-{rank}.json"
        if not path.exists():  # the first call: the meta path builds a template again in materialize
            path.write_text(json.dumps({"rank": rank, "rss": psutil.Process().memory_info().rss}))
        return super().build_model(cfg)


class MeasuredPlain(MeasuredMeta):
    """The same, without materialize: every worker builds (and loads) the whole model, then shards."""

    materialize = raytrain.Pipeline.materialize


def make_inputs(out: Path, model: str) -> Path:
    """The model's directory (config, weights if the model has them, the tokenizer) and the text."""
    from hf_fixtures import make_tokenizer, stdlib_text
    from transformers import AutoModelForCausalLM, GPT2Config

    root = out / "inputs" / model
    if (root / "train.txt").exists():
        return root
    spec = dict(MODELS[model])
    weights = spec.pop("weights")
    config = GPT2Config(n_positions=128, bos_token_id=0, eos_token_id=0, **spec)
    make_tokenizer(root / "model")
    if weights:
        import torch

        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(root / "model")
    else:
        config.save_pretrained(root / "model")
    (root / "train.txt").write_text("\n".join(stdlib_text(60_000)))
    return root


def measure(out: Path, model: str, path: str, workers: int, steps: int) -> dict:
    inputs = make_inputs(out, model)
    name = f"{model}-{path}-{workers}"
    base_dir = out / "base" / name
    base_dir.mkdir(parents=True, exist_ok=True)
    pipeline = (MeasuredMeta if path == "meta" else MeasuredPlain)(str(base_dir))
    cfg = raytrain.TrainConfig(
        storage=str(out / "runs"),
        name=name,
        progress="off",
        strategy="fsdp",
        workers=workers,
        max_steps=steps,
        global_batch_size=4,
        lr=1e-4,
        warmup_epochs=0,
        checkpoint_every_steps=10_000,
        pipeline_args={"model": str(inputs / "model"), "train": str(inputs / "train.txt"), "block_size": 32},
    )
    raytrain.fit(pipeline, cfg)
    run = RunDir(out / "runs" / name)
    event = next(e for e in run.events() if e.kind == Kind.MEMORY)
    plan = next(e for e in run.events()).message
    bases = [json.loads(p.read_text())["rss"] for p in sorted(base_dir.glob("base-*.json"))]
    row = {
        "model": model,
        "path": path,
        "workers": workers,
        "meta_built": "built on the meta device" in plan,
        "peak_rss_mib": round(max(event.extra["peak_rss"]) / MIB),
        "peak_rss_by_rank_mib": [round(v / MIB) for v in event.extra["peak_rss"]],
        "base_mib": round(max(bases) / MIB),
        "parameters_mib": round(max(event.extra["parameters"]) / MIB, 1),
    }
    print(json.dumps(row), flush=True)
    return row


def judge(rows: list[dict]) -> None:
    """Each row against its path's 1-worker figure: the bound 1.3 × (peak₁ ÷ N) + base."""
    one = {(r["model"], r["path"]): r["peak_rss_mib"] for r in rows if r["workers"] == 1}
    for row in rows:
        first = one.get((row["model"], row["path"]))
        if first is None:
            continue
        row["bound_mib"] = round(1.3 * first / row["workers"] + row["base_mib"])
        row["met"] = row["peak_rss_mib"] <= row["bound_mib"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--models", default="charlm")
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--paths", default="meta,plain")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [
        measure(args.out, model, path, int(workers), args.steps)
        for model in models
        for path in args.paths.split(",")
        for workers in args.workers.split(",")
    ]
    judge(rows)
    (args.out / f"hf_memory-{'-'.join(models)}-{args.paths.replace(',', '-')}.json").write_text(
        json.dumps(rows, indent=2)
    )
    header = ["model", "path", "workers", "peak RSS by rank (MiB)", "base (MiB)", "bound (MiB)", "target"]
    table = [
        [
            r["model"],
            r["path"] + ("" if r["meta_built"] == (r["path"] == "meta") else " (?)"),
            r["workers"],
            ", ".join(f"{v:,}" for v in r["peak_rss_by_rank_mib"]),
            f"{r['base_mib']:,}",
            f"{r.get('bound_mib', 0):,}",
            "met" if r.get("met") else "not met",
        ]
        for r in rows
    ]
    print("\n".join(markdown_table(header, table)))


if __name__ == "__main__":
    main()
