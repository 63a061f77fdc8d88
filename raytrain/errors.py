"""What can go wrong, by who must act: the user (never retried, exit 2) or nobody (retried).

A `UserFault` is deterministic: bad configuration, data, pipeline code, checkpoint or
storage. Running the attempt again repeats it, so raytrain's failure policy stops the run
at once (`raytrain.trainer.FailFastPolicy`) and the CLI exits 2 with the message. Worker
deaths, lost nodes and collective timeouts are not UserFaults: they keep --max-failures.
"""

from __future__ import annotations


class UserFault(Exception):
    """An error the user must fix; retrying cannot help."""


class DataError(UserFault, ValueError):
    """A dataset that cannot be trained on, naming the dataset, the file or row, and the fix."""


class StorageError(UserFault, OSError):
    """A run file that cannot be written or read: the path, the errno and what to do."""


class PipelineCodeError(UserFault, RuntimeError):
    """The pipeline's own code raised or returned something raytrain cannot use."""


def find_user_fault(error: BaseException | None) -> UserFault | None:
    """The UserFault inside `error`: itself, its cause chain, a Ray task error's cause, or
    the first rank's exception of a Ray Train worker-group error."""
    seen: set[int] = set()
    stack = [error]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        cause = getattr(current, "cause", None)  # ray.exceptions.RayTaskError: the task's own exception
        if isinstance(cause, UserFault):
            return cause
        if isinstance(current, UserFault):
            return current
        stack.append(getattr(current, "_base_exc", None))  # Ray Train's UserExceptionWithTraceback
        stack.append(cause)
        stack.append(current.__cause__)
        failures = getattr(current, "worker_failures", None) or {}
        stack.extend(failures[rank] for rank in sorted(failures, reverse=True))
    return None
