"""Each command's handler: the options read (`raytrain.cli.options`), then the library called.
Errors are not handled here: `raytrain.cli.run_command` turns each into one message and an
exit status."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from raytrain import fields
from raytrain.cli.options import read_run_options, resumed_options
from raytrain.config import TrainConfig, merge_layers
from raytrain.errors import ConfigError, UsageError
from raytrain.pipeline import load_pipeline, parse_pipeline_args
from raytrain.rules.accounting import goodput_phrase
from raytrain.rundir import RunDir, Store
from raytrain.rundir.records import PLOTS, REPORT
from raytrain.text import plural


def cmd_train(args: argparse.Namespace) -> int:
    from raytrain.driver.run import fit

    spec, file_values, flags = read_run_options(args)
    if flags.get("resume") or file_values.get("resume"):
        spec, values = resumed_options(spec, file_values, flags)
    else:
        values = merge_layers(load_pipeline(spec).default_config, file_values, flags)
    cfg = TrainConfig.from_dict(values)
    parse_pipeline_args(load_pipeline(spec), cfg.pipeline_args)  # keys it does not declare refused
    with on_local_head(cfg.address):
        result = fit(spec, cfg, echo=lambda line: print(line, flush=True), progress=True)
    # The run's files through the storage as given (its credentials, if the URI holds them).
    print_summary(result, RunDir(Store.of(cfg.storage) / Store.of(result.run_dir).name))
    return 0


def print_summary(result, files: "RunDir | None" = None) -> None:
    s = result.summary
    window = s.get("final_loss_steps")
    metrics = "  ".join(
        f"{k} {v:.4f}" + (f" (steps {window[0]:,}–{window[1]:,})" if k == "loss" and window else "")
        for k, v in s["final_metrics"].items()
        if isinstance(v, (int, float))
    )
    steady = f", {s['steady_samples_per_s']:,.0f} samples/s steady" if s.get("steady_samples_per_s") else ""
    steady += goodput_phrase(s.get("goodput"), s["steps"])  # kept step time over wall time, and what dominates
    print(f"Done in {s['wall_time_s']:.1f} s: {s['epochs']} epochs, {s['steps']} steps{steady}; {metrics}")
    print(f"Run directory: {result.run_dir}")
    if result.model_path:
        print(f"Model: {result.model_path} (plain state_dict, loads with strict=True)")
    files = files or RunDir(result.run_dir)
    if files.has(REPORT):
        print(f"Report: {files.store / REPORT} (plots in {PLOTS}/); TensorBoard: tensorboard --logdir {files.store}")


def cmd_report(args: argparse.Namespace) -> int:
    from raytrain.observe.report import write_report

    path = write_report(args.run_dir)
    plots = [name for name in RunDir(args.run_dir).store.list(PLOTS) if name.endswith(".png")]
    print(f"Wrote {path} and {plural(len(plots), 'plot')}: {', '.join(plots) or 'none (no metrics yet)'}")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from raytrain.errors import EXIT_FAILED
    from raytrain.tune import tune
    from raytrain.tune.options import SWEPT, LrDraws, TuneOptions, parse_search_space

    spec, file_values, flags = read_run_options(args)
    fixed = dict(flags)
    draws = {option.name: fixed.pop(option.name) for option in fields.options(LrDraws) if option.name in fixed}
    options = {option.name: fixed.pop(option.name) for option in fields.options(TuneOptions) if option.name in fixed}
    # An axis comes from its flag, else from the YAML file (a list, or one value).
    axes: dict[str, Any] = {name: fixed.pop(name, None) for name in SWEPT}
    for name in SWEPT:
        in_file = file_values.pop(name, None)
        if axes[name] is None and not (name == "lr" and "lr_range" in draws):
            axes[name] = in_file
    space = parse_search_space(**axes, **draws)
    sweep = TuneOptions(**options)
    pipe = load_pipeline(spec)
    cfg = TrainConfig.from_dict(merge_layers(pipe.default_config, file_values, fixed))
    parse_pipeline_args(pipe, cfg.pipeline_args)
    with on_local_head(cfg.address):
        result = tune(spec, cfg, space, sweep, echo=lambda line: print(line, flush=True))
    return 0 if result.best is not None else EXIT_FAILED


def cmd_bench(args: argparse.Namespace) -> int:
    from raytrain.bench import BenchOptions, bench_config, run_bench, worker_counts
    from raytrain.bench.predict import PredictOptions, predict_speedups

    given = vars(args)
    own = {option.name for option in (*fields.options(BenchOptions), *fields.options(PredictOptions))}
    # The cost model's inputs but --link (the bench's too): without --predict a whole bench would
    # run and never read them.
    unread = [o.flags[-1] for o in fields.options(PredictOptions) if o.name in given and o.name != "link"]
    if unread and not args.predict:
        one = len(unread) == 1
        raise UsageError(
            f"{' and '.join(unread)} {'is' if one else 'are'} read only with --predict (the cost model, which runs "
            f"nothing): add --predict to estimate the speedup from {'it' if one else 'them'}, or drop "
            f"{'it' if one else 'them'} to run the bench"
        )
    if args.predict:
        predict_speedups(PredictOptions(**_given(args, PredictOptions)))
        return 0
    values = _given(args, BenchOptions)
    values["workers"] = worker_counts(args.workers)
    values["baselines"] = [name for names in values.get("baselines", []) for name in names]
    opts = BenchOptions(**values)
    spec, file_values, flags = read_run_options(args, exclude={*own, "predict"}, example="digits --workers 1,2")
    args.spell = None  # bench names every option as a flag
    values = merge_layers(load_pipeline(spec).default_config, file_values, flags)
    bench_config(values, opts, workers=max(opts.workers), epochs=1, storage=opts.storage, name="check")  # validated
    with on_local_head(values.get("address")):
        run_bench(spec, values, opts, echo=lambda line: print(line, flush=True))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from raytrain.check.driver import run_check
    from raytrain.check.options import CheckOptions

    own = {option.name for option in fields.options(CheckOptions)}
    opts = CheckOptions(**_given(args, CheckOptions))
    spec, file_values, flags = read_run_options(args, exclude=own, example="digits --workers 2")
    pipe = load_pipeline(spec)
    cfg = TrainConfig.from_dict(merge_layers(pipe.default_config, file_values, flags))
    parse_pipeline_args(pipe, cfg.pipeline_args)
    with on_local_head(cfg.address):
        verdict = run_check(spec, cfg, opts, echo=lambda line: print(line, flush=True))
    return verdict.exit_status


def cmd_export(args: argparse.Namespace) -> int:
    pipeline_args = getattr(args, "pipeline_args", None)
    if args.format == "hf":
        from raytrain.rundir.export_hf import export_pretrained

        export_pretrained(args.source, args.output, args.pipeline, pipeline_args=pipeline_args)
    else:
        from raytrain.rundir.export import export_weights

        export_weights(args.source, args.output, args.pipeline, pipeline_args=pipeline_args)
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from raytrain.data.write import write_datasets
    from raytrain.driver.session import ray_session

    pipe = load_pipeline(args.pipeline)
    values = {"pipeline_args": getattr(args, "pipeline_args", []), "workers": 1}
    cfg = TrainConfig.from_dict(merge_layers(pipe.default_config, values))
    write_datasets(
        pipe,
        cfg,
        args.out,
        shuffle_seed=args.shuffle_seed,
        row_group_rows=args.row_group_rows,
        session=lambda: ray_session(dataclasses.replace(cfg, address=getattr(args, "address", None))),
        echo=lambda line: print(line, flush=True),
    )
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from raytrain.doctor import run_doctor

    if args.storage is not None and not args.storage.strip():  # as `train` says it, not the default checked instead
        raise ConfigError([("storage", "is empty; give a directory, e.g. --storage ~/raytrain_results")])
    with on_local_head(args.address):
        return run_doctor(address=args.address, storage=args.storage, echo=print)


# -- raytrain up / down, and the commands that join the head they manage ---------------------


def cmd_up(args: argparse.Namespace) -> int:
    from raytrain.driver.head import start_head

    if args.num_cpus is not None and args.num_cpus < 1:
        raise ConfigError([("num_cpus", f"got {args.num_cpus}; give at least 1")])
    start_head(args.num_cpus, echo=lambda line: print(line, flush=True))
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from raytrain.driver.head import stop_head

    return stop_head(echo=lambda line: print(line, flush=True))


def on_local_head(address: str | None):
    """Without --address (or RAY_ADDRESS), the command joins the head `raytrain up` started,
    saying so in its first line; the head's death during it fails it with that cause
    (`raytrain.driver.head.joined_head`)."""
    from raytrain.driver.head import joined_head as joined

    return joined(address, echo=lambda line: print(line, flush=True))


def cmd_plan(args: argparse.Namespace) -> int:
    from raytrain.bench.plan import PlanOptions, run_plan

    run_plan(PlanOptions(**_given(args, PlanOptions)))
    return 0


def _given(args: argparse.Namespace, options: type) -> dict[str, Any]:
    """The flags given of the fields of the dataclass `options`."""
    given = vars(args)
    return {option.name: given[option.name] for option in fields.options(options) if option.name in given}
