"""`raytrain` command line: train, tune, bench, check, report, export, data, doctor, up, down.

Flags in `parser`, a run's layered options in `options`, handlers in `commands`; every exit
status is decided in `run_command`."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from raytrain.errors import EXIT_USAGE, ConfigError
from raytrain.fields import flag_name


def main(argv: list[str] | None = None) -> int:
    from raytrain.cli.parser import build_parser

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_USAGE
    return run_command(args)


def run_command(args: argparse.Namespace) -> int:
    """Run a command's handler; every error becomes one message and an exit status, here
    and nowhere else, the status decided by the error's type (`raytrain.errors.exit_status`):
    0 success; 2 what the user must fix (usage, configuration, data, pipeline code, checkpoint,
    storage: one message naming what is wrong and the fix); 1 a run that failed or diverged;
    130/143 SIGINT/SIGTERM. No traceback, except for an error raytrain does not anticipate (a
    bug). A ConfigError names each option as the user wrote it (`args.spell`, set by
    `read_run_options`; else as a flag)."""
    from raytrain.errors import exit_status
    from raytrain.rundir import storage_error

    def say(message: str) -> None:
        print(f"raytrain {args.command}: {message}", file=sys.stderr, flush=True)

    previous = (
        signal.signal(signal.SIGTERM, _terminate) if threading.current_thread() is threading.main_thread() else None
    )
    try:
        return args.handler(args)
    except KeyboardInterrupt:  # Ctrl-C outside a run (a run raises Interrupted: raytrain.driver.interrupts)
        say("interrupted")
        return 130
    except Exception as exc:
        error = exc
        if exit_status(exc) is None and isinstance(exc, OSError):  # the file system refused a path the command uses
            error = storage_error(exc, exc.filename or "a file", "use")
        status = exit_status(error)
        if status is None:
            raise
        say(error.render(getattr(args, "spell", None) or flag_name) if isinstance(error, ConfigError) else str(error))
        return status
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class Terminated(Exception):
    """SIGTERM outside a run (a run handles it itself: raytrain.driver.interrupts)."""

    exit_status = 143

    def __str__(self) -> str:
        return "terminated"


def _terminate(signum, frame):
    raise Terminated()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
