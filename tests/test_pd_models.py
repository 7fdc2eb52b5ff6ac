"""P/D end to end for KV-sharing and encoder-decoder models: real node processes, NIXL, gRPC.

Decode outputs must equal single-process runs; the bytes moved must be the
owning layers' bytes only; a repeated encoder input moves no cross block; no
block of either group and no lease is left behind, also when prefill dies.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from kvbridge.proto import codec
from kvbridge.worker.engine import Engine
from kvbridge.worker.serving.node_cmd import engine_config_from_args
from kvbridge.worker.tools import check_no_leaks, make_encoder_inputs, make_workload
from tests.harness.nodes import NodePair, node_args

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

MAX_TOKENS = 5
PROMPTS = make_workload(4, 2, 512, 16, seed=3)
ENCODER_INPUTS = make_encoder_inputs(4, 2, 512, seed=3)  # clips A B A B


def model_args(**overrides: Any) -> argparse.Namespace:
    return node_args(**{"num_blocks": 128, **overrides})


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
    args = model_args(**overrides)
    layout = engine_config_from_args(args).layout()  # type: ignore[attr-defined]
    encdec = args.encoder_decoder
    encs: list[bytes | None] = list(ENCODER_INPUTS) if encdec else [None] * len(PROMPTS)
    expected = reference(args, encs)
    pair = NodePair(tmp_path, args)
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
    args = model_args(encoder_decoder=True)
    encs: list[bytes | None] = list(ENCODER_INPUTS)
    expected = reference(args, encs)
    pair = NodePair(tmp_path, args)
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
