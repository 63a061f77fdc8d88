"""The classic torchrun template, for running by path (`python benchmarks/classic_ddp.py ...`
or `torchrun ... benchmarks/classic_ddp.py ...`). It ships in the package as
`raytrain.baselines.classic_ddp` (`python -m raytrain.baselines.classic_ddp`), where
`raytrain bench --baseline` runs it from; see that module for its options."""

from raytrain.baselines.classic_ddp import train_classic

if __name__ == "__main__":
    train_classic()
