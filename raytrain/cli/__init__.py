"""`raytrain` command line: train, tune, bench, check, report, export, data, doctor, up, down.

- `parser`: every command's flags, built from the typed options (`raytrain.fields`);
- `options`: the layers of a run's options (the pipeline's defaults, a --config file, the
  flags) and how a message names each (as the user wrote it);
- `commands`: each command's handler, calling into the library.

Exit status: 0 success; 2 what the user must fix (usage, configuration, data, pipeline code,
checkpoint, storage: one message naming what is wrong and the fix); 1 a run that failed or
diverged (the cause, then where the logs are); 130/143 stopped by SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from raytrain.errors import EXIT_FAILED, EXIT_USAGE, ConfigError
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
    and nowhere else: 2 for what the user must fix (configuration, data, pipeline code,
    checkpoint, storage), 1 for a run that failed or diverged, 130/143 for SIGINT/SIGTERM.
    No traceback. A ConfigError names each option as the user wrote it (`args.spell`, set
    by `read_run_options`; else as a flag)."""
    from raytrain.bench.options import BenchError
    from raytrain.driver.interrupts import Interrupted
    from raytrain.errors import RunFailed, UserError
    from raytrain.rundir import storage_error

    def say(message: str) -> None:
        print(f"raytrain {args.command}: {message}", file=sys.stderr, flush=True)

    previous = (
        signal.signal(signal.SIGTERM, _terminate) if threading.current_thread() is threading.main_thread() else None
    )
    try:
        return args.handler(args)
    except Interrupted as exc:
        say(str(exc))
        return exc.exit_status
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    except Terminated:
        say("terminated")
        return 143
    except (RunFailed, BenchError) as exc:
        say(str(exc))
        return EXIT_FAILED
    except FloatingPointError as exc:  # raytrain.worker.loop.TrainingDiverged: the run failed, status "diverged"
        say(str(exc))
        return EXIT_FAILED
    except ConfigError as exc:
        say(exc.render(getattr(args, "spell", None) or flag_name))
        return EXIT_USAGE
    except UserError as exc:
        say(str(exc))
        return EXIT_USAGE
    except OSError as exc:  # the file system said no somewhere this command writes or reads
        say(str(storage_error(exc, exc.filename or "a file", "use")))
        return EXIT_USAGE
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class Terminated(Exception):
    """SIGTERM outside a run (a run handles it itself: raytrain.driver.interrupts)."""


def _terminate(signum, frame):
    raise Terminated()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
