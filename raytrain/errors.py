"""What can go wrong, by who must act: the user (never retried, exit 2) or nobody (retried).

`UserError` is the one root of what the user must fix: bad configuration, usage, data,
pipeline code, a checkpoint or storage, a diverged loss. It is deterministic: running the
attempt again repeats it, so raytrain's failure policy ends the run at once
(`raytrain.driver.failfast`). So does a `DeterministicFault`, a failure of the cluster or the
code that an attempt met again where an earlier one met it (not the user's input: the run
failed, exit status 1). Worker deaths, lost nodes and collective timeouts are neither: they
keep --max-failures.

The command line's exit status is a property of the error's type (`exit_status`): 2 for a
UserError, 1 for a run that failed (`RunFailed`) or diverged (`TrainingDiverged`, a UserError
whose run failed), 130/143 for a signal.

The second half reads failures: an `ErrorSummary` (the exception and the user's frames) made
on the worker from the exception object, or from a traceback's text when only that reached
the driver, and `explain_worker_errors`, the paragraph a failed run prints.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

# Paths that are not the user's code: Python's, libraries', raytrain's own.
_LIBRARY_PARTS = ("/site-packages/", "/dist-packages/", "/lib/python3", "/ray/", "/torch/")
_RAYTRAIN_DIR = str(Path(__file__).resolve().parent) + os.sep


def is_user_file(path: str) -> bool:
    """Not Python's, a library's or raytrain's own: the pipeline or the user's module."""
    if path.startswith("<"):
        return False
    path = os.path.abspath(path)
    return not path.startswith(_RAYTRAIN_DIR) and not any(part in path for part in _LIBRARY_PARTS)


# The command line's exit statuses (DESIGN): 1 a run that failed or diverged, 2 what the user
# must fix; a signal's are raytrain.driver.interrupts'.
EXIT_FAILED, EXIT_USAGE = 1, 2


class UserError(Exception):
    """An error the user must fix: one message naming what is wrong and the fix; never
    retried; exit status 2 (a diverged run's, `TrainingDiverged`, is 1: the run failed)."""

    exit_status = EXIT_USAGE


class ConfigError(UserError, ValueError):
    """Invalid user configuration: every problem at once, each with its fix.

    `problems` is a list of (field, message). `render` spells each field the way
    the user wrote it (a flag, a YAML key, a keyword argument).
    """

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = list(problems)
        super().__init__(self.render())

    def render(self, spell: Callable[[str], str] | None = None) -> str:
        spell = spell or (lambda name: name)
        lines = [f"{spell(name)}: {message}" if name else message for name, message in self.problems]
        if len(lines) == 1:
            return f"Invalid configuration: {lines[0]}"
        return f"Invalid configuration ({len(lines)} problems):\n" + "\n".join("  " + line for line in lines)


class UsageError(UserError, ValueError):
    """A command used in a way that cannot work (a missing file, an output in the way)."""


class DataError(UserError, ValueError):
    """A dataset that cannot be trained on, naming the dataset, the file or row, and the fix."""


class StorageError(UserError, OSError):
    """A run file that cannot be written or read: the path, the errno and what to do."""

    def __str__(self) -> str:
        return str(self.strerror if self.strerror is not None else super().__str__())


class CheckpointError(UserError, ValueError):
    """A checkpoint or run directory that cannot be used, with what to do about it."""


class PipelineError(UserError, ValueError):
    """The pipeline named by the user cannot be found or is not a Pipeline."""


class PipelineCodeError(UserError, RuntimeError):
    """The pipeline's own code raised or returned something raytrain cannot use."""


class DeterministicFault(RuntimeError):
    """A failure of the cluster or the code, not of the user's input, that repeats where it
    happened when retried (the same replica mismatch at the same step after a rollback): never
    retried, whatever --max-failures; the run failed (`RunFailed`'s paragraph, exit status 1)."""


# What the failure policy never retries: running the attempt again would fail the same way.
NOT_RETRIED = (UserError, DeterministicFault)


class RunFailed(RuntimeError):
    """The run started but did not finish: the cause in one paragraph and where the logs are
    (exit status 1)."""

    exit_status = EXIT_FAILED


def exit_status(error: BaseException) -> int | None:
    """The command line's exit status for `error`, by its type (its class's `exit_status`); None
    for an error raytrain does not anticipate (a bug: its traceback shows)."""
    status = getattr(error, "exit_status", None)
    return status if isinstance(status, int) else None


def find_user_error(error: BaseException | None) -> UserError | None:
    """The UserError inside `error` (`find_error`)."""
    return find_error(error, UserError)


def find_error(error: BaseException | None, kind: "type[Any] | tuple[type[Any], ...]") -> Any:
    """The error of `kind` inside `error`: itself, its cause chain, a Ray task error's cause, or
    the first rank's exception of a Ray Train worker-group error."""
    seen: set[int] = set()
    stack = [error]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        cause = getattr(current, "cause", None)  # ray.exceptions.RayTaskError: the task's own exception
        if isinstance(cause, kind):
            return cause
        if isinstance(current, kind):
            return current
        stack.append(getattr(current, "controller_failure", None))  # Ray Train's ControllerError
        stack.append(cause)
        stack.append(current.__cause__)
        failures = getattr(current, "worker_failures", None) or {}
        stack.extend(failures[rank] for rank in sorted(failures, reverse=True))
    return None


@dataclass
class Frame:
    file: str
    line: int
    func: str
    code: str

    @property
    def is_user_code(self) -> bool:
        """Not Python's, a library's or raytrain's own: the pipeline or the user's module."""
        return is_user_file(self.file)

    def describe(self) -> str:
        return f"{self.file}:{self.line}, in {self.func}" + (f": {self.code}" if self.code else "")


@dataclass
class ErrorSummary:
    """A traceback reduced to what a user reads first (plain data: it pickles, so a worker's
    summary reaches the driver, where Ray keeps only the traceback's text)."""

    exception: list[str]  # "KeyError: 'nope'" (a message may span lines)
    frames: list[Frame]  # where it happened: user frames, innermost last
    died: bool = False  # no exception: the worker process itself died (`exception` says how)

    def lines(self, max_frames: int = 3, max_message_lines: int = 8) -> list[str]:
        head = self.exception[:max_message_lines] or ["(no message)"]
        return head + [f"  at {frame.describe()}" for frame in self.frames[-max_frames:]]

    @classmethod
    def from_exception(cls, exc: BaseException) -> "ErrorSummary":
        """The exception's type and message, and the innermost frames of user code (else the
        innermost of all) — from its cause chain when the error surfaced in a library."""
        chain = [traceback.TracebackException.from_exception(exc)]
        while chain[-1].__cause__ is not None or (
            chain[-1].__context__ is not None and not chain[-1].__suppress_context__
        ):
            chain.append(chain[-1].__cause__ or chain[-1].__context__)
        message = [
            line.rstrip() for part in chain[0].format_exception_only() for line in part.splitlines() if line.strip()
        ]
        return cls(exception=message, frames=_blamed([list(map(_frame, cause.stack)) for cause in chain]))


def _frame(summary: traceback.FrameSummary) -> Frame:
    return Frame(summary.filename, summary.lineno or 0, summary.name, (summary.line or "").strip())


def _blamed(chain: list[list[Frame]]) -> list[Frame]:
    """The user's frames of the error (`chain[0]`), else of its nearest cause that has any (the
    error surfaced in a library, the user's call that led there is in a cause); else the error's
    innermost two frames."""
    for frames in chain:
        user = [frame for frame in frames if frame.is_user_code]
        if user:
            return user
    return chain[0][-2:]


SUMMARY_ATTRIBUTE = "raytrain_error_summary"


def summarize_on_raise(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, whose exceptions carry their ErrorSummary when they leave it (the worker
    side of a Ray Train run: the driver explains the failure from it)."""

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                setattr(exc, SUMMARY_ATTRIBUTE, ErrorSummary.from_exception(exc))
            raise

    return run


def attached_summary(error: BaseException) -> ErrorSummary | None:
    """The ErrorSummary a worker attached to `error`, if any (Ray Train hands back the worker's own
    exception: its poll unwraps the wrapper the worker's thread raised in)."""
    summary = getattr(error, SUMMARY_ATTRIBUTE, None)
    return summary if isinstance(summary, ErrorSummary) else None


def user_frames(exc: BaseException, limit: int = 3) -> list[str]:
    """`file:line, in function: code` for the innermost frames of user code in `exc`'s traceback."""
    frames = [frame for frame in map(_frame, traceback.extract_tb(exc.__traceback__)) if frame.is_user_code]
    return [frame.describe() for frame in frames[-limit:]]


@contextlib.contextmanager
def pipeline_code(pipeline, method: str) -> Iterator[None]:
    """Run a pipeline method; an exception from it (the user's code) becomes a
    PipelineCodeError naming the method, the error and where in the user's code. `pipeline`:
    the Pipeline, or how the user named it (before there is one)."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:
        where = user_frames(exc)
        name = pipeline if isinstance(pipeline, str) else pipeline.name
        message = f"pipeline {name}: {method} raised {innermost_error(exc)}".rstrip(": ")
        raise PipelineCodeError(message + "".join(f"\n  at {frame}" for frame in where)) from exc


def innermost_error(exc: BaseException) -> str:
    """`Type: message` of what the user's code actually raised: the deepest cause of an
    exception that is not one of Ray's wrappers, else the last such line of a Ray task's
    traceback text."""
    chain, current = [], exc
    while current is not None and current not in chain:
        chain.append(current)
        current = getattr(current, "cause", None) or current.__cause__
    own = [e for e in chain if not type(e).__module__.startswith("ray.")]
    if own:
        deepest = own[-1]
        lines = [line.strip() for line in str(deepest).splitlines() if line.strip()]
        if len(lines) <= 1:
            return f"{type(deepest).__name__}: {lines[0] if lines else ''}"[:500]
    lines = [line.strip() for e in chain for line in str(e).splitlines() if line.strip()]
    typed = [
        line
        for line in lines
        if ":" in line
        and line.split(":", 1)[0].replace(".", "").replace("_", "").isalnum()
        and line.split(":", 1)[0].endswith(("Error", "Exception", "Invalid", "Interrupt", "Exit"))
        and not line.startswith(("ray.", "Ray"))
    ]
    if typed:
        return typed[-1][:500]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:500]


def weights_mismatch(exc: BaseException) -> str:
    """torch's load_state_dict error in one line: the keys the model lacks and has beyond the
    file, and the tensors of another shape (`missing 1.weight, 1.bias; unexpected extra.w;
    0.weight is [5, 4] in the file, [3, 4] in the model`)."""
    text = str(exc)
    parts = []
    for label, pattern in (
        ("missing", r"Missing key\(s\) in state_dict: (.*?)\.\s*$"),
        ("unexpected", r"Unexpected key\(s\) in state_dict: (.*?)\.\s*$"),
    ):
        found = re.search(pattern, text, re.MULTILINE)
        if found:
            keys = re.findall(r'"([^"]+)"', found[1])
            parts.append(f"{label} {', '.join(keys[:5])}{' …' if len(keys) > 5 else ''} ({len(keys)})")
    for name, file_shape, model_shape in re.findall(
        r"size mismatch for (\S+): copying a param with shape torch.Size\((\[[^\]]*\])\) from checkpoint, the shape in "
        r"current model is torch.Size\((\[[^\]]*\])\)",
        text,
    )[:5]:
        parts.append(f"{name} is {file_shape} in the file, {model_shape} in the model")
    return "; ".join(parts) or (text.strip().splitlines() or [type(exc).__name__])[0]


# -- reading a traceback's text --------------------------------------------------------------

_SNIPPET = re.compile(r"^\[Rank ([\d,\s]+) Error Snippet\]:\s*$", re.MULTILINE)
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+?)\s*$')
_CHAINED = re.compile(
    r"^(During handling of the above exception|The above exception was the direct cause)", re.MULTILINE
)


def summarize_traceback(text: str) -> ErrorSummary:
    """Exception type and message, and the innermost frames of user code (else the
    innermost frames of all), from a formatted Python traceback."""
    segments = _CHAINED.split(text)
    return ErrorSummary(_exception_lines(segments[-1]), _blamed([_frames(segment) for segment in reversed(segments)]))


def _frames(text: str) -> list[Frame]:
    lines = text.splitlines()
    frames = []
    for index, line in enumerate(lines):
        match = _FRAME.match(line)
        if not match:
            continue
        code = lines[index + 1].strip() if index + 1 < len(lines) else ""
        if _FRAME.match(code) or not code or set(code) <= set("^~ "):
            code = ""
        frames.append(Frame(match["file"], int(match["line"]), match["func"], code))
    return frames


def _exception_lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    start = 0
    for index, line in enumerate(lines):
        if _FRAME.match(line):
            start = index + 1
            # skip the frame's code and caret lines (indented)
            while start < len(lines) and lines[start].startswith("    "):
                start += 1
    return [
        line
        for line in lines[start:]
        if line.strip() and not line.startswith("Traceback (most recent call last)") and not _SNIPPET.match(line)
    ]


def _attached_summaries(failures: dict[int, BaseException]) -> list[tuple[list[int], ErrorSummary]]:
    """(ranks, summary) for the ranks whose exception carries its summary, alike ranks together."""
    grouped: dict[tuple[str, ...], tuple[list[int], ErrorSummary]] = {}
    for rank, exc in sorted(failures.items()):
        summary = attached_summary(exc)
        if summary is not None:
            grouped.setdefault(tuple(summary.lines()), ([], summary))[0].append(rank)
    return list(grouped.values())


_DEATH = "A worker health check failed"  # how Ray Train says a worker process is gone


def worker_death(text: str) -> ErrorSummary | None:
    """A rank whose worker process died (Ray Train's failed health check, whose text dumps the
    worker's actor, metadata and context: a dozen lines), said in one line — the process,
    how it exited as Ray tells it, and the worker's log — or None for another error."""
    if _DEATH not in text:
        return None
    pid = re.search(r"^\s*pid: (\d+)", text, re.MULTILINE)
    detail = re.search(
        r"Worker exit detail: (.+?)(?= There are some potential root causes| Some common causes|\n|$)", text
    )
    log = re.search(r"log_file_path='([^']+)'", text)
    how = detail[1].strip().rstrip(".") if detail else "Ray gives no exit detail"
    line = (
        f"lost its worker process{f' (pid {pid[1]})' if pid else ''}: {how}. A process that vanishes like this was "
        "killed (out of memory, SIGKILL) or crashed (e.g. SIGSEGV in native code)"
        + (f"; its output: {log[1]}" if log else "")
    )
    return ErrorSummary(exception=[line], frames=[], died=True)


def explain_worker_errors(error: BaseException) -> list[str]:
    """Per failed rank: `rank N raised Type: message`, then the user frames where it happened.

    A rank's exception carries its ErrorSummary, made from the exception object on the
    worker (`errors.summarize_on_raise`); ranks that failed alike are grouped. Otherwise
    (an error raised outside raytrain's worker function) Ray Train's WorkerGroupError
    carries each rank's traceback as text ("[Rank N Error Snippet]:", alike ranks grouped
    as "Rank 0,1"), and other errors are summarized from their own text. Only the first
    error keeps a long message in full.
    """
    text = str(error)
    failures = getattr(error, "worker_failures", None) or {}
    failed = _attached_summaries(failures)
    if failed:  # a rank whose process died carries no summary: say it too, it is the likely cause
        failed += [([rank], death) for rank, exc in sorted(failures.items()) if (death := worker_death(str(exc)))]
    matches = [] if failed else list(_SNIPPET.finditer(text))
    for index, match in enumerate(matches):
        end = matches[index + 1].start() if index + 1 < len(matches) else len(text)
        ranks = sorted(int(rank) for rank in re.findall(r"\d+", match[1]))
        snippet = text[match.end() : end]
        failed.append((ranks, worker_death(snippet) or summarize_traceback(snippet)))
    if not failed:
        for rank, exc in sorted(failures.items()):
            failed.append(([rank], worker_death(str(exc)) or summarize_traceback(f"{type(exc).__name__}: {exc}")))
    if not failed:
        summary = summarize_traceback(text)
        if "Traceback (most recent call last)" not in text:
            summary.exception = f"{type(error).__name__}: {text.strip()}".strip().rstrip(":").splitlines()
        return summary.lines()
    failed.sort(key=lambda item: (not item[1].died, item[0]))  # a lost process first: the others' errors follow it
    out = []
    for number, (ranks, summary) in enumerate(failed[:4]):
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        lines = summary.lines(max_message_lines=12 if number == 0 else 1)
        out.append(f"{who}{'' if summary.died else ' raised'} {lines[0]}")
        out.extend(lines[1:])
    if len(failed) > 4:
        out.append(f"(and {len(failed) - 4} more failed ranks: see the logs)")
    return out
