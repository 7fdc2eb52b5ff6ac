"""A prefill and a decode node as real processes plus a router, for the P/D tests."""

from __future__ import annotations

import argparse
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kvbridge.worker.engine import Engine, EngineConfig
from kvbridge.worker.serving import EngineClient, Router, node_process


def node_args(**overrides: Any) -> argparse.Namespace:
    """``kvbridge serve``'s engine flags as :func:`start_node` takes them (tiny model)."""
    base: dict[str, Any] = dict(
        model="tiny",
        order="block-nhd",
        block_size=16,
        num_blocks=256,
        seed=0,
        on_load_error="recompute",
        startup_timeout=90.0,
        share_last=None,
        share_every=None,
        prefill_skip=False,
        encoder_decoder=False,
        decode_order=None,
    )
    base.update(overrides)
    return argparse.Namespace(**base)


class NodePair:
    """A prefill and a decode node (orders default to ``args``') plus a router; ``close``
    stops both processes."""

    def __init__(
        self,
        tmp: Path,
        args: argparse.Namespace,
        prefill_order: str | None = None,
        decode_order: str | None = None,
        prefill_extra: list[str] | None = None,
        decode_extra: list[str] | None = None,
    ) -> None:
        self.args = args
        self._stack = ExitStack()
        try:
            # both start at once (each imports torch and NIXL: seconds of CPU apiece)
            procs = {
                "prefill": node_process(
                    "prefill", args, prefill_order or args.order, tmp, None, prefill_extra
                ),
                "decode": node_process(
                    "decode",
                    args,
                    decode_order or args.decode_order or args.order,
                    tmp,
                    None,
                    decode_extra,
                ),
            }
            for proc in procs.values():
                self._stack.callback(proc.close)
            self.prefill_proc, self.decode_proc = procs["prefill"], procs["decode"]
            self.info = {name: proc.wait_ready() for name, proc in procs.items()}
            """Each node's ready info (``inference``, ``control``, ``metrics`` with
            ``--metrics-port``)."""
            self.prefill = EngineClient(self.info["prefill"]["inference"], timeout_s=60)
            self._stack.callback(self.prefill.close)
            self.decode = EngineClient(self.info["decode"]["inference"], timeout_s=60)
            self._stack.callback(self.decode.close)
        except BaseException:
            self._stack.close()
            raise
        self.router = Router(self.prefill, self.decode)

    def close(self) -> None:
        self._stack.close()


def reference(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy outputs of one in-process tiny engine: what every P/D run must produce."""
    import torch

    torch.set_num_threads(1)
    engine = Engine(EngineConfig.preset("tiny", num_blocks=256))
    return [engine.generate([p], max_tokens)[0] for p in prompts]
