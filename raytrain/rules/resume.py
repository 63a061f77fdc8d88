"""`--resume`: continue the run that was, with only the changes it can honour.

Every resume rule lives here; the CLI, the driver and the workers ask.

- A new run needs a new name; `--resume` needs a run by that name (and `--name`: a check of
  the options, `raytrain.config.checks.resume_problems`).
- A resumed run starts from its own resolved `config.yaml`; the `--config` file and the
  flags given with `--resume` override only what they name (`resumed_pipeline`).
- Before anything is written, the driver checks what the new options would change
  (`changes`):
  - refused (exit 2): another pipeline; another optimizer than the checkpoint's state holds;
    while an epoch is half done, another `seed`, `shuffle_window_rows` or `data_partitions`
    (each changes that epoch's order, so the rest of it would skip some samples and repeat
    others; at an epoch boundary they are allowed);
  - allowed and said in the resume line: everything else (epochs, batch knobs — the plan
    is derived again —, learning rate and schedule, workers, precision, cadences, trackers).
- config.yaml records what ran: an option a pipeline's hook replaced is written as the hook
  ("optimizer: the pipeline's build_optimizer (AdamW, 2 groups)", "schedule: the pipeline's
  lr_factor") and the options only it used are left out (`recorded_config`); a resume reads
  them back as not given (`resolvable`) and compares like with like.
- The pipeline's model must load the checkpoint (`check_model_fits`), and an epoch half done
  continues only on the same training set (`check_same_data`: on the driver for a stream,
  whose layout it knows, and on every worker).

The latest *complete* checkpoint is found from the run directory itself
(`raytrain.rundir.RunDir.stored_run`), so a resume never depends on what Ray's snapshot
managed to record; one that vanishes before it is read (pruned by a writer still running) is
chosen again (`read_chosen`), never blamed on the user's input.

An attempt's workers write only while the driver that started them holds the run
(`driver_gone`): a driver killed outright leaves its workers running, and a resume takes the run
over with a lock that names another driver.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Iterable, TypeVar

from raytrain import fields
from raytrain.config.tree import TrainConfig
from raytrain.errors import CheckpointError, ConfigError, DataError, UsageError
from raytrain.fields import flag_name
from raytrain.rundir.records import StoredRun

# What a resume makes of a changed field, from the field's `on_resume` mark (raytrain.config.sections):
# `order` changes the order of an epoch (refused in the middle of one), `state` is what the
# checkpoint's optimizer state cannot follow (refused), `invocation` is about this invocation,
# not the run (never reported as a change).
ORDER_FIELDS = fields.marked(TrainConfig, "on_resume", "order")
STATE_FIELDS = fields.marked(TrainConfig, "on_resume", "state")
INVOCATION_FIELDS = fields.marked(TrainConfig, "on_resume", "invocation")
# A pipeline hook that replaces options: (the option config.yaml records it under, the options only it used).
HOOK_FIELDS = {
    "build_optimizer": ("optimizer", ("momentum", "nesterov", "weight_decay", "decay_norm_and_bias")),
    "lr_factor": ("schedule", ("lr_milestones", "lr_gamma")),
}
HOOK_MARK = "the pipeline's "
# How long a driver on another host may leave its beat unchanged (it beats every
# `raytrain.rundir.files.LOCK_BEAT_S`) before its workers take it for gone (its pid cannot be
# checked from there): at least this, and twice the store's retry window (`driver_silent_limit_s`).
DRIVER_SILENT_MIN_S = 180.0
# How many times a checkpoint that vanished before it was read is chosen again.
CHOOSE_TRIES = 5
Choice, Read = TypeVar("Choice"), TypeVar("Read")


def hook_text(hook: str, detail: str | None = None) -> str:
    """`the pipeline's build_optimizer (AdamW, 2 groups)`: how config.yaml and the plan line name a hook."""
    return f"{HOOK_MARK}{hook}" + (f" ({detail})" if detail else "")


def recorded_config(values: dict[str, Any], hooks: Iterable[str], details: dict[str, str] | None = None) -> dict:
    """The configuration as config.yaml records it: for each pipeline hook in `hooks` that ran
    (build_optimizer, lr_factor), the option it replaced names it (with `details[hook]`, e.g.
    what the optimizer is) and the options only it used are left out."""
    recorded = dict(values)
    for hook in hooks:
        if hook not in HOOK_FIELDS:
            continue
        field, unused = HOOK_FIELDS[hook]
        recorded[field] = hook_text(hook, (details or {}).get(hook))
        for name in unused:
            recorded.pop(name, None)
    return recorded


def resolvable(values: dict[str, Any]) -> dict[str, Any]:
    """A recorded configuration as options again: what a hook replaced is left out (not given)."""
    return {key: value for key, value in values.items() if not (isinstance(value, str) and value.startswith(HOOK_MARK))}


def run_dir_problems(name: str, storage: str, resume: bool, exists: bool) -> list[tuple[str, str]]:
    """A new run needs a new name (Ray would silently continue the old one); a resume needs
    the run."""
    if exists and not resume:
        return [
            ("name", f"run {name!r} already exists in {storage}; add --resume to continue it, or choose another --name")
        ]
    if resume and not exists:
        return [("resume", f"there is no run {name!r} in {storage} to resume; check --name and --storage")]
    return []


def resumed_pipeline(stored: StoredRun, spec: str | None) -> str:
    """The pipeline of a resumed run: the one given, else the run's own. (Its options are its
    own config.yaml, then the --config file and the flags given now, each overriding only
    what it names: `raytrain.config.merge_layers`.)"""
    name, storage = stored.run_dir.name, stored.run_dir.parent
    if not stored.config:
        raise ConfigError([("resume", f"there is no run {name!r} in {storage} to resume; check --name and --storage")])
    spec = spec or stored.pipeline
    if not spec:
        raise UsageError(
            f"run {name!r} does not say which pipeline it trains; give it: raytrain train PIPELINE --name {name} "
            "--resume"
        )
    return spec


def changes(
    stored: StoredRun, new_config: dict[str, Any], new_pipeline: str, hooks: Iterable[str] = ()
) -> tuple[list[tuple[str, Any, Any]], list[tuple[str, str]]]:
    """(what the resume changes: (field, before, now)), (what it cannot honour: (field, why)).
    `hooks`: the pipeline's hooks that replace options (`HOOK_FIELDS`): compared as recorded."""
    new_config = resolvable(recorded_config(new_config, hooks))
    before_config = resolvable(stored.config)
    for hook in hooks:
        for name in (HOOK_FIELDS[hook][0], *HOOK_FIELDS[hook][1]) if hook in HOOK_FIELDS else ():
            before_config.pop(name, None)
    stored = dataclasses.replace(stored, config=before_config)
    refused: list[tuple[str, str]] = []
    if stored.pipeline and new_pipeline != stored.pipeline:
        why = (
            f"the run {stored.run_dir.name!r} trains {stored.pipeline!r}, not {new_pipeline!r}; resume it with "
            f"{stored.pipeline!r} (or leave the pipeline out), or start a new run with another --name"
        )
        refused.append(("pipeline", why))
    changed = []
    # A field the run's config.yaml does not name came after the run was written: the run ran
    # as its default says.
    defaults = {option.name: option.default for option in fields.options(TrainConfig)}
    for name in sorted(set(stored.config) | set(new_config)):
        if name in INVOCATION_FIELDS:
            continue
        before, now = stored.config.get(name, defaults.get(name)), new_config.get(name)
        if before == now:
            continue
        if name in STATE_FIELDS and stored.checkpoint is not None:
            why = f"got {now!r}, but the run's checkpoint holds the state of its optimizer with {before!r}; "
            refused.append((name, why + f"resume with {before!r}, or start a new run with another --name"))
            continue
        if name in ORDER_FIELDS and stored.mid_epoch:
            epoch = int(stored.position.get("epoch", 0)) + 1
            why = (
                f"got {now!r}, but the run is {stored.position.get('epoch_offset'):,} samples into epoch {epoch} with "
                f"{before!r}; another value changes that epoch's order, so the rest of it would skip and repeat "
                "samples. Resume without it, or change it at an epoch boundary"
            )
            refused.append((name, why))
            continue
        changed.append((name, before, now))
    return changed, refused


def describe_changes(changed: list[tuple[str, Any, Any]]) -> str:
    if not changed:
        return "no options changed"
    return "changed: " + ", ".join(
        f"{flag_name(name)} {_short(before)} → {_short(now)}" for name, before, now in changed
    )


def resume_line(name: str, stored: StoredRun, changed: list[tuple[str, Any, Any]]) -> str:
    """`Resuming NAME from step 40 (epoch 2); changed: --epochs 4 → 8`."""
    if stored.checkpoint is not None:
        where = f"from step {stored.position.get('step', 0)} (epoch {int(stored.position.get('epoch', 0)) + 1})"
    else:
        where = "from the start (it has no checkpoint yet)"
    skipped = "".join(f"; skipped: {problem}" for problem in stored.passed_over)
    return f"Resuming {name} {where}; {describe_changes(changed)}{skipped}"


def forgotten_line(gone: list[str]) -> str:
    """What a resume says when Ray's record of the run named checkpoints that are gone."""
    shown = ", ".join(gone[:3]) + (" …" if len(gone) > 3 else "")
    return (
        f"raytrain: Ray Train's record of this run's checkpoints names {len(gone)} that are gone ({shown}); "
        "it is set aside, and the run continues from what its directory holds"
    )


def check_readable(stored: StoredRun) -> None:
    """A run whose checkpoints all fail to open cannot continue (starting it over would
    overwrite its record): CheckpointError naming each and the ways out."""
    if stored.checkpoint is None and stored.passed_over:
        raise unusable(stored.run_dir, stored.passed_over)


def unusable(run_dir: Any, passed_over: list[str]) -> CheckpointError:
    """The error of a run none of whose checkpoints can be read (the driver's, and a worker's
    when the last one fails to load there)."""
    return CheckpointError(
        f"run {run_dir.name!r} cannot be resumed: none of its checkpoints can be read ("
        + "; ".join(passed_over)
        + f"). Restore them from a copy, or start over under another --name (or remove {run_dir})"
    )


def read_chosen(
    choice: Choice,
    read: Callable[[Choice], Read],
    vanished: Callable[[Choice], bool],
    choose_again: Callable[[], Choice],
) -> tuple[Choice, Read]:
    """(the choice, what `read` made of it): a `choice` whose checkpoint vanished before it was
    read (`vanished`: pruned by a writer still running, an earlier attempt's workers) is made
    again (`choose_again`), up to CHOOSE_TRIES reads in all; a CheckpointError of one still
    there is the checkpoint's."""
    for tries in range(CHOOSE_TRIES):
        choice = choice if tries == 0 else choose_again()
        try:
            return choice, read(choice)
        except CheckpointError:
            if not vanished(choice):
                raise
    raise CheckpointError(
        f"the run's checkpoints were removed faster than they could be read ({CHOOSE_TRIES} tries): another "
        "process is pruning them. Make sure no earlier run of this name still trains, then --resume again"
    )


def driver_silent_limit_s(retry_s: float) -> float:
    """How long a driver's beat may stay unchanged, for a store whose calls ride out `retry_s` of
    outage: a beat held up in those retries (or on a hard NFS mount) is a driver alive, and a
    storage outage the run survives must not stop it for good."""
    return max(DRIVER_SILENT_MIN_S, 2 * retry_s)


def driver_gone(
    holder: dict[str, Any] | None,
    owner: str,
    *,
    same_host: bool,
    pid_alive: bool | None,
    silent_s: float,
    limit_s: float = DRIVER_SILENT_MIN_S,
) -> str | None:
    """Why the driver whose lock carries `owner` no longer holds the run, or None while it may.
    `holder`: the lock's record (None: no lock); `same_host`: the holder runs on this host, where
    `pid_alive` says whether its process lives; `silent_s`: how long its beat has not changed,
    as this worker saw it, allowed up to `limit_s` (`driver_silent_limit_s`). No `owner` (an
    attempt started without a lock): nothing to compare."""
    if not owner:
        return None
    if holder is None:
        return "the run's lock is gone: its driver ended, or the lock was removed"
    pid, host = holder.get("pid", "?"), holder.get("host", "?")
    if holder.get("owner") != owner:
        return f"the run is held by another driver now (process {pid} on {host})"
    if same_host:
        return None if pid_alive else f"its driver, process {pid} on this host, has ended"
    if silent_s > limit_s:
        silence = f"has not refreshed its beat for {silent_s:.0f} s ({limit_s:.0f} s allowed)"
        return f"its driver, process {pid} on {host}, {silence}"
    return None


def check_model_fits(stored: dict[str, tuple[int, ...]], model: Any, checkpoint_name: str) -> None:
    """The pipeline's model must take the checkpoint's weights: the same names and shapes
    (`stored`: the checkpoint's, read without loading a tensor)."""
    mine = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    # in the model's order: the first difference is usually the telling one
    missing, unexpected = [k for k in mine if k not in stored], [k for k in stored if k not in mine]
    shapes = [key for key in mine if key in stored and mine[key] != stored[key]]
    if not (missing or unexpected or shapes):
        return
    if shapes:
        key = shapes[0]
        what = f"{key} is {list(stored[key])} there and {list(mine[key])} in the model"
    else:
        what = "; ".join(
            f"{label} {', '.join(keys[:3])}{' …' if len(keys) > 3 else ''}"
            for label, keys in (("missing from the checkpoint:", missing), ("not in the model:", unexpected))
            if keys
        )
    raise CheckpointError(
        f"the pipeline's model does not load the run's checkpoint {checkpoint_name} ({what}); "
        "resume with the pipeline and options the run was trained with"
    )


def check_same_data(before: dict[str, Any], now: dict[str, Any], step: int, mid_epoch: bool) -> None:
    """A checkpoint's position is an offset into its epoch's order: resuming an epoch half done
    on other data (rows, units, window, partitions) is refused."""
    if mid_epoch and before and before != now:
        raise DataError(
            f"dataset 'train' is not the one the checkpoint at step {step} was trained on (then {before}, now {now}); "
            "resume with the same data and --shuffle-window-rows/--data-partitions, or start a new run with another "
            "--name"
        )


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."
