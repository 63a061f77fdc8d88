"""Which host a process runs on, for deciding whether its pid can be checked from here.

A hostname does not tell hosts apart: containers, images cloned from one another and network
namespaces on one machine (raytrain's own test hosts) can all share it, and those last also share
the file system, /etc/machine-id and the boot id. `host_id` adds what differs between them: the
boot id (one per boot of a real machine, even of a cloned image) and the inodes of this process's
network and pid namespaces (one per container or network namespace on a machine).
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket

BOOT_ID = "/proc/sys/kernel/random/boot_id"
NAMESPACES = ("/proc/self/ns/net", "/proc/self/ns/pid")


@functools.cache  # a process never changes its pid or network namespace, nor its machine's boot
def host_id() -> str:
    """A short hex identity of the place where this process's pid can be checked: equal for two
    processes only when they share hostname, boot and network and pid namespaces. Where /proc is
    missing (macOS) it rests on what exists: the hostname alone."""
    return identity(socket.gethostname(), _read(BOOT_ID), [_inode(path) for path in NAMESPACES])


def identity(hostname: str, boot_id: str | None, namespaces: list[int | None]) -> str:
    parts = [hostname, boot_id or "", *(str(inode) if inode is not None else "" for inode in namespaces)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _read(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return None


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None
