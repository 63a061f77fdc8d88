"""Replica groups that shard one model (HSDP, `raytrain.parallel.hsdp`), the pure parts: a group
heals from a peer group's shards, averages its gradient shards across groups through torchft's
Manager, and learns that a member of its group is gone. The whole of it on Ray Train:
tests/test_hsdp_ray.py; across processes without Ray, measured once: benchmarks/RESULTS.md §24."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from raytrain.parallel.holding import load_local_state, local_state
from raytrain.parallel.hsdp import GroupWatch, average_across_groups

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")


def sharded(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    fully_shard(model[0])
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(5, 6, generator=generator), torch.randn(5, 3, generator=generator)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.full_tensor().clone() for name, value in model.state_dict().items()}


def test_a_fresh_group_loaded_with_a_peers_shards_steps_as_the_peer_does(one_rank_group):
    peer, peer_optimizer = sharded(seed=0)
    train(peer, peer_optimizer, range(3))
    state = local_state(peer, peer_optimizer)
    # What travels is plain tensors: a transport sends them as they are.
    tensors = [*state["model"].values(), *(v for entry in state["optim"]["state"].values() for v in entry.values())]
    assert all(type(t) is torch.Tensor for t in tensors)

    joiner, joiner_optimizer = sharded(seed=1)  # other weights, and an optimizer that never stepped
    assert not joiner_optimizer.state
    load_local_state(joiner, joiner_optimizer, state)
    assert all(torch.equal(a, b) for a, b in zip(weights(joiner).values(), weights(peer).values()))

    train(peer, peer_optimizer, range(3, 5))
    train(joiner, joiner_optimizer, range(3, 5))  # the moments and step counts came along
    for name, value in weights(peer).items():
        assert torch.equal(weights(joiner)[name], value), name


class HalvingManager:
    """Stands for torchft's Manager over two groups whose peer's gradient is zero."""

    def __init__(self) -> None:
        self.reduced: list[torch.Size] = []

    def allreduce(self, tensor: torch.Tensor, reduce_op=None):
        from torch.distributed import ReduceOp

        assert reduce_op == ReduceOp.AVG
        self.reduced.append(tensor.shape)
        tensor.mul_(0.5)
        return self

    def wait(self) -> None:
        return None


def test_each_units_gradient_shard_is_averaged_across_groups_in_place(one_rank_group):
    model, _ = sharded(seed=0)
    reference, _ = sharded(seed=0)
    manager = HalvingManager()
    assert average_across_groups(model, manager) == 2  # the block and the root
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    F.mse_loss(model(x), y).backward()
    F.mse_loss(reference(x), y).backward()
    assert len(manager.reduced) == 2
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad.to_local(), 0.5 * q.grad.to_local()), name


class Store:
    """Stands for the group's TCPStore: counters by key; `gone` makes it stop answering."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.gone = False

    def add(self, key: str, amount: int) -> int:
        if self.gone:
            raise RuntimeError("Connection reset by peer")
        self.counts[key] = self.counts.get(key, 0) + amount
        return self.counts[key]

    def set(self, key: str, value: str) -> None:
        self.counts[key] = 1

    def check(self, keys: list[str]) -> bool:
        return all(key in self.counts for key in keys)


def test_a_member_is_told_once_a_peer_of_its_group_stops_beating_or_the_store_is_gone():
    now = [0.0]
    store = Store()
    watches = [GroupWatch(store, rank, 3, print, lost_after_s=1.0, clock=lambda: now[0]) for rank in range(3)]
    for _ in range(20):  # all three beating: nobody is lost
        now[0] += 0.1
        assert [watch.beat() for watch in watches] == [None, None, None]
    for _ in range(10):  # member 2 stops; within its second the others still wait for it
        now[0] += 0.1
        assert [watch.beat() for watch in watches[:2]] == [None, None]
    now[0] += 0.2
    assert watches[0].beat().startswith("member 2 of the group stopped for 1.")
    # A member whose run ended says so: the others stop counting its beats (one still writing
    # the last checkpoint is not taken for lost).
    watches[2].stop()
    for _ in range(30):
        now[0] += 0.1
        assert [watch.beat() for watch in watches[:2]] == [None, None]
    store.gone = True  # the store's host is gone: every member learns it at its next beat
    assert watches[1].beat() == "the group's store no longer answers (RuntimeError)"
