"""The checks of a `TrainConfig`: every value against its type, a choice against the field's
`Literal`, then each section's own checks (`own_problems` of the classes in
`raytrain.config.sections` and `raytrain.config.optimization`) and the rules that read two
sections (`across_sections`). Each problem is (field, message naming the value and the fix);
`TrainConfig.__post_init__` raises them all at once, in field order. (The functions take the
`TrainConfig` being checked: this module is imported by its sections.)"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
from typing import Any, Iterable

from raytrain import fields
from raytrain.fields import flag_name


def parse_workers(value: int | str) -> tuple[int, int]:
    """`4` -> (4, 4); `"2:8"` -> (2, 8). Raises ValueError with the fix."""
    if isinstance(value, bool):
        raise ValueError(f"got {value!r}; give a worker count N or MIN:MAX, e.g. 2 or 2:8")
    if isinstance(value, int):
        low = high = value
    else:
        text = str(value).strip()
        parts = text.split(":")
        if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"got {value!r}; give a worker count N or MIN:MAX, e.g. 2 or 2:8")
        low, high = int(parts[0]), int(parts[-1])
    if low < 0 or high < low:
        raise ValueError(f"got {value!r}; need 0 <= MIN <= MAX, e.g. 2:8")
    if low == 0 and high != 0:
        raise ValueError(f"got {value!r}; an elastic run needs MIN >= 1, e.g. 1:{high}")
    return low, high


NEEDS_NAME = "needs the run to continue: add --name RUN (the directory under --storage)"
EMPTY_NAME = "a name cannot be empty: give one, e.g. --name digits-lr3e-3, or leave --name out for a generated one"


def resume_problems(resume: bool, name: str | None) -> list[tuple[str, str]]:
    """`--resume` continues a run by its name: without `--name` there is none to continue."""
    return [("resume", NEEDS_NAME)] if resume and not name else []


def problems_of(cfg: Any, sections: Iterable[type]) -> list[tuple[str, str]]:
    """Every problem of `cfg`: its types first (a value of the wrong type makes the other
    checks moot), then its choices, each of `sections`' own problems and those across
    sections, in the order of the fields (as --help lists them)."""
    found = list(_check_types(cfg)) + list(_check_types(cfg.ddp, prefix="ddp."))
    if found:
        return found
    order = {name: index for index, name in enumerate(f.name for f in dataclasses.fields(cfg))}
    own = [problem for section in sections for problem in section.own_problems(cfg)]
    found = [*_check_choices(cfg), *own, *across_sections(cfg)]
    return sorted(found, key=lambda problem: order.get(problem[0].split(".")[0], len(order)))


def positive_int(name: str, value: int | None, example: int) -> Iterable[tuple[str, str]]:
    """`name` unset or at least 1; the message shows the flag with `example`."""
    if value is not None and value < 1:
        yield name, f"got {value}; must be a positive integer, e.g. {flag_name(name)} {example}"


def _check_types(cfg: Any, prefix: str = "") -> Iterable[tuple[str, str]]:
    """Each field's value against its type."""
    for option in fields.options(type(cfg)):
        value = getattr(cfg, option.name)
        if not dataclasses.is_dataclass(value) and not option.accepts(value):
            said = f"got {value!r} ({type(value).__name__}); expected {option.words()}"
            if str in option.kinds and isinstance(value, (bool, int, float)):
                # YAML reads an unquoted no/yes/on/off as a boolean and 2024 or 0123 as a number: the
                # user wrote text, which only quotes keep.
                said += (
                    f"; YAML reads an unquoted yes/no/on/off as true/false and digits as a number: quote it, e.g. "
                    f'{option.name}: "..."'
                )
            yield prefix + option.name, said


def _check_choices(cfg: Any) -> Iterable[tuple[str, str]]:
    """A `Literal` field's value against its choices (from the field's type)."""
    for option in fields.options(type(cfg)):
        value = getattr(cfg, option.name)
        if option.choices is not None and value is not None and value not in option.choices:
            choices = [str(choice) for choice in option.choices]
            yield option.name, f"got {value!r}; choose one of {', '.join(choices)}{did_you_mean(value, choices)}"


def across_sections(c: Any) -> Iterable[tuple[str, str]]:
    """The rules that read more than one section: what the fault-tolerance mode asks of the
    others (`FAULT_TOLERANCE_MODES`), fsdp's workers, the global batch against the worker count,
    and evicting stragglers (an elastic run)."""
    try:
        min_workers, max_workers = parse_workers(c.workers)
    except ValueError:  # said by the cluster section's own checks
        min_workers = max_workers = None
    yield from FAULT_TOLERANCE_MODES.get(c.fault_tolerance, restart_problems)(c, min_workers, max_workers)
    if c.strategy == "fsdp" and max_workers == 0:
        yield (
            "strategy",
            "got fsdp with --workers 0: local mode runs the loop in this process without a process group, so there "
            "is nothing to shard the model over; give --workers N (N >= 1), or use --strategy ddp in local mode",
        )
    if c.evict_stragglers and min_workers is not None and not 1 <= min_workers < max_workers:
        yield (
            "evict_stragglers",
            f"needs an elastic run, which can go on without the evicted host: got --workers {c.workers}; give "
            "--workers MIN:MAX (e.g. 2:4), or drop --evict-stragglers",
        )
    if (
        c.global_batch_size is not None
        and c.batch_size_per_worker is None
        and 1 <= c.global_batch_size < (max_workers or 0)
    ):
        yield (
            "global_batch_size",
            f"got {c.global_batch_size}, fewer samples per step than the {max_workers} workers asked for; "
            f"raise it to at least {max_workers} or use fewer --workers",
        )


def restart_problems(c: Any, min_workers: int | None, max_workers: int | None) -> Iterable[tuple[str, str]]:
    """--fault-tolerance restart asks nothing of the other sections; replica groups are per-step's."""
    if c.replica_group_size > 1:
        yield (
            "replica_group_size",
            f"got {c.replica_group_size} with --fault-tolerance {c.fault_tolerance}: replica groups are per-step "
            "fault tolerance's; add --fault-tolerance per-step, or drop --replica-group-size",
        )


def per_step_problems(c: Any, min_workers: int | None, max_workers: int | None) -> Iterable[tuple[str, str]]:
    """What per-step fault tolerance needs: failures to recover, Ray workers, torchft installed, no
    BatchNorm sync, a fixed checkpoint interval, and replica groups that fit the worker count."""
    if c.max_failures == 0:
        yield (
            "max_failures",
            f"got {c.max_failures} with --fault-tolerance per-step: a replacement is a recovered failure; give "
            "--max-failures 3",
        )
    if max_workers == 0:
        yield (
            "fault_tolerance",
            "got per-step with --workers 0 (the loop in this process): it needs Ray workers; give --workers N",
        )
    if importlib.util.find_spec("torchft") is None:
        yield (
            "fault_tolerance",
            "got per-step, but torchft is not installed; install it with pip install 'raytrain[ft]' (torchft-nightly), "
            "or use --fault-tolerance restart",
        )
    if c.sync_batchnorm:
        yield (
            "sync_batchnorm",
            "cannot sync BatchNorm across per-step replicas, which step in quorums of their own; drop --sync-batchnorm "
            "or use --fault-tolerance restart",
        )
    if c.checkpoint_every == "auto":
        # Per-step replicas share no collective outside a step to agree on auto's measured figures.
        yield (
            "checkpoint_every",
            "got auto with --fault-tolerance per-step, which does not take it yet; give --checkpoint-every-steps "
            "N (raytrain plan --run RUN_DIR suggests N from a run's measured costs), or --fault-tolerance restart",
        )
    yield from _replica_group_problems(c, min_workers, max_workers)


def _replica_group_problems(c: Any, min_workers: int, max_workers: int) -> Iterable[tuple[str, str]]:
    """--replica-group-size K against the strategy and the worker count, under per-step."""
    k = c.replica_group_size
    if k < 1:
        return
    if c.strategy == "fsdp" and k == 1:
        yield (
            "strategy",
            "got fsdp with --fault-tolerance per-step and replica groups of one worker, which have nothing to shard "
            "within; give --replica-group-size K (workers per group, at least 2, dividing --workers) to shard the "
            "model within each group (HSDP), or use --strategy ddp with per-step, or --fault-tolerance restart",
        )
    if k > 1 and c.strategy != "fsdp":
        yield (
            "replica_group_size",
            f"got {k} with --strategy {c.strategy}: a replica group of several workers shards one copy of the model; "
            "add --strategy fsdp, or drop --replica-group-size to replicate the model on every worker",
        )
    if k > 1 and max_workers and (max_workers % k or min_workers % k):
        # An elastic run's MIN and MAX count in groups too: it grows and shrinks by whole groups.
        def whole(n: int) -> str:
            lower, upper = n // k * k, -(-n // k) * k
            return f"{lower} or {upper}" if lower else str(upper)

        if min_workers == max_workers:
            got, give, divides = f"--workers {max_workers}", f"--workers {whole(max_workers)}", str(max_workers)
        else:
            low = min_workers if min_workers % k == 0 else max(k, min_workers // k * k)
            got, give = f"--workers {min_workers}:{max_workers}", f"--workers {low}:{max_workers // k * k or k}"
            divides = f"both {min_workers} and {max_workers}"
        yield (
            "replica_group_size",
            f"got {k} with {got}, which is not a whole number of groups; give {give}, or a "
            f"--replica-group-size that divides {divides}",
        )


# The --fault-tolerance choices and what each asks of the other sections; each one's driver and
# worker halves are `raytrain.faults.MODES`' under the same name.
FAULT_TOLERANCE_MODES = {"restart": restart_problems, "per-step": per_step_problems}


def did_you_mean(value: Any, choices: Iterable[str]) -> str:
    match = difflib.get_close_matches(str(value), list(choices), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""
