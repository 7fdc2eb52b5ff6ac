"""kvbridge's own processes: the serving node, the offload daemon, the reference engine,
benchmarks and the command line. :class:`ChildProcess` is how any of them (and tests,
examples) start another and wait until it is ready."""

from kvbridge.worker.child import (
    ChildProcess,
    LaunchError,
    json_object,
    listening_on,
    ready_prefix,
)

__all__ = ["ChildProcess", "LaunchError", "json_object", "listening_on", "ready_prefix"]
