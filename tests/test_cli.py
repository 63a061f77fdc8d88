"""The command line on bad input: exit status 2, one message naming the option, the value
and the fix, no traceback, and nothing started (Ray stays down).

Most cases run `raytrain.cli.main` in-process; a few run the installed `raytrain` script
to check the real exit status. `raytrain export` is checked on crafted checkpoints.
The one case that needs a cluster to decide (`--gpu` without GPUs) is marked `ray`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import ray
import torch
import yaml
from torch import nn

from raytrain.cli import main
from raytrain.cli.options import load_yaml
from raytrain.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]
RAYTRAIN = next(
    (p for p in (REPO / ".venv" / "bin" / "raytrain", Path(sys.executable).with_name("raytrain")) if p.is_file()),
    None,
)


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Run `raytrain ARGV` in this process: (exit status, stdout, stderr)."""
    ray_was_up = ray.is_initialized()
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    out, err = capsys.readouterr()
    if not ray_was_up:
        assert not ray.is_initialized(), f"raytrain {' '.join(argv)} started Ray before rejecting its input"
    return code, out, err


def assert_usage_error(code: int, out: str, err: str, *expected: str, lines: int | None = 1) -> None:
    assert code == 2, (code, out, err)
    assert "Traceback" not in err and "Traceback" not in out
    assert err.startswith("raytrain"), err
    if lines is not None:
        assert len(err.strip().splitlines()) == lines, err
    for text in expected:
        assert text in err, f"{text!r} not in {err!r}"


@pytest.fixture
def train(capsys, tmp_path):
    """`raytrain train ARGS --storage TMP` in-process (storage given only if ARGS have none)."""

    def run(*args: str) -> tuple[int, str, str]:
        storage = [] if "--storage" in args else ["--storage", str(tmp_path / "runs")]
        return cli(capsys, "train", *args, *storage)

    return run


# -- flags ----------------------------------------------------------------------------------


@pytest.mark.parametrize("word", ["none", "null", "None", "NULL"])
def test_a_run_name_is_text_never_unset(word):
    from raytrain.cli.parser import build_parser

    assert build_parser().parse_args(["train", "digits", "--name", word]).name == word
    assert build_parser().parse_args(["bench", "digits", "--workers", "1", "--name", word]).name == word
    assert TrainConfig.from_dict({"name": word}).name == word  # a YAML `name: none` too


FLAG_CASES = [
    (["--epochs", "-1"], "--epochs: got -1; must be a positive integer, e.g. --epochs 5"),
    (["--epochs", "0"], "--epochs: got 0; must be a positive integer, e.g. --epochs 5"),
    (["--workers", "3:2"], "--workers: got '3:2'; need 0 <= MIN <= MAX, e.g. 2:8"),
    (["--workers", "abc"], "--workers: got 'abc'; give a worker count N or MIN:MAX, e.g. 2 or 2:8"),
    (["--workers", "0:4"], "--workers: got '0:4'; an elastic run needs MIN >= 1, e.g. 1:4"),
    (["--workers", "-2"], "--workers: got '-2'; give a worker count N or MIN:MAX"),
    (["--lr", "0"], "--lr: got 0.0; must be a positive number, e.g. --lr 1e-3"),
    (["--lr", "-0.5"], "--lr: got -0.5; must be a positive number, e.g. --lr 1e-3"),
    (["--lr", "nan"], "--lr: got nan; must be a positive number"),
    (["--lr-scaling", "cubic"], "--lr-scaling: got 'cubic'; choose one of linear, sqrt, none"),
    (
        ["--lr-scaling", "lineer"],
        "--lr-scaling: got 'lineer'; choose one of linear, sqrt, none (did you mean 'linear'?)",
    ),
    (["--precision", "fp8"], "--precision: got 'fp8'; choose one of fp32, bf16, fp16"),
    (
        ["--schedule", "cosin"],
        "--schedule: got 'cosin'; choose one of cosine, constant, linear, step, onecycle (did you mean 'cosine'?)",
    ),
    (
        ["--schedule", "step"],
        "--lr-milestones: --schedule step needs the epochs at which to decay, e.g. --lr-milestones 30,60",
    ),
    (["--optimizer", "adam"], "--optimizer: got 'adam'; choose one of adamw, sgd, lamb (did you mean 'adamw'?)"),
    (
        ["--global-batch-size", "64", "--batch-size-per-worker", "32"],
        "--global-batch-size: got 64 together with --batch-size-per-worker 32; set exactly one",
    ),
    (
        ["--global-batch-size", "2", "--workers", "4"],
        "--global-batch-size: got 2, fewer samples per step than the 4 workers asked for",
    ),
    (
        ["--global-batch-size", "0"],
        "--global-batch-size: got 0; must be a positive integer, e.g. --global-batch-size 256",
    ),
    (["--batch-size-per-worker", "-8"], "--batch-size-per-worker: got -8; must be a positive integer"),
    (["--micro-batch-size", "0"], "--micro-batch-size: got 0; must be a positive integer, e.g. --micro-batch-size 16"),
    (["--reference-batch-size", "0"], "--reference-batch-size: got 0; must be a positive integer"),
    (
        ["--warmup-epochs", "10", "--epochs", "2"],
        "--warmup-epochs: got 10.0, longer than the 2 epochs of the run; lower it or raise --epochs",
    ),
    (["--warmup-epochs", "-1"], "--warmup-epochs: got -1.0; must be 0 or more, e.g. --warmup-epochs 1"),
    (["--weight-decay", "-0.1"], "--weight-decay: got -0.1; must be 0 or more"),
    (["--seed", "-1"], "--seed: got -1; must be 0 or more"),
    (["--max-failures", "-2"], "--max-failures: got -2; must be 0 or more (-1 retries forever)"),
    (
        ["--checkpoint-every-steps", "-1"],
        "--checkpoint-every-steps: got -1; must be 0 (epoch ends only) or a positive step count",
    ),
    (["--num-checkpoints-to-keep", "0"], "--num-checkpoints-to-keep: got 0; must be a positive integer"),
    (["--timing-warmup-steps", "-1"], "--timing-warmup-steps: got -1; must be 0 or more, e.g. --timing-warmup-steps 3"),
    (["--log-every-steps", "0"], "--log-every-steps: got 0; must be a positive integer"),
    (
        ["--collective-timeout-s", "0"],
        "--collective-timeout-s: got 0.0; must be a positive number of seconds, e.g. 600",
    ),
    (["--collective-timeout-s", "inf"], "--collective-timeout-s: got inf; must be a positive number of seconds"),
    (["--cpus-per-worker", "0"], "--cpus-per-worker: got 0.0; must be a positive number of CPUs, e.g. 1"),
    (["--ddp-bucket-cap-mb", "0"], "--ddp-bucket-cap-mb: got 0.0; must be a positive size in MiB, e.g. 25"),
    (
        ["--storage", "s3:///runs"],
        "--storage: got 's3:///runs'; give a directory or an object store's URI with its bucket",
    ),
    (["--storage", ""], "--storage: is empty; give a directory"),
    (
        ["--name", "bad name"],
        "--name: got 'bad name'; use letters, digits, '.', '_' and '-' only, e.g. --name digits-lr3e-3",
    ),
    (["--name", "../up"], "--name: got '../up'; use letters, digits"),
    (
        ["--name", ""],
        "--name: got ''; a name cannot be empty: give one, e.g. --name digits-lr3e-3, or leave --name out",
    ),
    (["--name", "", "--resume"], "--resume: needs the run to continue: add --name RUN"),
    (["--resume"], "--resume: needs the run to continue: add --name RUN (the directory under --storage)"),
]


@pytest.mark.parametrize("args, expected", FLAG_CASES, ids=[" ".join(a) for a, _ in FLAG_CASES])
def test_invalid_flag_values(train, args, expected):
    code, out, err = train("digits", *args)
    assert_usage_error(code, out, err, "raytrain train: Invalid configuration: " + expected)
    assert out == ""


ARGPARSE_CASES = [
    (["--lr-milestones", "3,x"], "argument --lr-milestones: got '3,x'; expected comma-separated numbers, e.g. 30,60"),
    (["--epochs", "abc"], "argument --epochs: invalid int value: 'abc'"),
    (["--epochs", "2.5"], "argument --epochs: invalid int value: '2.5'"),
    (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
    (["--global-batch-size", "1e3"], "argument --global-batch-size: invalid int value: '1e3'"),
    (["--precision"], "argument --precision: expected one argument"),
    (["--bogus"], "unrecognized arguments: --bogus"),
]


@pytest.mark.parametrize("args, expected", ARGPARSE_CASES, ids=[" ".join(a) for a, _ in ARGPARSE_CASES])
def test_malformed_flags_are_one_line_usage_errors(train, args, expected):
    code, out, err = train("digits", *args)
    assert_usage_error(code, out, err, expected, "--help")


def test_export_without_output_is_a_usage_error(capsys):
    code, out, err = cli(capsys, "export", "somewhere")
    assert_usage_error(code, out, err, "raytrain export: error: the following arguments are required: -o/--output")


def test_no_command_prints_help_and_exits_2(capsys):
    code, out, _ = cli(capsys)
    assert code == 2
    assert "train" in out and "export" in out


def test_several_problems_in_one_message(train):
    code, out, err = train("digits", "--epochs", "0", "--lr", "0", "--precision", "fp8", "--workers", "3:2")
    assert_usage_error(code, out, err, "raytrain train: Invalid configuration (4 problems):", lines=5)
    for flag in ("--epochs: got 0", "--workers: got '3:2'", "--lr: got 0.0", "--precision: got 'fp8'"):
        assert "\n  " + flag in err


# -- pipelines -------------------------------------------------------------------------------


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module of the user's, importable by a name unique to this test."""
    name = f"user_pipes_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            import raytrain

            NUMBER = 42

            class NotAPipeline:
                pass

            class Good(raytrain.Pipeline):
                default_config = {"epochs": 2, "batch_size_per_worker": 16}

            GOOD = Good()
            """
        )
    )
    (tmp_path / f"{name}_broken.py").write_text("import a_package_that_is_not_installed_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_no_pipeline(train):
    code, out, err = train()
    assert_usage_error(
        code, out, err, "raytrain train: no pipeline: give one (raytrain train digits) or set `pipeline:` in --config"
    )


@pytest.mark.parametrize(
    "spec, expected",
    [
        (
            "nosuch",
            "pipeline: unknown name 'nosuch'; use a built-in one (digits, parquet, charlm, hf-causal-lm, "
            "hf-classification) or point at your own as module:attr",
        ),
        ("digit", "pipeline: unknown name 'digit'"),
        ("no_such_module_xyz:Pipe", "pipeline 'no_such_module_xyz:Pipe': cannot find module 'no_such_module_xyz'"),
        (
            "pipelines.digits:Missing",
            "pipeline 'pipelines.digits:Missing': module 'pipelines.digits' has no attribute 'Missing'",
        ),
        (
            "raytrain.config:TrainConfig",
            "pipeline 'raytrain.config:TrainConfig': TrainConfig is a type, not a raytrain.Pipeline; subclass "
            "raytrain.Pipeline",
        ),
        (
            "pipelines.digits.model:DigitsCNN",
            "pipeline 'pipelines.digits.model:DigitsCNN': DigitsCNN is a type, not a raytrain.Pipeline",
        ),
    ],
)
def test_bad_pipeline(train, spec, expected):
    code, out, err = train(spec)
    assert_usage_error(code, out, err, "raytrain train: " + expected)


@pytest.mark.parametrize(
    "attr, expected",
    [
        ("NUMBER", "NUMBER is a int, not a raytrain.Pipeline"),
        ("NotAPipeline", "NotAPipeline is a type, not a raytrain.Pipeline"),
        ("Missing", "has no attribute 'Missing'"),
    ],
)
def test_user_module_attr_that_is_not_a_pipeline(train, user_module, attr, expected):
    code, out, err = train(f"{user_module}:{attr}")
    assert_usage_error(code, out, err, f"pipeline '{user_module}:{attr}'", expected)


def test_user_module_that_does_not_import(train, user_module):
    code, out, err = train(f"{user_module}_broken:Pipe")
    assert_usage_error(
        code,
        out,
        err,
        f"module '{user_module}_broken' imports 'a_package_that_is_not_installed_xyz', which is not installed here: "
        "install it",
    )


@pytest.mark.parametrize("attr", ["Good", "GOOD"])
def test_user_pipeline_class_or_instance_is_accepted(train, user_module, attr, tmp_path):
    """A good module:attr gets as far as the run directory (here: nothing to resume)."""
    code, out, err = train(f"{user_module}:{attr}", "--resume", "--name", "nope")
    assert_usage_error(code, out, err, "--resume: there is no run 'nope' in")


# -- runs: resume and name ----------------------------------------------------------------


def test_resume_of_a_run_that_does_not_exist(train, tmp_path):
    code, out, err = train("digits", "--resume", "--name", "nope", "--storage", str(tmp_path))
    assert_usage_error(
        code, out, err, f"--resume: there is no run 'nope' in {tmp_path} to resume; check --name and --storage"
    )
    assert not (tmp_path / "nope").exists()


def test_existing_run_without_resume(train, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "config.yaml").write_text("epochs: 1\n")
    code, out, err = train("digits", "--name", "taken", "--storage", str(tmp_path))
    assert_usage_error(
        code,
        out,
        err,
        f"--name: run 'taken' already exists in {tmp_path}; add --resume to continue it, or choose another --name",
    )


def test_global_batch_flag_overrides_the_pipelines_per_worker_batch(train):
    """digits' recipe sets batch_size_per_worker; --global-batch-size replaces it, no conflict."""
    code, out, err = train("digits", "--global-batch-size", "64", "--resume", "--name", "nope")
    assert_usage_error(code, out, err, "--resume: there is no run 'nope'")
    assert "set exactly one" not in err


# -- --config ------------------------------------------------------------------------------


@pytest.fixture
def config_file(tmp_path):
    def write(text: str, name: str = "run.yaml") -> str:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return str(path)

    return write


def test_config_missing_file(train, tmp_path):
    missing = tmp_path / "missing.yaml"
    code, out, err = train("digits", "--config", str(missing))
    assert_usage_error(code, out, err, f"--config: file {missing} not found; give the path of a YAML file of options")


def test_config_invalid_yaml(train, config_file):
    path = config_file("epochs: [1, 2\nlr: 0.1\n")
    code, out, err = train("digits", "--config", path)
    assert_usage_error(code, out, err, f"--config {path}: not valid YAML (")


@pytest.mark.parametrize("text, kind", [("- 1\n- 2\n", "list"), ("just some text\n", "str"), ("42\n", "int")])
def test_config_not_a_mapping(train, config_file, text, kind):
    path = config_file(text)
    code, out, err = train("digits", "--config", path)
    assert_usage_error(code, out, err, f"--config {path}: expected a mapping of option: value, got {kind}")


def test_config_unknown_key_names_the_key_and_the_file(train, config_file):
    path = config_file("epochs: 2\nlr_scale: sqrt\n")
    code, out, err = train("digits", "--config", path)
    assert_usage_error(code, out, err, f"lr_scale (in {path}): unknown option (did you mean 'lr_scaling'?)")


def test_config_several_unknown_keys(train, config_file):
    path = config_file("learnin_rate: 0.1\nepoch: 3\n")
    code, out, err = train("digits", "--config", path)
    assert_usage_error(
        code, out, err, f"learnin_rate (in {path}): unknown option", f"epoch (in {path}): unknown option", lines=3
    )


def test_config_unknown_ddp_key(train, config_file):
    path = config_file("ddp:\n  bucket_cap: 10\n")
    code, out, err = train("digits", "--config", path)
    assert_usage_error(code, out, err, f"ddp.bucket_cap (in {path}): unknown option (did you mean 'bucket_cap_mb'?)")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("epochs: -1\n", "epochs (in {path}): got -1; must be a positive integer"),
        ("epochs: five\n", "epochs (in {path}): got 'five' (str); expected an integer"),
        ("workers: 3:2\n", "workers (in {path}): got '3:2'; need 0 <= MIN <= MAX"),
        ("ddp:\n  bucket_cap_mb: 0\n", "ddp.bucket_cap_mb (in {path}): got 0; must be a positive size in MiB"),
        ("ddp: 5\n", "ddp (in {path}): got 5 (int); expected a mapping of DDP flags"),
    ],
)
def test_config_bad_values_name_the_file(train, config_file, text, expected):
    path = config_file(text)
    code, out, err = train("digits", "--config", path)
    assert_usage_error(code, out, err, expected.format(path=path))


def test_config_names_the_pipeline(capsys, config_file, tmp_path):
    path = config_file("pipeline: nosuch\n")
    code, out, err = cli(capsys, "train", "--config", path, "--storage", str(tmp_path))
    assert_usage_error(code, out, err, "raytrain train: pipeline: unknown name 'nosuch'")


def test_flags_override_the_config_file(train, config_file):
    path = config_file("epochs: -1\nprecision: fp8\n")
    code, out, err = train(
        "digits", "--config", path, "--epochs", "2", "--precision", "bf16", "--resume", "--name", "nope"
    )
    assert_usage_error(code, out, err, "--resume: there is no run 'nope'")


def test_config_reads_numbers_the_way_people_write_them(tmp_path, config_file):
    """`lr: 3e-4` is a float and `workers: 1:4` an elastic range (YAML 1.1 would say '3e-4' and 64)."""
    path = config_file("workers: 1:4\nlr: 3e-4\nwarmup_epochs: .5\nglobal_batch_size: 64\nepochs: 10\n")
    values, _ = load_yaml(path)
    assert values == {"workers": "1:4", "lr": 3e-4, "warmup_epochs": 0.5, "global_batch_size": 64, "epochs": 10}
    cfg = TrainConfig.from_dict(values)
    assert (cfg.min_workers, cfg.max_workers, cfg.lr) == (1, 4, 3e-4)


def test_config_file_is_accepted_end_to_end(train, config_file):
    path = config_file("pipeline: digits\nworkers: 1:2\nlr: 3e-4\nglobal_batch_size: 64\n")
    code, out, err = train("--config", path, "--resume", "--name", "nope")
    assert_usage_error(code, out, err, "--resume: there is no run 'nope'")


# -- the installed script: real exit status -------------------------------------------------


needs_script = pytest.mark.skipif(RAYTRAIN is None, reason="the raytrain console script is not installed")


SCRIPT_CASES = [
    (
        ["train", "digits", "--workers", "3:2"],
        "raytrain train: Invalid configuration: --workers: got '3:2'; need 0 <= MIN <= MAX",
    ),
    (["train", "digits", "--config", "missing.yaml"], "raytrain train: --config: file missing.yaml not found"),
    (["train", "digits", "--epochs", "abc"], "raytrain train: error: argument --epochs: invalid int value: 'abc'"),
    (["export", "no_such_run", "-o", "out.pt"], "raytrain export: no_such_run does not exist"),
]


@pytest.mark.slow
@needs_script
def test_script_exit_status(tmp_path):
    """The installed `raytrain` exits 2 with one line on stderr (run side by side: each pays the imports)."""
    runs = [
        subprocess.Popen(
            [str(RAYTRAIN), *args, *(["--storage", str(tmp_path)] if args[0] == "train" else [])],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args, _ in SCRIPT_CASES
    ]
    for run, (args, expected) in zip(runs, SCRIPT_CASES):
        out, err = run.communicate(timeout=120)
        assert run.returncode == 2, (args, out, err)
        assert_usage_error(run.returncode, out, err, expected)
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.slow
def test_configuration_errors_never_start_ray(tmp_path):
    """In a fresh interpreter (no Ray from other tests): every bad input leaves Ray down."""
    # --storage first: a case's own --storage must win, or that case would be a valid run.
    argvs = [["train", "digits", "--storage", str(tmp_path), *args] for args, _ in FLAG_CASES]
    argvs += [
        ["train", "nosuch"],
        ["train", "digits", "--resume", "--name", "nope", "--storage", str(tmp_path)],
        ["train", "digits", "--config", str(tmp_path / "missing.yaml")],
        ["export", str(tmp_path / "missing"), "-o", str(tmp_path / "out.pt")],
    ]
    script = textwrap.dedent(
        """
        import json, sys
        import ray
        from raytrain.cli import main
        results = []
        for argv in json.loads(sys.argv[1]):
            results.append([main(argv), ray.is_initialized()])
        print(json.dumps(results))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(argvs)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert [code for code, _ in results] == [2] * len(argvs)
    assert not any(up for _, up in results)
    assert "Traceback" not in done.stderr


# -- export ----------------------------------------------------------------------------------


def small_model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 3)


def write_checkpoint(run_dir: Path, weights: dict[str, torch.Tensor]) -> Path:
    """A checkpoint as the loop writes it: state.pt (everything) and model.pt (weights)."""
    checkpoint = run_dir / "checkpoint_x"
    checkpoint.mkdir(parents=True)
    state = {
        "model": weights,
        "optimizer": {"state": {}, "param_groups": [{"lr": 1e-3, "params": [0, 1]}]},
        "position": {"epoch": 1, "epoch_offset": 128, "step": 10, "samples_seen": 1565},
    }
    torch.save(state, checkpoint / "state.pt")
    torch.save(weights, checkpoint / "model.pt")
    return checkpoint


@pytest.mark.parametrize("prefix", ["", "module.", "module._orig_mod.", "_orig_mod.module."])
@pytest.mark.parametrize("source", ["checkpoint_dir", "run_dir", "state_file", "model_file"])
def test_export_writes_a_plain_state_dict(capsys, tmp_path, prefix, source):
    model = small_model()
    checkpoint = write_checkpoint(tmp_path / "run", {prefix + k: v for k, v in model.state_dict().items()})
    path = {
        "checkpoint_dir": checkpoint,
        "run_dir": tmp_path / "run",
        "state_file": checkpoint / "state.pt",
        "model_file": checkpoint / "model.pt",
    }[source]
    output = tmp_path / "exported" / "model.pt"
    code, out, err = cli(capsys, "export", str(path), "-o", str(output))
    assert code == 0, err
    assert f"Wrote {output}: 2 tensors" in out
    weights = torch.load(output, weights_only=True)
    assert sorted(weights) == ["bias", "weight"]
    fresh = nn.Linear(4, 3)
    fresh.load_state_dict(weights, strict=True)
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value)


def test_export_prefers_the_latest_checkpoint(capsys, tmp_path):
    run = tmp_path / "run"
    old, new = small_model(), nn.Linear(4, 3)
    write_checkpoint(run, old.state_dict()).rename(run / "checkpoint_000000")
    write_checkpoint(run, new.state_dict()).rename(run / "checkpoint_000001")
    code, _, err = cli(capsys, "export", str(run), "-o", str(tmp_path / "m.pt"))
    assert code == 0, err
    assert torch.equal(torch.load(tmp_path / "m.pt", weights_only=True)["weight"], new.weight.detach())


def test_export_checks_a_runs_weights_against_its_pipeline(capsys, tmp_path, make_config):
    from pipelines.digits.model import DigitsCNN

    run = tmp_path / "run"
    run.mkdir()
    config = {**make_config().to_dict(), "pipeline": "digits", "gpu": False}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    torch.save({"module." + k: v for k, v in DigitsCNN().state_dict().items()}, run / "model.pt")
    code, out, err = cli(capsys, "export", str(run), "-o", str(tmp_path / "digits.pt"), "--pipeline", "digits")
    assert code == 0, err
    assert "checked: loads into digits's model with strict=True" in out
    DigitsCNN().load_state_dict(torch.load(tmp_path / "digits.pt", weights_only=True), strict=True)


def test_export_rejects_weights_of_another_model(capsys, tmp_path, make_config):
    run = tmp_path / "run"
    run.mkdir()
    config = {**make_config().to_dict(), "pipeline": "digits", "gpu": False}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    torch.save(small_model().state_dict(), run / "model.pt")
    code, out, err = cli(capsys, "export", str(run), "-o", str(tmp_path / "out.pt"), "--pipeline", "digits")
    assert_usage_error(code, out, err, f"raytrain export: {run}: weights do not match digits's model")
    assert not (tmp_path / "out.pt").exists()


def test_export_reads_weights_without_importing_the_code_a_run_names(capsys, tmp_path, make_config):
    run = tmp_path / "run"
    run.mkdir()
    planted = tmp_path / "planted.py"
    planted.write_text("raise SystemExit('imported!')\n")
    config = {**make_config().to_dict(), "pipeline": "planted:Anything", "gpu": False}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    torch.save(small_model().state_dict(), run / "model.pt")
    sys.path.insert(0, str(tmp_path))
    try:
        code, out, err = cli(capsys, "export", str(run), "-o", str(tmp_path / "out.pt"))
    finally:
        sys.path.remove(str(tmp_path))
    assert code == 0, err
    assert "planted" not in sys.modules and (tmp_path / "out.pt").exists()


def test_export_onto_a_directory_or_an_unwritable_path_is_named(capsys, tmp_path):
    model = tmp_path / "model.pt"
    torch.save(small_model().state_dict(), model)
    (tmp_path / "outdir").mkdir()
    code, out, err = cli(capsys, "export", str(model), "-o", str(tmp_path / "outdir"))
    assert_usage_error(code, out, err, "is a directory; give a file name")
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a directory should be")
    code, out, err = cli(capsys, "export", str(model), "-o", str(blocker / "sub" / "m.pt"))
    assert_usage_error(code, out, err, "raytrain export: cannot write", "(ENOTDIR)", "part of the path is a file")


def test_export_of_a_missing_path(capsys, tmp_path):
    missing = tmp_path / "no_run"
    code, out, err = cli(capsys, "export", str(missing), "-o", str(tmp_path / "out.pt"))
    assert_usage_error(
        code,
        out,
        err,
        f"raytrain export: {missing} does not exist; give a run directory, a checkpoint directory or a model .pt file",
    )
    assert not (tmp_path / "out.pt").exists()


def test_export_of_a_directory_without_checkpoints(capsys, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, err = cli(capsys, "export", str(empty), "-o", str(tmp_path / "out.pt"))
    assert_usage_error(code, out, err, f"raytrain export: {empty} holds no model.pt and no complete checkpoint")


def test_export_of_a_file_that_is_not_torch(capsys, tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_text("not a torch file")
    code, out, err = cli(capsys, "export", str(junk), "-o", str(tmp_path / "out.pt"))
    assert_usage_error(
        code,
        out,
        err,
        f"raytrain export: {junk} cannot be read as a torch file: it is not a file torch.save wrote",
        "give a state_dict saved with torch.save(model.state_dict(), PATH), or a run or checkpoint directory",
    )


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(2, 2)


def test_export_of_a_whole_pickled_model_says_what_the_file_is_without_torchs_unsafe_advice(capsys, tmp_path):
    pickled, truncated = tmp_path / "whole.pt", tmp_path / "half.pt"
    torch.save(Net(), pickled)  # torch.save(model), not model.state_dict()
    truncated.write_bytes(pickled.read_bytes()[:200])
    code, out, err = cli(capsys, "export", str(pickled), "-o", str(tmp_path / "out.pt"))
    assert_usage_error(
        code,
        out,
        err,
        f"{pickled} cannot be read as a torch file: it holds a pickled Python object (test_cli.Net), not only tensors",
        "torch.save(model.state_dict())",
        "never runs code from a file. If you trust where the file came from, convert it once",
    )
    assert "Re-running `torch.load` with `weights_only` set to `False` will likely succeed" not in err
    code, out, err = cli(capsys, "export", str(truncated), "-o", str(tmp_path / "out.pt"))
    assert_usage_error(code, out, err, f"{truncated} cannot be read as a torch file: it is truncated or damaged")
    assert not (tmp_path / "out.pt").exists()


def test_export_of_a_torch_file_that_is_not_a_state_dict(capsys, tmp_path):
    other = tmp_path / "other.pt"
    torch.save({"weight": [1, 2, 3]}, other)
    code, out, err = cli(capsys, "export", str(other), "-o", str(tmp_path / "out.pt"))
    assert_usage_error(
        code,
        out,
        err,
        f"raytrain export: {other} does not hold a model state_dict",
        "save one with torch.save(model.state_dict(), PATH), or give a run or checkpoint directory",
    )


# -- needs a cluster to decide ---------------------------------------------------------------


@pytest.mark.ray
def test_gpu_on_a_cluster_without_gpus(ray_session, capsys, tmp_path):
    if torch.cuda.is_available() or ray_session.cluster_resources().get("GPU", 0):
        pytest.skip("this machine has GPUs")
    code, out, err = cli(
        capsys, "train", "digits", "--gpu", "--workers", "1", "--name", "gpu-check", "--storage", str(tmp_path)
    )
    assert_usage_error(
        code,
        out,
        err,
        "raytrain train: Invalid configuration: --gpu: was asked for, but the Ray cluster has no GPUs; drop --gpu",
    )
    assert not (tmp_path / "gpu-check").exists()


def test_doctor_with_an_empty_storage_is_refused_not_the_default_checked_instead(capsys):
    code, out, err = cli(capsys, "doctor", "--storage", "")
    assert_usage_error(code, out, err, "raytrain doctor: Invalid configuration: --storage: is empty; give a directory")


@pytest.mark.slow  # a fresh interpreter
def test_the_command_line_is_parsed_before_ray_is_imported():
    """Ray reads RAY_AUTH_MODE when it is imported; a command joining `raytrain up`'s head sets it
    after parsing (driver.head.join_recorded_head), so building the parser must not import Ray."""
    import subprocess
    import sys

    code = "import sys; from raytrain.cli.parser import build_parser; build_parser(); print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
