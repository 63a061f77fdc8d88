"""The checks of a `TrainConfig`: every value against its type, a choice against the field's
`Literal`, and each value against what it means. Each problem is (field, message naming the
value and the fix); `TrainConfig.__post_init__` raises them all at once, in field order. (The
functions take the `TrainConfig` being checked: this module is imported by its own.)"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import re
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


_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
NEEDS_NAME = "needs the run to continue: add --name RUN (the directory under --storage)"
EMPTY_NAME = "a name cannot be empty: give one, e.g. --name digits-lr3e-3, or leave --name out for a generated one"


def resume_problems(resume: bool, name: str | None) -> list[tuple[str, str]]:
    """`--resume` continues a run by its name: without `--name` there is none to continue."""
    return [("resume", NEEDS_NAME)] if resume and not name else []


def problems_of(cfg: Any) -> list[tuple[str, str]]:
    """Every problem of `cfg`: its types first (a value of the wrong type makes the other
    checks moot), then its choices and values, in the order of the fields (as --help lists them)."""
    found = list(_check_types(cfg)) + list(_check_types(cfg.ddp, prefix="ddp."))
    if found:
        return found
    order = {name: index for index, name in enumerate(f.name for f in dataclasses.fields(cfg))}
    found = [*_check_choices(cfg), *_check_values(cfg)]
    return sorted(found, key=lambda problem: order.get(problem[0].split(".")[0], len(order)))


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


def _check_values(c: Any) -> Iterable[tuple[str, str]]:
    """Every value against what it means (each check names the fix); in field order once sorted."""
    yield from _check_counts(c)
    yield from _check_workers(c)
    yield from _check_rates(c)
    yield from _check_run(c)


def _positive_int(name: str, value: int | None, example: int) -> Iterable[tuple[str, str]]:
    if value is not None and value < 1:
        yield name, f"got {value}; must be a positive integer, e.g. {flag_name(name)} {example}"


def _check_counts(c: Any) -> Iterable[tuple[str, str]]:
    yield from _positive_int("epochs", c.epochs, 5)
    yield from _positive_int("max_steps", c.max_steps, 1000)
    yield from _positive_int("eval_every_steps", c.eval_every_steps, 100)
    yield from _positive_int("eval_batches", c.eval_batches, 20)
    yield from _positive_int("global_batch_size", c.global_batch_size, 256)
    yield from _positive_int("batch_size_per_worker", c.batch_size_per_worker, 32)
    yield from _positive_int("micro_batch_size", c.micro_batch_size, 16)
    yield from _positive_int("reference_batch_size", c.reference_batch_size, 32)
    yield from _positive_int("log_every_steps", c.log_every_steps, 10)
    yield from _positive_int("num_checkpoints_to_keep", c.num_checkpoints_to_keep, 2)
    if c.data_partitions < 1:
        yield "data_partitions", f"got {c.data_partitions}; must be a positive integer, e.g. --data-partitions 24"
    if c.timing_warmup_steps < 0:
        yield "timing_warmup_steps", f"got {c.timing_warmup_steps}; must be 0 or more, e.g. --timing-warmup-steps 3"
    if c.checkpoint_every_steps < 0:
        yield (
            "checkpoint_every_steps",
            f"got {c.checkpoint_every_steps}; must be 0 (epoch ends only) or a positive step count",
        )
    yield from _check_auto_interval(c)
    if c.seed < 0:
        yield "seed", f"got {c.seed}; must be 0 or more"
    if c.max_failures < -1:
        yield "max_failures", f"got {c.max_failures}; must be 0 or more (-1 retries forever)"
    if c.shuffle_window_rows is not None and c.shuffle_window_rows < 0:
        yield (
            "shuffle_window_rows",
            f"got {c.shuffle_window_rows}; must be 0 (hold the data in memory) or a row count, e.g. "
            "--shuffle-window-rows 65536",
        )


def _check_auto_interval(c: Any) -> Iterable[tuple[str, str]]:
    """--checkpoint-every auto and its inputs (raytrain.rules.interval)."""
    if c.checkpoint_every == "auto" and c.checkpoint_every_steps > 0:
        yield (
            "checkpoint_every",
            f"got auto together with --checkpoint-every-steps {c.checkpoint_every_steps}; give one: "
            "--checkpoint-every auto chooses the interval from the measured costs, --checkpoint-every-steps N fixes it",
        )
    if c.checkpoint_every == "auto" and c.fault_tolerance == "per-step":
        # Per-step replicas share no collective outside a step to agree on auto's measured figures.
        yield (
            "checkpoint_every",
            "got auto with --fault-tolerance per-step, which does not take it yet; give --checkpoint-every-steps N "
            "(raytrain plan --run RUN_DIR suggests N from a run's measured costs), or --fault-tolerance restart",
        )
    if not 0 < c.mtbf_hours < math.inf:
        yield "mtbf_hours", f"got {c.mtbf_hours}; must be a positive number of hours per node, e.g. --mtbf-hours 6335"
    yield from _positive_int("checkpoint_min_steps", c.checkpoint_min_steps, 10)
    if c.checkpoint_min_steps >= 1 and c.checkpoint_max_steps < c.checkpoint_min_steps:
        yield (
            "checkpoint_max_steps",
            f"got {c.checkpoint_max_steps}, fewer than --checkpoint-min-steps {c.checkpoint_min_steps}; raise it or "
            "lower --checkpoint-min-steps",
        )


def _check_workers(c: Any) -> Iterable[tuple[str, str]]:
    """The worker count, and what depends on it: per-step fault tolerance, the global batch."""
    try:
        min_workers, max_workers = parse_workers(c.workers)
    except ValueError as exc:
        yield "workers", str(exc)
        min_workers = max_workers = None

    if c.fault_tolerance == "per-step" and max_workers is not None:
        if max_workers == 0:
            yield (
                "fault_tolerance",
                "got per-step with --workers 0 (the loop in this process): it needs Ray workers; give --workers N",
            )
        elif min_workers != max_workers:
            yield (
                "fault_tolerance",
                f"got per-step with --workers {c.workers}: per-step replaces a failed worker in place and keeps the "
                f"count fixed; give --workers {max_workers}, or keep --fault-tolerance restart for an elastic run",
            )
    if c.fault_tolerance == "per-step" and importlib.util.find_spec("torchft") is None:
        yield (
            "fault_tolerance",
            "got per-step, but torchft is not installed; install it with pip install 'raytrain[ft]' (torchft-nightly), "
            "or use --fault-tolerance restart",
        )
    if c.fault_tolerance == "per-step" and c.sync_batchnorm:
        yield (
            "sync_batchnorm",
            "cannot sync BatchNorm across per-step replicas, which step in quorums of their own; drop --sync-batchnorm "
            "or use --fault-tolerance restart",
        )
    if c.strategy == "fsdp" and max_workers == 0:
        yield (
            "strategy",
            "got fsdp with --workers 0: local mode runs the loop in this process without a process group, so there "
            "is nothing to shard the model over; give --workers N (N >= 1), or use --strategy ddp in local mode",
        )
    if c.strategy == "fsdp" and c.fault_tolerance == "per-step":
        yield (
            "strategy",
            "got fsdp with --fault-tolerance per-step: per-step replica groups hold one worker each, so there is "
            "nothing to shard inside a group (a sharded replica group, HSDP, is not supported); use --strategy fsdp "
            "with --fault-tolerance restart, or --strategy ddp with per-step",
        )
    if c.fault_tolerance == "per-step" and c.max_failures == 0:
        yield (
            "max_failures",
            f"got {c.max_failures} with --fault-tolerance per-step: a replacement is a recovered failure; give "
            "--max-failures 3",
        )

    if c.global_batch_size is not None and c.batch_size_per_worker is not None:
        yield (
            "global_batch_size",
            f"got {c.global_batch_size} together with --batch-size-per-worker {c.batch_size_per_worker}; "
            "set exactly one: --global-batch-size keeps the optimizer's batch fixed whatever the worker "
            "count, --batch-size-per-worker lets it grow with the workers",
        )
    elif c.global_batch_size is not None and 1 <= c.global_batch_size < (max_workers or 0):
        yield (
            "global_batch_size",
            f"got {c.global_batch_size}, fewer samples per step than the {max_workers} workers asked for; "
            f"raise it to at least {max_workers} or use fewer --workers",
        )


def _check_rates(c: Any) -> Iterable[tuple[str, str]]:
    """The learning rate, its warmup and schedule, and the optimizer's knobs."""
    if not (c.lr > 0 and c.lr < float("inf")):
        yield "lr", f"got {c.lr}; must be a positive number, e.g. --lr 1e-3"
    yield from _check_milestones(c)
    if not 0 < c.lr_gamma <= 1:
        yield "lr_gamma", f"got {c.lr_gamma}; must be in (0, 1], e.g. --lr-gamma 0.1"
    if c.warmup_start_factor is not None and not 0 <= c.warmup_start_factor <= 1:
        yield "warmup_start_factor", f"got {c.warmup_start_factor}; must be in [0, 1], e.g. --warmup-start-factor 0.01"
    if not 0 <= c.momentum < 1:
        yield "momentum", f"got {c.momentum}; must be in [0, 1), e.g. --momentum 0.9"
    if c.nesterov and (c.optimizer != "sgd" or c.momentum == 0):
        yield "nesterov", "applies to --optimizer sgd with a --momentum above 0"
    if c.grad_clip_norm is not None and not 0 < c.grad_clip_norm < math.inf:
        yield "grad_clip_norm", f"got {c.grad_clip_norm}; must be a positive norm, e.g. --grad-clip-norm 1.0"
    yield from _check_warmup(c)
    if not 0 <= c.weight_decay < math.inf:
        yield "weight_decay", f"got {c.weight_decay}; must be 0 or more"


def _check_run(c: Any) -> Iterable[tuple[str, str]]:
    """Where the run goes, its name, its timers and its cluster."""
    if not 0 < c.collective_timeout_s < math.inf:
        yield "collective_timeout_s", f"got {c.collective_timeout_s}; must be a positive number of seconds, e.g. 600"
    if not 0 < c.cpus_per_worker < math.inf:
        yield "cpus_per_worker", f"got {c.cpus_per_worker}; must be a positive number of CPUs, e.g. 1"
    if not c.storage:
        yield "storage", "is empty; give a directory, e.g. --storage ~/raytrain_results"
    elif "://" in c.storage and not _URI_RE.match(c.storage):
        yield (
            "storage",
            f"got {c.storage!r}; give a directory or an object store's URI with its bucket, e.g. "
            "s3://my-bucket/raytrain or gs://my-bucket/raytrain",
        )
    if c.name is not None and not c.name.strip():
        yield "name", f"got {c.name!r}; {EMPTY_NAME} (PIPELINE-DATE-TIME)"
    elif c.name is not None and not _NAME_RE.match(c.name):
        yield "name", f"got {c.name!r}; use letters, digits, '.', '_' and '-' only, e.g. --name digits-lr3e-3"
    yield from resume_problems(c.resume, c.name)
    if not 0 < c.progress_interval_s < math.inf:
        yield "progress_interval_s", f"got {c.progress_interval_s}; must be a positive number of seconds, e.g. 10"
    if c.peak_tflops is not None and not 0 < c.peak_tflops < math.inf:
        yield "peak_tflops", f"got {c.peak_tflops}; must be a positive number of TFLOP/s, e.g. --peak-tflops 989"
    if not 0 < c.ddp.bucket_cap_mb < math.inf:
        yield "ddp.bucket_cap_mb", f"got {c.ddp.bucket_cap_mb}; must be a positive size in MiB, e.g. 25"


_URI_RE = re.compile(r"^(file://.*|[a-z][a-z0-9+.-]*://[^/?#]+(/[^?#]*)?(\?.*)?)$")


def _check_warmup(c: Any) -> Iterable[tuple[str, str]]:
    if not 0 <= c.warmup_epochs < math.inf:
        yield "warmup_epochs", f"got {c.warmup_epochs}; must be 0 or more, e.g. --warmup-epochs 1"
    elif c.warmup_steps is not None and c.warmup_epochs > 0:
        yield (
            "warmup_steps",
            f"got {c.warmup_steps} together with --warmup-epochs {c.warmup_epochs:g}; give the warmup one way: in "
            "steps (--warmup-steps) or in epochs (--warmup-epochs)",
        )
    elif c.epochs is not None and c.epochs >= 1 and c.warmup_epochs > c.epochs:
        yield (
            "warmup_epochs",
            f"got {c.warmup_epochs}, longer than the {c.epochs} epochs of the run; lower it or raise --epochs",
        )
    if c.warmup_steps is not None and c.warmup_steps < 0:
        yield "warmup_steps", f"got {c.warmup_steps}; must be 0 or more, e.g. --warmup-steps 100"
    elif c.warmup_steps is not None and c.max_steps is not None and c.warmup_steps > c.max_steps:
        yield (
            "warmup_steps",
            f"got {c.warmup_steps}, longer than the {c.max_steps} steps of the run (--max-steps); lower it or raise "
            "--max-steps",
        )


def _check_milestones(c: Any) -> Iterable[tuple[str, str]]:
    milestones = c.lr_milestones
    if c.schedule == "step" and not milestones:
        yield "lr_milestones", "--schedule step needs the epochs at which to decay, e.g. --lr-milestones 30,60"
    if milestones is None:
        return
    if c.schedule != "step":
        yield (
            "lr_milestones",
            f"got {milestones}; milestones apply to --schedule step only (the schedule is {c.schedule})",
        )
        return
    if not all(isinstance(m, (int, float)) and not isinstance(m, bool) for m in milestones):
        yield "lr_milestones", f"got {milestones}; give epochs as numbers, e.g. --lr-milestones 30,60"
    elif any(b <= a for a, b in zip(milestones, milestones[1:])) or milestones[0] <= 0:
        yield "lr_milestones", f"got {milestones}; epochs must be positive and increasing, e.g. --lr-milestones 30,60"


def did_you_mean(value: Any, choices: Iterable[str]) -> str:
    match = difflib.get_close_matches(str(value), list(choices), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""
