"""raytrain's train step on one GPU, without Ray: what only a GPU shows, in one short run.

    python benchmarks/gpu_check.py OUT_DIR                       # on a machine with a CUDA GPU
    python benchmarks/gpu_check.py OUT_DIR --device cpu --tiny   # a rehearsal on CPU, in seconds

The step is raytrain's own (`raytrain.worker.step.StepRunner`, built as a worker builds it,
on rank 0 of 1), on the charlm pipeline's transformer. Each part runs in its own try block,
so one failure does not stop the rest, and writes its figures to OUT_DIR/gpu_check.json
(rewritten after every part) and its lines to OUT_DIR/gpu_check.log:

  sync       no hidden host sync in a steady step (torch.cuda.set_sync_debug_mode)
  compile    --compile compiles on rank 0 (Dynamo's graph count), and its speed-up at bf16
  resume     a checkpoint round trip, bf16 resumed under fp16 and back (the gradient scaler)
  oom        out of memory in a step is raytrain's one message (DeviceFailure), with the GPU's
             figures; a device-side assert too (in a child process: it breaks the CUDA context)
  speed      MFU and peak memory at bf16 on a mid-size model, and raytrain's steady samples/s
             against a plain loop on the same model, data and optimizer (target ratio >= 0.97)
  watch      a rank's own compute time is the device's (CUDA events), not its host's: a spin the
             host only queues counts in full; the replicas' fingerprint of the GPU's weights and
             AdamW state equals their CPU copies' and changes with one weight, and its cost
             against a step
  connect    NCCL connects at a group's first collective: with NCCL_SOCKET_IFNAME naming no
             interface here, a one-process group forms and its first one-element all-reduce fails
             (why raytrain's backend start makes one: `raytrain.worker.network.connect_now`), and
             `raytrain.rules.network.host_problems` names the variable first; unset, it passes

Exit status: 0 every part passed, 1 a part failed, 2 no CUDA device (without --device cpu) or an
argument it cannot take (a part it has not, OUT a file), 3 raytrain's step cannot be imported (a
missing module).
Only modules that import no Ray are used (the GPU machine has none); the JSON says whether
Ray got imported anyway (`ray_imported`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # raytrain and its pipelines from this checkout, installed or not

import numpy as np  # noqa: E402
import torch  # noqa: E402

# (width, layers, heads, block, per-step batch): the model of each part, full size and --tiny.
SIZES = {
    "full": {"small": (256, 2, 4, 128, 16), "mid": (1024, 12, 16, 512, 16)},
    "tiny": {"small": (32, 1, 2, 16, 4), "mid": (64, 2, 2, 32, 4)},
}
STEPS = {"full": {"warmup": 5, "timed": 30}, "tiny": {"warmup": 2, "timed": 3}}
TARGET_RATIO = 0.97


class Report:
    """The lines (printed and logged) and the JSON of a check."""

    def __init__(self, out: Path):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.log_file = open(out / "gpu_check.log", "a")
        self.results: dict = {"parts": {}}

    def say(self, line: str) -> None:
        line = f"gpu_check: {line}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def write(self) -> None:
        self.results["ray_imported"] = "ray" in sys.modules
        (self.out / "gpu_check.json").write_text(json.dumps(self.results, indent=2, default=str) + "\n")

    @contextlib.contextmanager
    def part(self, name: str):
        """One part: its figures (the dict yielded), pass or fail, the time it took."""
        figures: dict = {}
        started = time.perf_counter()
        self.say(f"[{name}] start")
        try:
            yield figures
            figures.setdefault("ok", True)
        except Exception as exc:
            figures.update(
                ok=False, error=f"{type(exc).__name__}: {exc}"[:2000], traceback=traceback.format_exc()[-4000:]
            )
        figures["seconds"] = round(time.perf_counter() - started, 2)
        self.results["parts"][name] = figures
        shown = {k: v for k, v in figures.items() if k not in ("traceback",)}
        self.say(f"[{name}] {'PASS' if figures['ok'] else 'FAIL'} {json.dumps(shown, default=str)}")
        self.write()


# -- raytrain's step, as a worker builds it, without Ray ------------------------------------------


class OneDevice:
    """What StepRunner, the strategy and TrainingState ask of a worker's runtime: rank 0 of 1 on
    `device`, no process group (`raytrain.worker.runtime.Runtime` without Ray)."""

    world_rank, world_size, local_rank, nodes, is_rank0 = 0, 1, 0, 1, True
    distributed, backend, counts_flops = False, "none (gpu_check)", True

    def __init__(self, device: torch.device):
        self.device = device

    def prepare_model(self, model, ddp_kwargs):
        return model.to(self.device)

    def all_gather_object(self, value):
        return [value]

    def evaluation_share(self):
        return 0, 1


class Quiet:
    """A heartbeat nobody reads."""

    def mark(self, *args):
        pass


def charlm(size: tuple):
    from pipelines.charlm.model import CharGPT
    from pipelines.charlm.pipeline import CharLMPipeline

    width, layers, heads, block, _ = size

    class CharLM(CharLMPipeline):
        def build_model(self, cfg):
            return CharGPT(block=block, width=width, layers=layers, heads=heads)

    return CharLM()


def windows(size: tuple, steps: int) -> np.ndarray:
    """Token windows (block + 1 bytes) for `steps` steps of the size's batch, random bytes."""
    _, _, _, block, batch = size
    return np.random.default_rng(0).integers(0, 256, size=(batch * steps, block + 1), dtype=np.int64)


def runner_for(pipeline, size: tuple, device: torch.device, rows: int, **options):
    """raytrain's StepRunner for `pipeline` (rank 0 of 1: it counts its FLOPs at its first
    micro-batch), per-worker batch as the size says."""
    from raytrain.config import TrainConfig
    from raytrain.rules.batch import batch_plan_for
    from raytrain.worker.step import StepRunner

    batch = size[4]
    cfg = TrainConfig(
        batch_size_per_worker=batch, reference_batch_size=batch, warmup_epochs=0, epochs=1, workers="1", **options
    )
    return StepRunner.build(pipeline, cfg, OneDevice(device), Quiet(), batch_plan_for(cfg, 1), rows)


class Stepper:
    """Steps of a runner over a table, its position kept."""

    def __init__(self, runner, data: np.ndarray):
        from raytrain.data.table import Table
        from raytrain.rules import steps
        from raytrain.rules.position import Position

        self.runner, self.table = runner, Table({"tokens": data})
        self.steps = steps.epoch_steps(len(self.table), runner.batch_plan.global_batch_size)
        self.epoch = self.table.epoch(0, 0, 0, 0, 1)
        self.position = Position()

    def step(self, count: int = 1) -> None:
        runner, position = self.runner, self.position
        for _ in range(count):
            step = self.steps[position.step % len(self.steps)]
            runner.update_context(position)
            phase = runner.measures.phases(position.step, timed=False)
            runner.gradients(self.epoch, step, phase)
            runner.apply_gradients(position, phase)
            position.step += 1
            position.samples_seen += step.size


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, work, count: int) -> float:
    """Seconds `work(count)` takes, the device synchronized at both ends only."""
    synchronize(device)
    started = time.perf_counter()
    work(count)
    synchronize(device)
    return time.perf_counter() - started


# -- the parts ------------------------------------------------------------------------------------


def check_sync(report: Report, device: torch.device, scale: str) -> None:
    with report.part("sync") as figures:
        if device.type != "cuda":
            figures.update(ok=True, skipped="set_sync_debug_mode needs CUDA")
            return
        size = SIZES[scale]["small"]
        stepper = Stepper(runner_for(charlm(size), size, device, 64 * size[4], precision="bf16"), windows(size, 64))
        stepper.step(3)  # the first step counts FLOPs and measures the state's bytes
        synchronize(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                stepper.step(3)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        # torch's notice that the debug mode is a prototype is no sync (seen on torch 2.11 on an H200)
        syncs = [
            str(w.message).splitlines()[0]
            for w in caught
            if "synchroniz" in str(w.message) and "prototype feature" not in str(w.message)
        ]
        figures.update(syncs_in_3_steps=len(syncs), sync_warnings=syncs[:5])
        if syncs:  # where the first one is: the error mode raises at it, with the Python stack
            torch.cuda.set_sync_debug_mode("error")
            try:
                stepper.step(1)
            except Exception:
                frames = [line for line in traceback.format_exc().splitlines() if line.strip().startswith("File")]
                figures["first_sync_at"] = frames[-6:]
            finally:
                torch.cuda.set_sync_debug_mode(0)
        figures["ok"] = not syncs


def check_compile(report: Report, device: torch.device, scale: str) -> None:
    from torch._dynamo.utils import counters

    with report.part("compile") as figures:
        size, steps = SIZES[scale]["mid"], STEPS[scale]
        data = windows(size, steps["warmup"] + steps["timed"])
        rates = {}
        for compiled in (False, True):
            torch._dynamo.reset()
            counters.clear()
            runner = runner_for(charlm(size), size, device, len(data), precision="bf16", compile=compiled)
            stepper = Stepper(runner, data)
            figures[f"first_steps_s_{'compiled' if compiled else 'eager'}"] = round(
                timed(device, stepper.step, steps["warmup"]), 2
            )
            seconds = timed(device, stepper.step, steps["timed"])
            rates[compiled] = steps["timed"] * size[4] / seconds
            if compiled:
                figures["graphs"] = int(counters["stats"]["unique_graphs"])
                figures["flops_per_sample_counted"] = runner.measures.telemetry.flops_per_sample
        figures.update(
            samples_per_s_eager=round(rates[False], 1),
            samples_per_s_compiled=round(rates[True], 1),
            speedup=round(rates[True] / rates[False], 3),
        )
        torch._dynamo.reset()
        figures["ok"] = figures["graphs"] > 0 and figures["flops_per_sample_counted"] > 0


def check_resume(report: Report, device: torch.device, scale: str) -> None:
    from raytrain.rules.position import Position

    with report.part("resume") as figures:
        size = SIZES[scale]["small"]
        data = windows(size, 8)
        where = Path(tempfile.mkdtemp(prefix="gpu_check-"))
        try:
            trained = {}
            for first, then in (("bf16", "fp16"), ("fp16", "bf16")):
                source = Stepper(runner_for(charlm(size), size, device, len(data), precision=first), data)
                source.step(3)
                state = source.runner.training_state(Position(step=3))
                directory = where / f"{first}-to-{then}"
                state.save(directory, OneDevice(device), {}, distributed=False).wait()
                target = Stepper(runner_for(charlm(size), size, device, len(data), precision=then, seed=1), data)
                target.runner.training_state(Position()).load(
                    directory, OneDevice(device), seed=0, distributed=False, load_optimizer=lambda load: load()
                )
                same = all(
                    torch.equal(a, b)
                    for a, b in zip(
                        source.runner.model.state_dict().values(), target.runner.model.state_dict().values()
                    )
                )
                target.step(2)  # it trains on under the other precision
                finite = all(torch.isfinite(p).all().item() for p in target.runner.model.parameters())
                trained[f"{first}->{then}"] = {
                    "weights_equal": same,
                    "finite_after_2_steps": finite,
                    "scale": target.runner.scaler.get_scale() if target.runner.scaler.is_enabled() else None,
                }
            figures["switches"] = trained
            figures["ok"] = all(r["weights_equal"] and r["finite_after_2_steps"] for r in trained.values())
        finally:
            shutil.rmtree(where, ignore_errors=True)


def hogging(size: tuple, nbytes: int):
    base = type(charlm(size))

    class Hogs(base):
        def compute_loss(self, model, batch):
            torch.empty(nbytes, dtype=torch.uint8, device=batch["tokens"].device)
            return super().compute_loss(model, batch)

    return Hogs()


def out_of_memory(stepper: Stepper) -> dict:
    """The DeviceFailure a step raised (its message and checks), or what else it raised."""
    from raytrain.errors import find_user_error
    from raytrain.parallel.device import DeviceFailure

    try:
        stepper.step(1)
    except DeviceFailure as failure:
        message = str(failure)
        ways = all(w in message for w in ("--batch-size-per-worker", "--strategy fsdp", "--activation-checkpointing"))
        return {
            "classified": True,
            "message": message[:600],
            "names_rank_and_host": message.startswith("out of memory on rank 0 ("),
            "ways_out": ways,
            "gpu_figures": "GiB allocated" in message,
            "not_retried": find_user_error(failure) is failure,
        }
    except Exception as exc:
        return {"classified": False, "raised": f"{type(exc).__name__}: {exc}"[:600]}
    return {"classified": False, "raised": None}


def check_oom(report: Report, device: torch.device, scale: str) -> None:
    with report.part("oom") as figures:
        size = SIZES[scale]["small"]
        data = windows(size, 4)
        if device.type == "cuda":
            too_much = 2 * torch.cuda.get_device_properties(device).total_memory
        else:
            too_much = 1 << 50  # a petabyte: the CPU allocator refuses it
        hog = Stepper(runner_for(hogging(size, too_much), size, device, len(data)), data)
        figures["past_the_device"] = past = out_of_memory(hog)
        needed = ("classified", "names_rank_and_host", "ways_out", "not_retried")
        ok = all(past.get(k) for k in needed) and (device.type != "cuda" or past.get("gpu_figures"))
        if device.type == "cuda":  # a real step's own tensors past a small share of the GPU
            mid = SIZES[scale]["mid"]
            big = (mid[0], mid[1], mid[2], mid[3], 256)
            fraction = 2 * 2**30 / torch.cuda.get_device_properties(device).total_memory
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(fraction, device)
            try:
                stepper = Stepper(runner_for(charlm(big), big, device, 256, precision="bf16"), windows(big, 1))
                figures["in_a_step_at_2_gib"] = natural = out_of_memory(stepper)
                del stepper
            except Exception as exc:  # out of memory building the model: say so
                figures["in_a_step_at_2_gib"] = natural = {
                    "classified": False,
                    "raised": f"{type(exc).__name__}: {exc}",
                }
            finally:
                torch.cuda.set_per_process_memory_fraction(1.0, device)
                torch.cuda.empty_cache()
            ok = ok and natural.get("classified", False)
            torch.ones(1, device=device).sum().item()  # the device still works
        figures["device_assert"] = assertion = device_assert_in_child(report.out, device, scale)
        figures["ok"] = ok and assertion.get("classified", False)


def device_assert_in_child(out: Path, device: torch.device, scale: str) -> dict:
    """A device-side assert (an embedding index past the vocabulary) in a child process: the CUDA
    context is unusable after one."""
    command = [sys.executable, __file__, str(out), "--device", device.type, "--child-assert"]
    command += ["--tiny"] if scale == "tiny" else []
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"classified": False, "child_exit": done.returncode, "stderr": done.stderr[-2000:]}
    return json.loads(lines[-1])


def child_assert(device: torch.device, scale: str) -> None:
    from raytrain.parallel.device import DEVICE_ASSERT, DeviceFailure

    size = SIZES[scale]["small"]
    base = type(charlm(size))

    class OutOfVocabulary(base):
        def compute_loss(self, model, batch):
            if device.type != "cuda":  # a CPU raises IndexError: what CUDA raises, as a rehearsal
                raise torch.AcceleratorError(f"CUDA error: {DEVICE_ASSERT}")
            return super().compute_loss(model, {"tokens": batch["tokens"] + 1000})

    data = windows(size, 4)
    stepper = Stepper(runner_for(OutOfVocabulary(), size, device, len(data)), data)
    result: dict = {"classified": False}
    try:
        stepper.step(3)  # the assert shows at the host's next wait on the GPU
        synchronize(device)
        result["raised"] = None
    except DeviceFailure as failure:
        result = {"classified": "CUDA_LAUNCH_BLOCKING=1" in str(failure), "message": str(failure)[:600]}
    except Exception as exc:
        result["raised"] = f"{type(exc).__name__}: {exc}"[:600]
    print(json.dumps(result), flush=True)


def plain_loop(pipeline, size: tuple, device: torch.device, data: np.ndarray, cfg):
    """The hand-written loop on the same model, data and optimizer: copy, autocast forward,
    backward, step. Returns a function taking `count` steps."""
    from raytrain import hooks

    torch.manual_seed(cfg.seed)
    model = pipeline.build_model(cfg).to(device)
    optimizer = hooks.call(pipeline, "build_optimizer", model, cfg)
    batch, taken = size[4], [0]

    def steps(count: int) -> None:
        for _ in range(count):
            lo = (taken[0] * batch) % len(data)
            tokens = torch.from_numpy(data[lo : lo + batch]).to(device, non_blocking=True)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                loss, _ = pipeline.compute_loss(model, {"tokens": tokens})
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            taken[0] += 1

    return steps


def check_speed(report: Report, device: torch.device, scale: str) -> None:
    from raytrain.parallel.device import peak_memory_bytes
    from raytrain.rules.flops import cost_view

    with report.part("speed") as figures:
        size, steps = SIZES[scale]["mid"], STEPS[scale]
        data = windows(size, steps["warmup"] + steps["timed"])
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        runner = runner_for(charlm(size), size, device, len(data), precision="bf16")
        stepper = Stepper(runner, data)
        plain = plain_loop(charlm(size), size, device, data, runner.cfg)
        stepper.step(steps["warmup"])
        plain(steps["warmup"])
        rates: dict[str, list[float]] = {"raytrain": [], "plain": []}
        for _ in range(2):  # interleaved rounds, the best of each: clocks and neighbours vary
            for name, work in (("plain", plain), ("raytrain", stepper.step)):
                rates[name].append(steps["timed"] * size[4] / timed(device, work, steps["timed"]))
        best = {name: max(values) for name, values in rates.items()}
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        cost = cost_view(runner.measures.telemetry.flops_per_sample, best["raytrain"], 1, name, "bf16")
        peak = peak_memory_bytes(device)
        figures.update(
            model=dict(zip(("width", "layers", "heads", "block", "batch"), size)),
            parameters=sum(p.numel() for p in runner.model.parameters()),
            samples_per_s=best["raytrain"],
            samples_per_s_plain=best["plain"],
            ratio=round(best["raytrain"] / best["plain"], 4),
            target_ratio=TARGET_RATIO,
            rounds=rates,
            flops_per_sample=runner.measures.telemetry.flops_per_sample,
            achieved_tflops=cost and round(cost["achieved_tflops_per_worker"], 2),
            mfu=cost and cost["mfu"],
            peak_memory_gib=None if peak is None else round(peak / 2**30, 2),
        )
        figures["ok"] = figures["ratio"] >= TARGET_RATIO if device.type == "cuda" else True


SPIN_CYCLES = 50_000_000  # torch.cuda._sleep's spin: about 25 ms at 2 GHz


def check_watch(report: Report, device: torch.device, scale: str) -> None:
    from raytrain.instruments.agreement import fingerprint, held_tensors
    from raytrain.instruments.phases import PhaseTimer, StepPhases

    with report.part("watch") as figures:
        size = SIZES[scale]["mid"]
        stepper = Stepper(runner_for(charlm(size), size, device, 8 * size[4], precision="bf16"), windows(size, 8))
        runner = stepper.runner
        stepper.step(2)
        own = runner.measures.own
        own.take()
        step_s = timed(device, stepper.step, 3) / 3
        compute_s = own.take().compute_s / 3  # forward and optimizer: less than the whole step
        figures.update(step_ms=round(step_s * 1e3, 2), own_compute_ms_per_step=round(compute_s * 1e3, 2))
        checks = [0 < compute_s < step_s]
        if device.type == "cuda":  # a device slower than its host: a spin of kernels the host only queues
            synchronize(device)
            started = time.perf_counter()
            torch.cuda._sleep(SPIN_CYCLES)
            synchronize(device)
            spin_s = time.perf_counter() - started
            phases = StepPhases(Quiet(), 0, PhaseTimer(None, lambda: None), own)
            started = time.perf_counter()
            with phases.forward:
                torch.cuda._sleep(SPIN_CYCLES)
            host_s = time.perf_counter() - started
            counted_s = own.take().compute_s
            figures.update(spin_ms=round(spin_s * 1e3, 2), spin_counted_ms=round(counted_s * 1e3, 2))
            figures["spin_host_ms"] = round(host_s * 1e3, 3)
            checks.append(0.8 * spin_s <= counted_s <= 1.2 * spin_s and host_s < 0.5 * counted_s)
        held = held_tensors(runner.model, runner.optimizer)
        synchronize(device)
        started = time.perf_counter()
        mine = fingerprint(held)
        fingerprint_s = time.perf_counter() - started
        same_on_cpu = fingerprint([t.detach().cpu() for t in held]) == mine
        weight = next(runner.model.parameters())
        with torch.no_grad():
            weight.view(-1)[0] += 1.0
        changed = fingerprint(held_tensors(runner.model, runner.optimizer)) != mine
        figures.update(
            fingerprint_ms=round(fingerprint_s * 1e3, 3),
            fingerprint_over_step=round(fingerprint_s / step_s, 4),
            fingerprint_same_on_cpu=same_on_cpu,
            fingerprint_changed_by_one_weight=changed,
            tensors_fingerprinted=len(held),
        )
        figures["ok"] = all(checks) and same_on_cpu and changed


def check_connect(report: Report, device: torch.device, scale: str) -> None:
    import socket

    from raytrain.rules.network import host_problems

    with report.part("connect") as figures:
        # On a CPU (a rehearsal), gloo: it fails as the group forms, at init.
        variable = "NCCL_SOCKET_IFNAME" if device.type == "cuda" else "GLOO_SOCKET_IFNAME"
        names = {name: [] for _, name in socket.if_nameindex()}
        figures["named_first"] = bool(host_problems({variable: "nosuch0"}, socket.gethostname(), names))
        figures["unset"] = group_in_child(report.out, device, {})
        figures["nosuch0"] = bad = group_in_child(report.out, device, {variable: "nosuch0"})
        lazy = bad.get("failed_at") == ("all_reduce" if device.type == "cuda" else "init")
        figures["ok"] = figures["named_first"] and figures["unset"].get("sum") == 1.0 and lazy


def group_in_child(out: Path, device: torch.device, env: dict) -> dict:
    """A one-process group and its first one-element all-reduce, in a child process with `env`:
    where it failed (init or all_reduce), or the sum."""
    command = [sys.executable, __file__, str(out), "--device", device.type, "--child-group"]
    env = {**{k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}, **env}
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {"child_exit": done.returncode, "stderr": done.stderr[-2000:]}


def child_group(out: Path, device: torch.device) -> None:
    import torch.distributed as dist

    result: dict = {"failed_at": "init"}
    path = out / "connect_store"
    path.unlink(missing_ok=True)
    try:
        store = dist.FileStore(str(path), 1)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1)
        result["failed_at"] = "all_reduce"
        one = torch.ones(1, dtype=torch.float64, device=device)
        dist.all_reduce(one)
        result = {"failed_at": None, "sum": one.item()}
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"[:600]
    print(json.dumps(result), flush=True)


PARTS = {
    "sync": check_sync,
    "compile": check_compile,
    "resume": check_resume,
    "oom": check_oom,
    "speed": check_speed,
    "watch": check_watch,
    "connect": check_connect,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="where gpu_check.json and gpu_check.log go (e.g. $OUT)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a rehearsal")
    parser.add_argument("--tiny", action="store_true", help="small models and few steps (a rehearsal)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--child-assert", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-group", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [name for name in args.parts.split(",") if name not in PARTS]
    if unknown:
        parser.error(
            f"--parts: no part {', '.join(map(repr, unknown))}; choose among {', '.join(PARTS)}, comma-separated"
        )
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"OUT {args.out} is a file; give a directory (made if missing)")
    scale = "tiny" if args.tiny else "full"
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    if args.child_assert:
        child_assert(device, scale)
        return 0
    if args.child_group:
        child_group(args.out, device)
        return 0
    report = Report(args.out)
    cuda = torch.cuda.is_available()
    report.results.update(
        torch=torch.__version__, cuda=torch.version.cuda, cuda_available=cuda, device=str(device), scale=scale
    )
    if args.device == "cuda" and not cuda:
        report.say(f"no CUDA device (torch {torch.__version__}, cuda available {cuda}); stopping")
        report.results["stopped"] = "no CUDA device"
        report.write()
        return 2
    if device.type == "cuda":
        report.results.update(
            device_name=torch.cuda.get_device_name(device), bf16_supported=torch.cuda.is_bf16_supported()
        )
    try:  # raytrain's step and its one dependency beyond torch and numpy (yaml, for the run files)
        import raytrain.worker.step  # noqa: F401
    except ImportError as exc:
        report.say(f"cannot import raytrain's step: {exc} (install it, e.g. pip install pyyaml); stopping")
        report.results["stopped"] = str(exc)
        report.write()
        return 3
    report.say(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device {device}, {scale} sizes")
    started = time.perf_counter()
    for name in args.parts.split(","):
        PARTS[name](report, device, scale)
    report.results["seconds"] = round(time.perf_counter() - started, 1)
    failed = [name for name, part in report.results["parts"].items() if not part["ok"]]
    report.say(f"{'FAILED: ' + ', '.join(failed) if failed else 'all parts passed'} in {report.results['seconds']} s")
    report.write()
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(REPO))  # the child process of the assert part
    sys.exit(main())
