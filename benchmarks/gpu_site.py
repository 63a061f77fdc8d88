"""Install into SITE, from the folder scripts/gpu_wheels.sh prepared, only what this Python lacks
for Ray and raytrain: no network, no resolver download. Used by benchmarks/gpu_check.sh.

    python benchmarks/gpu_site.py WHEELS_DIR SITE      # SITE comes first on this Python's path

Ray's stripped tree (ray-*.tar.xz) is unpacked into SITE. Then, from the roots
(`ray[default,train,tune,data]` and raytrain's requirements in pyproject.toml, torch aside, and
each wheel manifest.txt calls needed: one the machine lacks), every
requirement is followed through the installed distributions' metadata; one that is missing or
whose version fails its bound is installed from a carried wheel that meets it (`pip install
--no-index --no-deps --target SITE`), and the walk starts again until nothing changes. What
remains unmet is printed, one line each; what scripts/gpu_wheels.sh skipped on purpose
(manifest.txt) is named as such. Exit status: 0 all met but the skipped ones, 1 some unmet.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import tarfile
import time
import zipfile
from email import message_from_bytes
from importlib import metadata
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:  # pip's own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
    from pip._vendor.packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
ROUNDS = 20


def say(line: str) -> None:
    print(f"gpu-check: install: {line}", flush=True)


def roots() -> list[str]:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    ray = next(req for req in project["dependencies"] if canonicalize_name(Requirement(req).name) == "ray")
    return [ray, *(req for req in project["dependencies"] if canonicalize_name(Requirement(req).name) != "ray")]


def installed(name: str) -> metadata.Distribution | None:
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None


class Picked:
    """A carried wheel chosen for installing: its version and requirements, from its METADATA."""

    def __init__(self, wheel: Path):
        self.wheel = wheel
        with zipfile.ZipFile(wheel) as archive:
            name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
            meta = message_from_bytes(archive.read(name))
        self.version = meta["Version"]
        self.requires = meta.get_all("Requires-Dist") or []


def unmet(requirements: list[str], picked: dict[str, Picked]) -> dict[str, tuple[Requirement, str | None]]:
    """Every requirement reachable from `requirements` that neither the path nor the wheels picked
    so far meet: name -> (the requirement, the version found or None). Torch is the machine's own:
    not followed."""
    importlib.invalidate_caches()
    missing: dict[str, tuple[Requirement, str | None]] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    queue = [(Requirement(req), frozenset({""})) for req in requirements]
    while queue:
        req, parent_extras = queue.pop()
        if req.marker is not None and not any(req.marker.evaluate({"extra": extra}) for extra in parent_extras):
            continue
        name = canonicalize_name(req.name)
        if name == "torch":
            continue
        dist = picked.get(name) or installed(name)
        version = dist.version if dist is not None else None
        if version is None or not _meets(req, version):
            missing.setdefault(name, (req, version))
            continue
        key = (name, frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        extras = frozenset({"", *req.extras})
        queue.extend((Requirement(child), extras) for child in dist.requires or [])
    return missing


def install(wheels: list[Path], site: Path) -> None:
    """pip's --no-deps --target install; without pip, the wheels unzipped (their purelib/platlib
    files: all that these wheels hold besides metadata)."""
    try:
        import pip  # noqa: F401
    except ImportError:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(site)
        return
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
         "--disable-pip-version-check", "--upgrade", "--target", str(site), *map(str, wheels)],
        check=True,
    )  # fmt: skip


def _meets(req: Requirement, version: str) -> bool:
    try:
        return req.specifier.contains(Version(version), prereleases=True)
    except ValueError:  # not a PEP 440 version: taken as it is
        return True


def main() -> int:
    wheels_dir, site = Path(sys.argv[1]), Path(sys.argv[2])
    site.mkdir(parents=True, exist_ok=True)
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    started = time.monotonic()
    manifest = wheels_dir / "manifest.txt"
    skipped, needed = set(), []
    if manifest.exists():
        for line in manifest.read_text().splitlines():
            if line.startswith("# skipped:"):
                skipped = {canonicalize_name(name) for name in line.split(":", 1)[1].split()}
            elif line.startswith("needed "):  # what the machine lacks: a root too, reached or not
                needed.append(str(parse_wheel_filename(line.split()[-1])[0]))
    # (opencensus imports googleapis-common-protos' google.rpc, which its metadata reaches only
    # through google-api-core, left out.)
    wanted = roots() + needed

    for tarball in sorted(wheels_dir.glob("ray-*.tar.xz")):
        if not (site / "ray" / "__init__.py").exists():
            with tarfile.open(tarball) as tar:  # modes kept: gcs_server and raylet are executables
                if hasattr(tarfile, "fully_trusted_filter"):
                    tar.extractall(site, filter="fully_trusted")
                else:
                    tar.extractall(site)
            say(f"unpacked {tarball.name} in {time.monotonic() - started:.1f} s")

    carried: dict[str, list[tuple[Version, Path]]] = {}
    for wheel in wheels_dir.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        carried.setdefault(canonicalize_name(name), []).append((version, wheel))

    # Pick wheels until every requirement is met, following each pick's own requirements (its
    # METADATA); then install them in one pip call: pip --target replaces a top-level folder as a
    # whole, so a namespace package split over wheels (opentelemetry) must come in one batch.
    picked: dict[str, Picked] = {}
    for _ in range(ROUNDS):
        missing = unmet(wanted, picked)
        new = {}
        for name, (req, have) in sorted(missing.items()):
            fits = [(v, w) for v, w in carried.get(name, []) if req.specifier.contains(v, prereleases=True)]
            if fits and name not in picked:
                new[name] = Picked(max(fits)[1])
                reason = "missing" if have is None else f"{have} fails {req.specifier}"
                say(f"{new[name].wheel.name} ({reason})")
        if not new:
            break
        picked.update(new)
    if picked:
        install([p.wheel for p in picked.values()], site)
    missing = unmet(wanted, {})
    bad = 0
    for name, (req, have) in sorted(missing.items()):
        found = "missing" if have is None else f"{have} found"
        if name in skipped:
            say(f"left out on purpose: {req} ({found}; scripts/gpu_wheels.sh)")
        else:
            bad += 1
            say(f"UNMET: {req} ({found}, and no carried wheel meets it)")
    say(f"{len(picked)} distributions installed into {site} in {time.monotonic() - started:.1f} s; {bad} unmet")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
