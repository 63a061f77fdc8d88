"""Which rank stalled a collective, from every rank's last heartbeat
(`raytrain.rundir.heartbeats`): pure, so that the rule is tested without processes."""

from __future__ import annotations

# Phases in which a rank waits on the others: a rank found here is a victim of a stall,
# not its cause.
COLLECTIVE_PHASES = {"backward", "all_reduce", "report"}
PHASE_ORDER = ["data", "forward", "backward", "optimizer", "all_reduce", "eval", "report"]


def diagnose(records: dict[int, dict], world_size: int, now: float) -> str:
    """Name the stalled ranks: those furthest behind, outside a collective, or silent."""
    lines = []
    missing = [r for r in range(world_size) if r not in records]
    if missing:
        lines.append(f"no heartbeat from rank(s) {', '.join(map(str, missing))} (process dead or storage not shared)")
    silent = [r for r, rec in records.items() if now - rec["time"] > 30]
    position = {
        r: (rec["step"], PHASE_ORDER.index(rec["phase"]) if rec["phase"] in PHASE_ORDER else -1)
        for r, rec in records.items()
    }
    behind = min(position.values()) if position else None
    stalled = sorted(
        r
        for r, rec in records.items()
        if r in silent or (position[r] == behind and rec["phase"] not in COLLECTIVE_PHASES)
    )
    if not stalled and records:
        stalled = sorted(r for r in records if position[r] == behind)
    for rank in sorted(records):
        rec = records[rank]
        state = "STALLED" if rank in stalled else "waiting"
        lines.append(
            f"rank {rank} ({state}): step {rec['step']}, in {rec['phase']} for {now - rec['phase_since']:.0f} s"
            + (f", heartbeat silent {now - rec['time']:.0f} s" if rank in silent else "")
        )
    head = f"stalled rank(s): {', '.join(map(str, stalled))}" if stalled else "no rank could be singled out"
    return head + "\n  " + "\n  ".join(lines)


# A rank whose phase has not moved for this share of --collective-timeout-s was waiting out the
# timeout: what a worker killed by NCCL's watchdog leaves in the heartbeats (a kill by hand or a
# lost node leaves the others waiting seconds, not the timeout).
TIMED_OUT_SHARE = 0.9


def stall_seen_by_heartbeats(records: dict[int, dict], now: float, collective_timeout_s: float) -> str | None:
    """When a worker died and the ranks' heartbeats show a collective waited out its timeout, the
    message that names the stalled rank(s) (`diagnose`), for the driver to say in the worker's
    place: on NCCL the watchdog ends the process before the worker can (TORCH_NCCL_ASYNC_ERROR_HANDLING).
    None when no rank waited that long. A heartbeat's phase is where the rank's CPU was: on a GPU it
    runs ahead of the kernels, so a waiting rank can show the phase after the collective it waits in."""
    if not records:
        return None
    waited = max(now - rec["phase_since"] for rec in records.values())
    if waited < TIMED_OUT_SHARE * collective_timeout_s:
        return None
    world_size = max(records) + 1
    return (
        f"A collective waited out --collective-timeout-s {collective_timeout_s:g} and a worker was ended (on NCCL, "
        f"by its watchdog); from the heartbeats: {diagnose(records, world_size, now)}"
    )
