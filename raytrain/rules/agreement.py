"""Whether the replicas of the model agree: which ranks' fingerprints differ from the majority.

Every rank fingerprints what it holds (`raytrain.instruments.agreement.fingerprint`: its weights and
optimizer state, or its shard of them). Ranks that hold the same shard of different replicas
must hold the same bits: under ddp every rank holds all of the model (a shard of one); under
per-step replica groups of K (HSDP) rank g·K + i holds shard i of group g's replica. A rank
whose fingerprint differs from the majority of its shard's is odd; with no majority (two
replicas that differ) every one of that shard's ranks is named, since either may be the
corrupted one. A mismatch that an earlier attempt met at the same step on the same ranks, after
going back to the same checkpoint, is deterministic and not retried again (`recurs`).

A fingerprint is a 64-bit integer; it travels in a float all-reduce as four 16-bit pieces
(exact in float32 and float64), one slot per piece per rank, each rank filling its own. So does
each rank's host, an IPv4 address, in the log sync and beside the fingerprint (`ipv4`, `address`).
"""

from __future__ import annotations

from collections import Counter

from raytrain.rundir.records import Event, Kind

PIECES = 4  # 16-bit pieces of a 64-bit fingerprint
PIECE = 1 << 16
MISSING = 0  # the fingerprint of a rank whose slots stayed empty (`fingerprint` never gives it)


def shards_per_replica(strategy: str, world_size: int) -> int:
    """The ranks that hold one copy of the model between them, for workers that are not replica
    groups: one under ddp (every rank holds a replica), all of them under fsdp (one copy, sharded:
    nothing to compare). Per-step replica groups of K hold one copy per group: K."""
    return world_size if strategy == "fsdp" else 1


def to_slots(fingerprint: int, rank: int, world_size: int) -> list[float]:
    """The all-reduce vector of `rank`: its fingerprint's pieces in its own slots, zeros elsewhere."""
    unsigned = fingerprint % (1 << 64)
    slots = [0.0] * (PIECES * world_size)
    for piece in range(PIECES):
        slots[PIECES * rank + piece] = float((unsigned >> (16 * piece)) % PIECE)
    return slots


def from_slots(summed: list[float], world_size: int) -> list[int]:
    """Every rank's fingerprint from the summed vector."""
    return [
        sum(int(summed[PIECES * rank + piece]) << (16 * piece) for piece in range(PIECES)) for rank in range(world_size)
    ]


def ipv4(address: str) -> int:
    """An IPv4 address as the integer the sync carries (MISSING for another kind of address)."""
    import ipaddress

    try:
        return int(ipaddress.IPv4Address(address))
    except ValueError:
        return MISSING


def address(value: int) -> str:
    """The address an integer of `ipv4` stands for ("?" for MISSING)."""
    import ipaddress

    return str(ipaddress.IPv4Address(value)) if 0 < value < 1 << 32 else "?"


def odd_ranks(fingerprints: list[int], shards_per_replica: int) -> list[int]:
    """The ranks whose fingerprint differs from the majority of the ranks holding the same shard
    (rank r holds shard r % shards_per_replica); all of a shard's ranks when no fingerprint has a
    majority. Empty when the replicas agree, or when there is one replica (nothing to compare).
    A fingerprint of 0 is a rank that did not answer (per-step, a reduction a lost peer failed
    counts its own group only): left out, never called odd."""
    odd: list[int] = []
    for shard in range(shards_per_replica):
        ranks = [r for r in range(shard, len(fingerprints), shards_per_replica) if fingerprints[r] != MISSING]
        if len(ranks) < 2:
            continue
        value, count = Counter(fingerprints[r] for r in ranks).most_common(1)[0]
        if count == len(ranks):
            continue
        odd += [r for r in ranks if fingerprints[r] != value] if count * 2 > len(ranks) else ranks
    return sorted(odd)


def check_due(step: int, every: int | None, checkpoint_now: bool, default_most_steps: int = 1000) -> bool:
    """Whether the replicas are compared after the step to `step`: every `every` steps when given
    (0: never); by default before every checkpoint and at least every `default_most_steps` steps."""
    return every != 0 and (checkpoint_now or step % (every or default_most_steps) == 0)


def recurs(earlier: list[Event], invocation: str, step: int, odd: list[int], checkpoint: str | None) -> bool:
    """Whether a mismatch at `step` naming `odd`, found while the run's last checkpoint is
    `checkpoint`, repeats one an earlier attempt of this invocation of the driver recorded (a
    `replica_mismatch` event of `earlier` with its `invocation`): the same ranks differed at the same
    step after the run went back to the same checkpoint. Retried, a fault that does so is not
    transient: it repeats (a device that computes wrong every time, an operation that differs
    between ranks, code that changes one rank's weights). A run resumed since, another invocation,
    may run on other hosts: its mismatches are not this one's."""
    return any(
        event.kind == Kind.REPLICA_MISMATCH
        and event.get("invocation") == invocation
        and event.step == step
        and event.get("ranks") == odd
        and event.get("checkpoint") == checkpoint
        for event in earlier
    )
