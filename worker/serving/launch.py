"""Start kvbridge's serving processes as children: a node (``kvbridge serve``) and an
offload daemon (``kvbridge offload serve``), each a :class:`~kvbridge.worker.ChildProcess`
that is ready once it prints its addresses. Used by ``demo``, tests and examples."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvbridge.worker.child import ChildProcess, json_object, listening_on
from kvbridge.worker.serving.node_cmd import engine_model_flags

__all__ = [
    "OffloadDaemonProcess",
    "node_command",
    "node_process",
    "start_node",
    "start_offload_daemon",
]


def node_command(
    name: str, args: argparse.Namespace, order: str, role: str, extra: Sequence[str] = ()
) -> list[str]:
    """``kvbridge serve`` for a node with ``args``' model and engine flags."""
    return [
        sys.executable,
        "-m",
        "kvbridge.worker.cli",
        "serve",
        "--role",
        role,
        "--engine-id",
        f"{name}-{os.getpid()}",
        "--model",
        args.model,
        "--order",
        order,
        "--block-size",
        str(args.block_size),
        "--num-blocks",
        str(args.num_blocks),
        "--seed",
        str(args.seed),
        "--on-load-error",
        args.on_load_error,
        *engine_model_flags(args),
        *extra,
    ]


def node_process(
    name: str,
    args: argparse.Namespace,
    order: str,
    workdir: Path,
    core: int | None,
    extra: list[str] | None = None,
    *,
    role: str | None = None,
    token: str | None = None,
) -> ChildProcess:
    """Start ``kvbridge serve --role ROLE`` (ROLE defaults to ``name``; log in
    ``workdir/NAME.log``) without waiting for it: its ``wait_ready()`` (or ``with``) gives
    its ready info (``inference``, ``control``, ``engine_id``), so several nodes start at
    once. ``token`` reaches the node as ``$KVBRIDGE_TOKEN`` (not on its command line, where
    ``ps`` would show it)."""
    role = role or name
    env = {"OMP_NUM_THREADS": "1"}
    if token is not None:
        env["KVBRIDGE_TOKEN"] = token
    return ChildProcess(
        node_command(name, args, order, role, extra or []),
        name=f"{role} node {name}",
        ready=json_object,
        env=env,
        log=workdir / f"{name}.log",
        core=core,
        ready_timeout_s=args.startup_timeout,
    )


@contextmanager
def start_node(
    name: str,
    args: argparse.Namespace,
    order: str,
    workdir: Path,
    core: int | None,
    extra: list[str] | None = None,
    *,
    role: str | None = None,
    token: str | None = None,
) -> Iterator[tuple[ChildProcess, dict[str, str]]]:
    """:func:`node_process`, then yield (process, its ready info) once it serves; always
    stops it."""
    with node_process(name, args, order, workdir, core, extra, role=role, token=token) as proc:
        assert proc.info is not None
        yield proc, proc.info


@dataclass(frozen=True, slots=True)
class OffloadDaemonProcess:
    """A ``kvbridge offload serve`` child process started by :func:`start_offload_daemon`."""

    address: str
    proc: ChildProcess

    def kill(self) -> None:
        """End it abruptly (tests: a daemon that dies under its clients)."""
        self.proc.kill()


@contextmanager
def start_offload_daemon(
    workdir: Path,
    timeout_s: float,
    capacity: str = "256MiB",
    port: int = 0,
    extra: Sequence[str] = (),
) -> Iterator[OffloadDaemonProcess]:
    """Start ``kvbridge offload serve`` on loopback (``port`` 0: any free one; log in
    ``workdir/offload.log``; ``extra`` flags, e.g. ``--disk``); yield it once it listens;
    always stop it."""
    cmd = [sys.executable, "-m", "kvbridge.worker.cli", "offload", "serve"]
    with ChildProcess(
        [*cmd, "--capacity", capacity, "--port", str(port), *extra],
        name="offload daemon",
        ready=listening_on,
        log=workdir / "offload.log",
        ready_timeout_s=timeout_s,
    ) as proc:
        yield OffloadDaemonProcess(proc.wait_ready()["address"], proc)
