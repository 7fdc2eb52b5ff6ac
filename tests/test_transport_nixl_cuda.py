"""NIXL on CUDA memory: two processes, each with KV pools in VRAM (block-outermost and
layer-separate) and a host pool, READ and WRITE every pairing, bytes compared bit for bit.

The GPU tests are marked ``gpu`` and skip without CUDA; the memory-type choice they rely
on is checked here on any machine.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import random
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvbridge.connector.transport.nixl import load_nixl
from kvbridge.connector.transport.nixl_descs import device_id, mem_type
from kvbridge.proto import ConfigError
from tests.harness.peer import start_peers
from tests.harness.transport_contract import assert_clean_close, blocks, transfer

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
NUM_BLOCKS = 48
# (order, device) of each memory; the same list on both sides
MEMS = [
    ("block-nhd", "cuda"),
    ("layer-nhd", "cuda"),
    ("block-nhd", "cpu"),
    ("layer-nhd", "cpu"),
]


def test_the_nixl_memory_type_follows_the_tensors_device() -> None:
    assert mem_type("cuda") == "VRAM" and mem_type("cuda:1") == "VRAM"
    assert mem_type("cpu") == "DRAM"
    assert device_id("cuda:3") == 3 and device_id("cuda") == 0 and device_id("cpu") == 0


def test_nixl_loads_from_the_cuda13_wheel_when_the_cuda12_one_is_absent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api = types.ModuleType("nixl_cu13._api")
    package = types.ModuleType("nixl_cu13")
    package.__path__ = []
    monkeypatch.setitem(sys.modules, "nixl_cu12", None)
    monkeypatch.setitem(sys.modules, "nixl_cu12._api", None)
    monkeypatch.setitem(sys.modules, "nixl_cu13", package)
    monkeypatch.setitem(sys.modules, "nixl_cu13._api", api)
    assert load_nixl() is api
    for name in ("nixl_cu13", "nixl_cu13._api", "nixl", "nixl._api"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ConfigError, match=r"kvbridge\[cu13\]"):
        load_nixl()


def test_cuda_ipc_reads_are_turned_on_where_an_nvidia_driver_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvbridge.connector.transport.nixl import config

    api = types.ModuleType("nixl_cu12._api")
    monkeypatch.setitem(sys.modules, "nixl_cu12._api", api)
    # setenv first so that teardown removes whatever load_nixl sets: a leaked "on" made UCX
    # warn ("unused environment variable") in every later NIXL test of the session
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "unset-by-this-test")
    monkeypatch.delenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY")
    monkeypatch.setattr(config, "_has_nvidia_driver", lambda: False)
    load_nixl()
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in os.environ  # CPU machines: no stray UCX var
    monkeypatch.setattr(config, "_has_nvidia_driver", lambda: True)
    load_nixl()
    assert os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "on"
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "off")
    load_nixl()
    assert os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "off"  # the operator's choice wins


@pytest.fixture(scope="module")
def gpu_pair() -> Iterator[dict[str, Any]]:
    if not any(importlib.util.find_spec(m) for m in ("nixl_cu12", "nixl_cu13", "nixl")):
        pytest.skip("needs NIXL (nixl-cu12 or nixl-cu13)")
    reader, target = start_peers("gpu-reader", "gpu-target")
    try:
        tm = [
            target.call("setup", preset="tiny", num_blocks=NUM_BLOCKS, order=o, seed=1, device=d)
            for o, d in MEMS
        ]
        rm = [
            reader.call("setup", preset="tiny", num_blocks=NUM_BLOCKS, order=o, seed=2, device=d)
            for o, d in MEMS
        ]
        md = target.call("metadata")["metadata"]
        yield {"reader": reader, "target": target, "tmems": tm, "rmems": rm, "md": md}
        assert_clean_close(reader)
        assert_clean_close(target)
    finally:
        reader.stop()
        target.stop()


@pytest.mark.gpu
@needs_cuda
def test_cuda_pools_are_registered_as_vram(gpu_pair: dict[str, Any]) -> None:
    for mems in (gpu_pair["tmems"], gpu_pair["rmems"]):
        for (_, dev), m in zip(MEMS, mems, strict=True):
            assert m["device"].startswith(dev)
            assert m["mem_type"] == ("VRAM" if dev == "cuda" else "DRAM")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    ("rmem", "tmem"),
    [
        (r, t)
        for r, t in itertools.product(range(len(MEMS)), repeat=2)
        if "cuda" in (MEMS[r][1], MEMS[t][1])
    ],
    ids=lambda i: f"{MEMS[i][0]}@{MEMS[i][1]}",
)
def test_read_and_write_between_vram_and_vram_or_host_are_bit_exact(
    gpu_pair: dict[str, Any], rmem: int, tmem: int
) -> None:
    reader, target = gpu_pair["reader"], gpu_pair["target"]
    link = reader.call(
        "connect",
        peer="gpu-target",
        metadata=gpu_pair["md"],
        layout=gpu_pair["tmems"][tmem]["layout"],
        mem=rmem,
    )["link"]
    rng = random.Random(rmem * 10 + tmem)
    # READ: remote blocks land in local ones
    local, remote = rng.sample(range(NUM_BLOCKS), 12), rng.sample(range(NUM_BLOCKS), 12)
    transfer(reader, "read", link, local, remote)
    assert blocks(reader, rmem, local) == blocks(target, tmem, remote)
    # the device digest (or XXH3 on host memory) of what landed equals the source's own
    algo = "kvb-mlh32x4"
    key = rng.getrandbits(64)
    got = reader.call("digests", mem=rmem, ids=local, key=key, algo=algo)["digests"]
    want = target.call("digests", mem=tmem, ids=remote, key=key, algo=algo)["digests"]
    assert got == want
    # WRITE: other local blocks overwrite other remote ones
    local2 = rng.sample([b for b in range(NUM_BLOCKS) if b not in local], 8)
    remote2 = rng.sample([b for b in range(NUM_BLOCKS) if b not in remote], 8)
    transfer(reader, "write", link, local2, remote2)
    assert blocks(target, tmem, remote2) == blocks(reader, rmem, local2)
    reader.call("disconnect", link=link)
