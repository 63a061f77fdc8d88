"""Run under `python -m torch.distributed.run --standalone --nproc_per_node=N tests/meta_ranks.py
WEIGHTS_DIR CONFIG_DIR OUT`: a tiny GPT-2 built on the meta device, sharded with FSDP2 over gloo
(each block, then the root), given storage for this rank's shards and filled by the HF
pipelines' `materialize` — once from WEIGHTS_DIR's safetensors, once fresh from CONFIG_DIR's
config alone. Each rank checks that what it holds is exactly its rows of the source; rank 0
saves the gathered full models and those checks to OUT for tests/test_meta.py."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist


def sharded_gpt2(directory: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the model sharded on meta with storage allocated, its unsharded meta template)."""
    from torch.distributed.fsdp import fully_shard

    from pipelines.hf.common import load_model
    from raytrain.meta import build_on_meta

    model = build_on_meta(lambda: load_model("AutoModelForCausalLM", directory))
    template = build_on_meta(lambda: load_model("AutoModelForCausalLM", directory))
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    return model, template


def filled(directory: str, seed: int) -> dict:
    from pipelines.hf.common import materialize
    from raytrain.meta import WeightFiles, local_index

    model, template = sharded_gpt2(directory)
    materialize(model, template, directory, ["transformer.h.0", "transformer.h.1"], seed)
    rows_match = True
    weights = WeightFiles(directory)
    for name, parameter in model.named_parameters():
        if weights.has(name):  # this rank's local shard is exactly its rows of the file
            expected = weights.read(name, tuple(slice(None) for _ in parameter.shape))[local_index(parameter)]
            rows_match &= torch.equal(parameter.to_local(), expected)
    full = {name: value.full_tensor() for name, value in model.state_dict().items()}
    return {
        "full": full,
        "rows_match": rows_match,
        "tied": model.lm_head.weight is model.transformer.wte.weight,
        "local_rows": model.transformer.wte.weight.to_local().shape[0],
    }


if __name__ == "__main__":
    dist.init_process_group("gloo")
    import transformers

    transformers.logging.set_verbosity_error()
    weights_dir, config_dir, out = sys.argv[1:4]
    result = {"weights": filled(weights_dir, seed=0), "fresh": filled(config_dir, seed=0)}
    result["fresh_again"] = filled(config_dir, seed=0)["full"]
    result["fresh_other_seed"] = filled(config_dir, seed=1)["full"]
    if dist.get_rank() == 0:
        torch.save(result, out)
    # Every rank waits for rank 0's file before the group is torn down: gloo aborts a rank
    # that leaves while its peer is still busy ("terminate called without an active exception",
    # seen in the slow stage on a loaded machine; the torchrun template's ranks meet likewise).
    dist.barrier()
    dist.destroy_process_group()
