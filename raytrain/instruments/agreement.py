"""The replicas compared: a fingerprint of what each rank holds, and the error that rolls a
run back when one replica silently differs (`raytrain.rules.agreement` decides who differs;
`shared_fingerprints` shares them in one small all-reduce).

Silent data corruption (a flipped bit in a device's arithmetic or memory) leaves one replica's
weights different from the others'. Gradients are averaged, so nothing else would notice, and
every checkpoint after it would hold the corrupted weights. The check runs before every
checkpoint (so a published checkpoint's replicas agreed) and every --replica-check-steps
steps; on a mismatch rank 0 writes a "replica_mismatch" event naming the odd ranks and their
hosts, and every rank raises `ReplicaMismatch`: a failure like a lost worker's, recovered from
the last checkpoint, whose replicas agreed. The same mismatch met again after that rollback
(`raytrain.rules.agreement.recurs`) is not a transient fault: every rank raises
`ReplicaMismatchRecurred`, never retried, and the run stops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from raytrain.errors import DeterministicFault
from raytrain.rules import agreement

if TYPE_CHECKING:  # pragma: no cover
    from raytrain.worker.runtime import Runtime

# Integer views of a tensor's bits, by element size.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SUM_PIECE = 1 << 24  # elements summed at a time: the int64 copy of a piece is 128 MiB


class ReplicaMismatch(RuntimeError):
    """The replicas' weights or optimizer state differ: the attempt fails and the run goes back to
    the last checkpoint (a fault of the hardware, retried as any worker's failure)."""


class ReplicaMismatchRecurred(ReplicaMismatch, DeterministicFault):
    """The same replicas differed at the same step after the run went back to the same checkpoint:
    a deterministic fault, which a retry repeats; the run stops (exit status 1)."""


def held_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """What this rank holds of the training state, in an order every replica shares: its
    parameters (their local shards under fsdp), then the optimizer's state of each."""
    params = list(model.parameters())
    tensors = [_local(p) for p in params]
    if optimizer is not None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                tensors += [_local(state[key]) for key in sorted(state) if isinstance(state[key], torch.Tensor)]
    return tensors


def fingerprint(tensors: list[torch.Tensor]) -> int:
    """A 64-bit fingerprint of the tensors' bit patterns: each tensor's bits summed as integers on
    its device, weighted by its place in the list, and the sums of each device added (an
    optimizer's step counts, on the CPU beside a GPU's weights, cross once; one host sync)."""
    if not tensors:
        return 1
    totals: dict[torch.device, torch.Tensor] = {}
    for place, tensor in enumerate(tensors, start=1):
        flat = tensor.detach().reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        bits = flat.view(_BITS[flat.element_size()]) if flat.dtype != torch.bool else flat.to(torch.uint8)
        # In pieces: an int64 sum first copies its input to int64 (2-4x the tensor's bytes).
        part = sum(piece.sum(dtype=torch.int64) for piece in bits.split(SUM_PIECE)) * (2 * place + 1)
        totals[part.device] = totals[part.device] + part if part.device in totals else part
    first = tensors[0].device
    total = sum((value.to(first) for value in totals.values()), torch.zeros((), dtype=torch.int64, device=first))
    return int(total.item()) or 1  # never MISSING (raytrain.rules.agreement): 0 is a rank that did not answer


class Shared(NamedTuple):
    fingerprints: list[int]  # by rank
    hosts: list[str]  # by rank: its node address ("?" for one that is not IPv4)


def shared_fingerprints(
    runtime: "Runtime", model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, host: int = 0
) -> Shared:
    """Every rank's fingerprint of what it holds (`held_tensors`) and its host (`host`: its node
    address, `raytrain.rules.agreement.ipv4`), in rank order: one all-reduce of their 16-bit pieces
    (`raytrain.rules.agreement.to_slots`), a collective of every rank. The hosts ride along so that a
    mismatch found before an attempt's first log sync names them too."""
    world, rank = runtime.world_size, runtime.world_rank
    mine = fingerprint(held_tensors(model, optimizer))
    summed = runtime.all_reduce_sum(agreement.to_slots(mine, rank, world) + agreement.to_slots(host, rank, world))
    cut = agreement.PIECES * world
    hosts = [agreement.address(value) for value in agreement.from_slots(summed[cut:], world)]
    return Shared(agreement.from_slots(summed[:cut], world), hosts)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (fsdp), or the tensor."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def mismatch_line(
    odd: list[int], hosts: list[str], step: int, shards_per_replica: int, world_size: int, last_checkpoint: str | None,
    recurred: bool = False,
) -> str:  # fmt: skip
    """The sentence of a mismatch: who, where, and what the run does: it goes back to the last
    checkpoint, or, when an earlier attempt met the same mismatch after going back there
    (`recurred`), it stops."""
    named = ", ".join(f"rank {r} (host {hosts[r]})" for r in odd)
    replicas = world_size // max(1, shards_per_replica)
    if replicas == 2 and len(odd) > 1:
        who = f"the two replicas differ and there is no majority to say which is wrong: {named}"
    else:
        who = f"{named} differ{'s' if len(odd) == 1 else ''} from the other replicas"
    back = last_checkpoint or "the start (no checkpoint yet)"
    if recurred:
        ranks = f"rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))}"
        return (
            f"Replicas disagree at step {step}: {who}. The same replica mismatch recurred at step {step} on {ranks} "
            f"after a rollback to {back}: a deterministic fault, not a transient one (a device that computes wrong "
            "every time, an operation that is not deterministic across ranks, or code that changes one rank's "
            "weights); not retried, whatever --max-failures: the run stops here. Take that host out of the cluster, "
            f"or find what differs between the ranks in that step; --resume then continues from {back}."
        )
    return (
        f"Replicas disagree at step {step}: {who}. Their weights or optimizer state changed without a gradient "
        f"(silent data corruption on that device or host): the run goes back to {back}, whose replicas agreed. "
        "If it happens again on the same host, take that host out of the cluster."
    )
