"""P/D end to end for KV-sharing and encoder-decoder models: real node processes, NIXL, gRPC.

Decode outputs must equal single-process runs; the bytes moved must be the
owning layers' bytes only; a repeated encoder input moves no cross block; no
block of either group and no lease is left behind, also when prefill dies.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import torch

from kvbridge.proto import codec
from kvbridge.worker.engine import Engine
from kvbridge.worker.serving.demo import (
    check_no_leaks,
    make_encoder_inputs,
    make_workload,
    start_node,
)
from kvbridge.worker.serving.node_cmd import engine_config_from_args
from kvbridge.worker.serving.router import EngineClient, Router

pytestmark = pytest.mark.slow

MAX_TOKENS = 5
PROMPTS = make_workload(4, 2, 512, 16, seed=3)
ENCODER_INPUTS = make_encoder_inputs(4, 2, 512, seed=3)  # clips A B A B


def node_args(**overrides: Any) -> argparse.Namespace:
    base: dict[str, Any] = dict(
        model="tiny",
        order="block-nhd",
        block_size=16,
        num_blocks=128,
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


class Pair:
    """A prefill and a decode node of the same model plus a router; ``close`` stops both."""

    def __init__(self, tmp: Path, args: argparse.Namespace) -> None:
        self.args = args
        self._stack = ExitStack()
        self.prefill_proc, pinfo = self._stack.enter_context(
            start_node("prefill", args, args.order, tmp, None)
        )
        _, dinfo = self._stack.enter_context(
            start_node("decode", args, args.decode_order or args.order, tmp, None)
        )
        self.prefill = EngineClient(pinfo["inference"], timeout_s=60)
        self.decode = EngineClient(dinfo["inference"], timeout_s=60)
        self.router = Router(self.prefill, self.decode)

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()
        self._stack.close()


def reference(args: argparse.Namespace, encs: list[bytes | None]) -> list[list[int]]:
    engine = Engine(engine_config_from_args(args))  # type: ignore[arg-type]
    return [engine.generate([p], MAX_TOKENS, [e])[0] for p, e in zip(PROMPTS, encs, strict=True)]


# each pair runs one order on prefill and another on decode, so every model is exercised in a
# block-outermost and a layer-separate layout (and encdec once through REARRANGE staging)
CASES = [
    pytest.param(
        {"share_last": 2, "prefill_skip": True, "decode_order": "layer-nhd"},
        id="share_last-skip-block-to-layer",
    ),
    pytest.param(
        {"share_every": 2, "prefill_skip": True, "order": "layer-nhd", "decode_order": "block-nhd"},
        id="share_every-skip-layer-to-block",
    ),
    pytest.param(
        {"encoder_decoder": True, "decode_order": "layer-nhd"}, id="encdec-block-to-layer"
    ),
    pytest.param(
        {"encoder_decoder": True, "order": "layer-hnd", "decode_order": "block-nhd"},
        id="encdec-layer-hnd-to-block-rearrange",
    ),
]


@pytest.mark.parametrize("overrides", CASES)
def test_decode_matches_a_single_process_run_and_moves_owning_layers_only(
    tmp_path: Path, overrides: dict[str, Any]
) -> None:
    args = node_args(**overrides)
    layout = engine_config_from_args(args).layout()  # type: ignore[attr-defined]
    encdec = args.encoder_decoder
    encs: list[bytes | None] = list(ENCODER_INPUTS) if encdec else [None] * len(PROMPTS)
    expected = reference(args, encs)
    pair = Pair(tmp_path, args)
    try:
        for i, prompt in enumerate(PROMPTS):
            res = pair.router.generate(prompt, MAX_TOKENS, f"r{i}", encs[i] or b"")
            d = res.decode
            assert res.tokens == expected[i], f"request {i} differs"
            assert not d.load_error and d.blocks_recomputed == 0
            moved = dict(d.blocks_moved_by_group)
            want_bytes = sum(n * layout.block_bytes(g) for g, n in moved.items())
            assert d.bytes_moved == want_bytes
            assert layout.block_bytes("self") == (
                2 * len(layout.owning_layers("self")) * layout.span_bytes
            )
            if encdec:
                n_cross = -(-len(encs[i] or b"") // 16)
                first_use = i < 2  # clips A, B, A, B
                assert d.cross_source == ("loaded" if first_use else "hit")
                assert moved.get("cross", 0) == (n_cross if first_use else 0)
            else:
                assert set(moved) == {"self"}
                assert len(layout.owning_layers("self")) < layout.model.num_layers
        assert check_no_leaks({"prefill": pair.prefill, "decode": pair.decode}) == []
    finally:
        pair.close()


def test_encdec_decode_recomputes_cross_and_self_kv_when_prefill_dies(tmp_path: Path) -> None:
    args = node_args(encoder_decoder=True)
    encs: list[bytes | None] = list(ENCODER_INPUTS)
    expected = reference(args, encs)
    pair = Pair(tmp_path, args)
    try:
        first = pair.prefill.generate(
            PROMPTS[0], 1, "x", {"do_remote_decode": True}, encs[0] or b""
        )
        pair.prefill_proc.kill()
        pair.prefill_proc.wait()
        params = codec.unpack(first.kv_transfer_params, "KVTransferParams")
        assert params["block_ids"]["cross"] and params["block_hashes"]["cross"]
        rest = pair.decode.generate(
            PROMPTS[0] + list(first.token_ids), MAX_TOKENS - 1, "x", params, encs[0] or b""
        )
        assert list(first.token_ids) + list(rest.token_ids) == expected[0]
        assert rest.stats.load_error and rest.stats.blocks_moved == 0
        assert rest.stats.cross_source == "computed"
        assert check_no_leaks({"decode": pair.decode}) == []
    finally:
        pair.close()


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
