"""A prefill restarted under the same engine id: decode re-handshakes instead of reading
through its stale NIXL link (and instead of recomputing the next request)."""

from __future__ import annotations

import argparse
import socket
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from kvbridge.worker.engine import Engine, EngineConfig
from kvbridge.worker.serving import EngineClient, Router, start_node
from kvbridge.worker.tools import check_no_leaks, make_workload

pytestmark = pytest.mark.slow

MAX_TOKENS = 4
PROMPTS = make_workload(3, 3, 512, 16, seed=5)


def _args() -> argparse.Namespace:
    return argparse.Namespace(
        model="tiny",
        block_size=16,
        num_blocks=128,
        seed=0,
        on_load_error="recompute",
        startup_timeout=90.0,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    torch.set_num_threads(1)
    engine = Engine(EngineConfig.preset("tiny", num_blocks=128))
    return [engine.generate([p], MAX_TOKENS)[0] for p in PROMPTS]


@pytest.mark.parametrize("same_address", [False, True], ids=["new-address", "same-address"])
def test_restarted_prefill_is_re_handshaken_and_the_next_request_moves_its_blocks(
    tmp_path: Path, expected: list[list[int]], same_address: bool
) -> None:
    args = _args()
    ports = ["--port", str(_free_port()), "--control-port", str(_free_port())]
    extra = ports if same_address else []
    with start_node("decode", args, "block-nhd", tmp_path, None) as (_, dinfo):
        decode = EngineClient(dinfo["inference"], timeout_s=60)
        with start_node("prefill", args, "block-nhd", tmp_path, None, extra) as (proc, pinfo):
            prefill = EngineClient(pinfo["inference"], timeout_s=60)
            res = Router(prefill, decode).generate(PROMPTS[0], MAX_TOKENS, "before")
            assert res.tokens == expected[0] and res.decode.blocks_moved > 0
            proc.kill()
            proc.wait()
            prefill.close()
        # the same name gives the same engine id; a new process gives new NIXL metadata
        with start_node("prefill", args, "block-nhd", tmp_path, None, extra) as (_, pinfo2):
            assert pinfo2["engine_id"] == pinfo["engine_id"]
            assert (pinfo2["control"] == pinfo["control"]) == same_address
            prefill = EngineClient(pinfo2["inference"], timeout_s=60)
            router = Router(prefill, decode)
            for i in (1, 2):
                res = router.generate(PROMPTS[i], MAX_TOKENS, f"after-{i}")
                assert res.tokens == expected[i]
                assert res.decode.load_error == ""
                assert res.decode.blocks_moved > 0 and res.decode.blocks_recomputed == 0
            assert check_no_leaks({"prefill": prefill, "decode": decode}) == []
            prefill.close()
        decode.close()


def test_params_naming_another_engine_are_not_read_and_do_not_poison_the_link_cache(
    tmp_path: Path, expected: list[list[int]]
) -> None:
    from kvbridge.proto import codec

    args = _args()
    with ExitStack() as stack:
        _, d = stack.enter_context(start_node("decode", args, "block-nhd", tmp_path, None))
        _, p1 = stack.enter_context(
            start_node("p1", args, "block-nhd", tmp_path, None, role="prefill")
        )
        _, p2 = stack.enter_context(
            start_node("p2", args, "block-nhd", tmp_path, None, role="prefill")
        )
        decode, prefill1, prefill2 = (
            EngineClient(i["inference"], timeout_s=60) for i in (d, p1, p2)
        )
        for client in (decode, prefill1, prefill2):
            stack.callback(client.close)
        # a forged claim: p1's blocks, but p2's engine id
        first = prefill1.generate(PROMPTS[0], 1, "forged", {"do_remote_decode": True})
        params = codec.unpack(first.kv_transfer_params, "KVTransferParams")
        params["remote_engine_id"] = p2["engine_id"]
        rest = decode.generate(PROMPTS[0] + list(first.token_ids), MAX_TOKENS - 1, "forged", params)
        assert list(first.token_ids) + list(rest.token_ids) == expected[0]
        assert rest.stats.blocks_moved == 0
        assert "names" in rest.stats.load_error and p2["engine_id"] in rest.stats.load_error
        # the genuine p2 reads p2's memory, not p1's under p2's name
        res = Router(prefill2, decode).generate(PROMPTS[1], MAX_TOKENS, "genuine")
        assert res.tokens == expected[1]
        assert res.decode.blocks_moved > 0 and res.decode.load_error == ""
