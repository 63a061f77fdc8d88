"""Probes: when N workers train otherwise than 1, find out why by running the pipeline's own
code on one batch in one process, each suspect neutralized in turn, instead of guessing.

Every probe calls `compute_loss` on copies of the pipeline object and of the model at their
initial state, on the rows of the first step, in fp32, under torch's generators seeded for
the call (and restored after it), so one probe leaves nothing behind for the next:

- randomness: the same batch and weights under two seeds (dropout layers are already in
  evaluation mode) give two losses;
- state kept in the pipeline object: a copy already called gives another loss on the same
  batch than a fresh copy (and the attributes it changed are named);
- the rank or world size: compute_loss under `raytrain.context()` of 1 worker and of rank
  N-1 of N;
- the split: the loss over the whole batch against the row-weighted mean of the losses over
  its N shares (what the N workers' losses add up to). A ratio of N is a sum over the rows
  (reduction="sum"); a gap that closes when the BatchNorm layers normalize by their fixed
  running statistics is per-rank BatchNorm statistics;

Nothing here starts Ray: the probes run on rank 0 of the check's worker group, and in the
pure tests on tiny models.
"""

from __future__ import annotations

import contextlib
import copy
import random
from typing import Any, Callable, Iterator

import numpy as np
import torch

from raytrain import hooks
from raytrain.check.verdict import TOLERANCE, Cause, relative_difference
from raytrain.pipeline import _CONTEXT, Pipeline
from raytrain.rules.steps import split_range

# Two calls that should give the same loss: any difference beyond fp32 rounding is a finding.
SAME = TOLERANCE["fp32"]
SEEDS = (1234, 4321)

Batch = dict[str, torch.Tensor]


def batchnorm_layers(model: torch.nn.Module) -> list[str]:
    """Names of the BatchNorm layers that normalize each rank's share by its own statistics
    (those already synced across ranks left out)."""
    synced = (torch.nn.SyncBatchNorm,)
    return [
        name or type(module).__name__
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
        and not isinstance(module, synced)
        and type(module).__name__ != "GlobalBatchNorm"
    ]


DROPOUT_TYPES = (torch.nn.modules.dropout._DropoutNd, torch.nn.MultiheadAttention)


def dropout_to_eval(model: torch.nn.Module) -> int:
    """Put the dropout layers (and attention's built-in dropout) in evaluation mode: their
    masks legitimately differ with the worker count. Returns how many."""
    found = [module for module in model.modules() if isinstance(module, DROPOUT_TYPES)]
    for module in found:
        module.eval()
    return len(found)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """torch's, numpy's and Python's generators seeded for a call, then put back."""
    numpy_state, python_state = np.random.get_state(), random.getstate()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        try:
            yield
        finally:
            np.random.set_state(numpy_state)
            random.setstate(python_state)


@contextlib.contextmanager
def placed(rank: int, world_size: int) -> Iterator[None]:
    """`raytrain.context()` as rank `rank` of `world_size` sees it, for a call."""
    before = (_CONTEXT.world_rank, _CONTEXT.world_size)
    _CONTEXT.world_rank, _CONTEXT.world_size = rank, world_size
    try:
        yield
    finally:
        _CONTEXT.world_rank, _CONTEXT.world_size = before


class Subject:
    """The pipeline and model under probe, kept at their initial state: every call works on
    fresh copies of both unless it is handed a pipeline copy to reuse."""

    def __init__(self, pipeline: Pipeline, model: torch.nn.Module, batch: Batch, wrap: Callable[[Batch], Any] = dict):
        self.pipeline, self.model, self.batch, self.wrap = pipeline, model, batch, wrap

    def fresh(self) -> Pipeline:
        return copy.deepcopy(self.pipeline)

    def loss(
        self,
        rows: slice | None = None,
        *,
        seed: int = SEEDS[0],
        pipeline: Pipeline | None = None,
        model: torch.nn.Module | None = None,
    ) -> float:
        """compute_loss's loss (a float) on `rows` of the batch (all by default)."""
        batch = self.batch if rows is None else {name: value[rows] for name, value in self.batch.items()}
        pipe = pipeline if pipeline is not None else self.fresh()
        with seeded(seed):
            output = hooks.call(
                pipe, "compute_loss", model if model is not None else copy.deepcopy(self.model), self.wrap(batch)
            )
        loss = output[0] if isinstance(output, tuple) else output
        return float(loss.detach().float())

    @property
    def rows(self) -> int:
        return len(next(iter(self.batch.values())))


def probe_randomness(subject: Subject) -> Cause | None:
    first, second = subject.loss(seed=SEEDS[0]), subject.loss(seed=SEEDS[1])
    if relative_difference(first, second) <= SAME:
        return None
    return Cause(
        "randomness in compute_loss or the model",
        f"The same batch and weights gave the loss {first:.7g} and then {second:.7g} under another random seed "
        "(dropout layers were in evaluation mode). Each worker draws from its own stream, so at N workers the draws "
        "differ from one worker's.",
        "remove the noise, or draw it in transform_batch (raytrain seeds it per step and rank, the same after a "
        "resume), or from a generator seeded from raytrain.context() (epoch, step); use dropout layers (nn.Dropout) "
        "rather than random draws of your own.",
    )


def probe_state(subject: Subject) -> Cause | None:
    reused = subject.fresh()
    third = max(1, subject.rows // 3)
    for rows in (slice(0, third), slice(third, None)):  # calls on other rows, which may leave something behind
        subject.loss(rows, pipeline=reused)
    fresh = subject.fresh()
    after, first = subject.loss(pipeline=reused), subject.loss(pipeline=fresh)
    if relative_difference(first, after) <= SAME:
        return None
    changed = changed_attributes(fresh, reused)
    named = f" (attributes it changed: {', '.join(changed)})" if changed else ""
    return Cause(
        "state carried across calls in the pipeline object",
        f"On the same batch and weights compute_loss gave {first:.7g} from a fresh pipeline object and {after:.7g} "
        f"from one already called{named}. Every worker holds its own copy, updated from its own share of the rows, "
        "so the state differs with the worker count.",
        "compute what the loss needs from the batch (or keep it in the model as a parameter or buffer, which DDP "
        "keeps identical on every rank) instead of in attributes of the pipeline that compute_loss updates.",
    )


def changed_attributes(before: Any, after: Any) -> list[str]:
    """Attributes of the pipeline object whose values differ between two copies."""
    names = sorted(set(vars(before)) | set(vars(after)))
    return [name for name in names if not _same(vars(before).get(name), vars(after).get(name))]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    try:
        return bool(a == b)
    except Exception:  # arrays and other types without a plain truth value
        return repr(a) == repr(b)


def probe_context(subject: Subject, workers: int) -> Cause | None:
    with placed(0, 1):
        alone = subject.loss()
    with placed(workers - 1, workers):
        among = subject.loss()
    if relative_difference(alone, among) <= SAME:
        return None
    return Cause(
        "compute_loss depends on the rank or the world size",
        f"On the same batch and weights it gave {alone:.7g} as the only worker and {among:.7g} as rank {workers - 1} "
        f"of {workers} (raytrain.context().world_rank / world_size).",
        "a step's loss must not depend on how its rows are split: drop the dependency (raytrain already keeps the "
        "global batch and the learning rate fixed whatever the worker count).",
    )


def split_losses(subject: Subject, parts: int) -> tuple[float, float]:
    """(the loss over the whole batch, the row-weighted mean of the losses over its `parts`
    shares): what 1 worker and what N workers see of the same step."""
    whole = subject.loss()
    shares = [(lo, hi) for lo, hi in split_range(subject.rows, parts) if hi > lo]
    split = sum((hi - lo) * subject.loss(slice(lo, hi)) for lo, hi in shares) / subject.rows
    return whole, split


def probe_split(subject: Subject, workers: int, noisy: bool = False, batchnorm_synced: bool = False) -> Cause | None:
    """`noisy`: the loss is random (probe_randomness), so only a ratio of N says something.
    `batchnorm_synced` (--sync-batchnorm): the BatchNorm layers see the global batch, as here
    in one process; they are held at fixed statistics so that the split probes the rest."""
    if batchnorm_synced:
        subject = Subject(subject.pipeline, _batchnorm_frozen(subject.model), subject.batch, subject.wrap)
    whole, split = split_losses(subject, workers)
    gap = relative_difference(whole, split)
    if gap <= SAME:
        return None
    ratio = whole / split if split else float("inf")
    if abs(ratio - workers) <= 0.02 * workers:
        return Cause(
            "a loss that scales with the per-rank batch",
            f"On one batch of {subject.rows} rows the loss over all of them is {whole:.7g}, {ratio:.2f} × the mean of "
            f"the losses over its {workers} shares ({split:.7g}): compute_loss sums over the rows (reduction='sum') "
            "instead of averaging, so each worker's loss and gradient shrink with its share.",
            "average over the rows: F.cross_entropy(..., reduction='mean') (the default) or loss.sum() / rows; "
            "raytrain weights each worker's mean by its rows, so the step's gradient is the mean over the global "
            "batch.",
        )
    if noisy:
        return None
    layers = [] if batchnorm_synced else batchnorm_layers(subject.model)
    if layers:
        frozen = Subject(subject.pipeline, _batchnorm_frozen(subject.model), subject.batch, subject.wrap)
        closed = relative_difference(*split_losses(frozen, workers))
        if closed <= SAME:
            return Cause(
                "BatchNorm layers normalize each worker's share with its own statistics",
                f"{len(layers)} BatchNorm layer(s) ({', '.join(layers[:4])}{', ...' if len(layers) > 4 else ''}); "
                f"on one batch of {subject.rows} rows the loss over all of them is {whole:.7g} and over its "
                f"{workers} shares {split:.7g} (relative difference {gap:.1e}); with the layers normalizing by "
                f"fixed statistics the gap closes ({closed:.1e}).",
                "--sync-batchnorm (statistics over the global batch, as one worker computes them; one collective "
                "per BatchNorm layer per forward), or a normalization that does not depend on the batch "
                "(GroupNorm, LayerNorm).",
            )
    return Cause(
        "the loss depends on how the batch is split",
        f"On one batch of {subject.rows} rows the loss over all of them is {whole:.7g} and the mean over its "
        f"{workers} shares {split:.7g} (relative difference {gap:.1e}): the model or the loss uses statistics of "
        "the batch as a whole (a normalization over the batch, pairs across rows, a mean over the wrong dimension).",
        "compute such statistics per row, or over the global batch (all-gather across ranks).",
    )


def _batchnorm_frozen(model: torch.nn.Module) -> torch.nn.Module:
    """A copy whose BatchNorm layers normalize by their running statistics (no batch statistics)."""
    frozen = copy.deepcopy(model)
    for module in frozen.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.eval()
    return frozen


def find_causes(subject: Subject, workers: int, batchnorm_synced: bool = False) -> list[Cause]:
    """Every probed cause found, the most specific first."""
    randomness = probe_randomness(subject)
    found = [
        probe_split(subject, workers, noisy=randomness is not None, batchnorm_synced=batchnorm_synced),
        randomness,
        probe_state(subject),
        probe_context(subject, workers),
    ]
    return [cause for cause in found if cause is not None]
