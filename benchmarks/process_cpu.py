"""The CPU time every process on the machine spent while a command ran, summed by process name.

    python benchmarks/process_cpu.py [--after-s 10] -- COMMAND...
    python benchmarks/process_cpu.py -- python -m pytest -q tests/test_train_ray.py -k local_mode

Polls every process each 0.25 s while COMMAND runs (and `--after-s` seconds more, for what a
run leaves to finish); a process that existed before counts from its first sight, a new one
from its start. Ray's processes are named by what they run (`ray::TrainController`,
`ray::RayTrainWorker`, `ray::IDLE`...). Prints the 30 largest sums: where the CPU of a run goes,
which on a small machine is where its wall time goes. A process that lives less than one poll
is missed.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import time

import psutil


def name_of(process: psutil.Process) -> str:
    name = process.name()
    if name.startswith("python"):
        return " ".join(process.cmdline()[:4])[-90:]
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--after-s", type=float, default=10.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    first: dict[int, float] = {}
    last: dict[int, tuple[float, str]] = {}
    me = psutil.Process().pid

    def poll(existing: bool) -> None:
        for process in psutil.process_iter():
            try:
                times = process.cpu_times()
                cpu = times.user + times.system
                last[process.pid] = (cpu, name_of(process))
                first.setdefault(process.pid, cpu if existing else 0.0)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass

    poll(existing=True)
    started = time.monotonic()
    child = subprocess.Popen(command)
    while child.poll() is None:
        poll(existing=False)
        time.sleep(0.25)
    wall_s = time.monotonic() - started
    end = time.monotonic() + args.after_s
    while time.monotonic() < end:
        poll(existing=False)
        time.sleep(0.25)
    sums: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter[str] = collections.Counter()
    for pid, (cpu, name) in last.items():
        spent = cpu - first[pid]
        if pid != me and spent > 0.05:
            sums[name] += spent
            counts[name] += 1
    for name, spent in sorted(sums.items(), key=lambda kv: -kv[1])[:30]:
        print(f"{spent:8.1f} s  x{counts[name]:<3} {name}")
    print(f"total {sum(sums.values()):.1f} CPU s over {wall_s:.1f} s of the command (exit status {child.returncode})")


if __name__ == "__main__":
    main()
