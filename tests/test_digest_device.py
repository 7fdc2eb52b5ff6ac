"""The device digest (kvb-mlh32x4): its CPU reference, the device kernel's piece table, and
(on a CUDA machine) the kernel against the reference, bit for bit."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import torch

from kvbridge.kernels import (
    ALGO_DEVICE,
    ALGO_XXH3,
    DIGEST_BYTES,
    BlockMapping,
    block_digests,
    convert_blocks,
    digest_algo,
    reference_block_digests,
    reference_digests,
)
from kvbridge.proto import KVLayout, LayoutError, preset_layout

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _filled(
    order: str, seed: int = 0, device: str = "cpu"
) -> tuple[KVLayout, dict[str, torch.Tensor]]:
    layout = preset_layout("tiny", num_blocks=8, order=order)
    caches = layout.allocate(device)
    gen = torch.Generator().manual_seed(seed)
    for layer in layout.owning_layers("self"):
        raw = caches[layer.name].view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8).to(device))
    return layout, caches


def _naive(data: bytes, chunk: int, key: int) -> bytes:
    """The algorithm's definition in plain Python ints, one word at a time."""
    from kvbridge.kernels import digest_cuda as d

    mask = (1 << 64) - 1

    def mix(x: int) -> int:
        z = (x + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    b1 = mix(key ^ 0x6B76625F6C310000)
    out = b""
    for lane in range(4):
        b2 = mix(key ^ (0x6B76625F6C320000 + lane))
        total = 0
        for j in range(len(data) // chunk):
            words = np.frombuffer(data[j * chunk : (j + 1) * chunk], dtype="<u4")
            s = sum(mix(b1 + (256 * lane + t) * 0x9E3779B97F4A7C15 & mask) * int(w)
                    for t, w in enumerate(words))  # fmt: skip
            total += mix(b2 + j * 0x9E3779B97F4A7C15 & mask) * ((s & mask) >> 32)
        total += mix(key ^ (0x6B76625F6C6E0000 + lane)) * len(data)
        out += ((total & mask) >> 32).to_bytes(4, "little")
    assert d.LANES == 4
    return out


def test_reference_matches_the_definition_word_by_word() -> None:
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, 3 * 64, dtype=np.uint8).tobytes()
    key = 0xDEADBEEF12345678
    got = reference_digests([[data[:64], data[64:]]], 64, key)[0]
    assert got == _naive(data, 64, key)
    assert len(got) == DIGEST_BYTES


def test_layouts_give_the_same_device_digest_for_the_same_kv() -> None:
    a, ca = _filled("block-nhd")
    b = preset_layout("tiny", num_blocks=8, order="layer-hnd")
    cb = b.allocate()
    c = preset_layout("tiny", num_blocks=8, order="layer-nhd")
    cc = c.allocate()
    mapping = BlockMapping(list(range(8)), list(range(8)))
    convert_blocks(ca, a, cc, c, mapping)
    convert_blocks(ca, a, cb, b, mapping)
    key = 77
    da = reference_block_digests(a.bind(ca), "self", range(8), key)
    dc = reference_block_digests(c.bind(cc), "self", range(8), key)
    assert da == dc
    assert len(set(da)) == 8
    # HND is another inner order: other bytes, another digest
    assert reference_block_digests(b.bind(cb), "self", range(8), key) != da
    # block_digests runs the reference when asked for the device algorithm on CPU memory
    assert block_digests(a.bind(ca), "self", range(8), key, algo=ALGO_DEVICE) == da
    assert block_digests(a.bind(ca), "self", range(8), key) != da  # default on CPU: XXH3
    assert digest_algo(a.bind(ca), "self") == ALGO_XXH3


def test_any_flipped_bit_or_another_key_changes_the_device_digest() -> None:
    layout, caches = _filled("layer-nhd")
    bound = layout.bind(caches)
    before = reference_block_digests(bound, "self", [5], 1)[0]
    assert reference_block_digests(bound, "self", [5], 2)[0] != before
    assert reference_block_digests(bound, "self", [5], 1 << 63)[0] != before
    rng = np.random.default_rng(3)
    spans = bound.block_spans("self", 5)
    for _ in range(20):
        span = spans[int(rng.integers(len(spans)))]
        addr = bound.regions[span.region].addr + span.offset + int(rng.integers(span.length))
        byte = ctypes.c_uint8.from_address(addr)
        bit = 1 << int(rng.integers(8))
        byte.value ^= bit
        assert reference_block_digests(bound, "self", [5], 1)[0] != before
        byte.value ^= bit
    assert reference_block_digests(bound, "self", [5], 1)[0] == before


def test_piece_table_covers_every_chunk_once_in_stream_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernel's (addr, nbytes, block, chunk_seq) rows, summed the way the kernel sums them
    (numpy here), give the reference digests: block-outermost and layer-separate, pieces cut."""
    from kvbridge.kernels import digest_cuda as d

    monkeypatch.setattr(d, "PIECE_BYTES", 3 * 1024 + 100)  # cut spans into several pieces
    key = 5
    table, b2, blen = d._keys(key)
    for order in ("block-nhd", "layer-nhd", "block-hnd"):
        layout, caches = _filled(order, seed=2)
        bound = layout.bind(caches)
        ids = [6, 1, 1, 3]
        chunk = d.chunk_bytes_of(bound.span_bytes)
        rows = d._pieces(bound, "self", ids, chunk, device="cpu").astype(np.uint64)
        sums = np.zeros((len(ids), 4), dtype=np.uint64)
        seen: dict[int, set[int]] = {i: set() for i in range(len(ids))}
        with np.errstate(over="ignore"):
            for addr, nbytes, out, seq0 in rows.tolist():
                data = ctypes.string_at(addr, nbytes)
                words = np.frombuffer(data, dtype="<u4").astype(np.uint64).reshape(-1, chunk // 4)
                for c in range(words.shape[0]):
                    assert seq0 + c not in seen[out]
                    seen[out].add(seq0 + c)
                    for lane in range(4):
                        s = (words[c] * table[lane, : chunk // 4]).sum(dtype=np.uint64)
                        at = np.uint64(b2[lane]) + np.uint64(seq0 + c) * np.uint64(d._GOLDEN)
                        k2 = d._splitmix(np.array([at], dtype=np.uint64))[0]
                        sums[out, lane] += k2 * (s >> np.uint64(32))
        nbytes = bound.block_bytes("self")
        got = [d._finish([int(x) for x in row], nbytes, blen) for row in sums]
        assert got == reference_block_digests(bound, "self", ids, key)
        assert all(seen[i] == set(range(nbytes // chunk)) for i in seen)


def test_bad_input_is_refused() -> None:
    layout, caches = _filled("block-nhd")
    bound = layout.bind(caches)
    with pytest.raises(ValueError, match="digest key"):
        reference_block_digests(bound, "self", [0], -1)
    with pytest.raises(ValueError, match="unknown digest algorithm"):
        block_digests(bound, "self", [0], 1, algo="md5")
    with pytest.raises(LayoutError, match="bound layout"):
        reference_block_digests(layout, "self", [0], 0)
    with pytest.raises(LayoutError, match="multiple of 4"):
        reference_digests([[b"abc"]], 3, 0)
    with pytest.raises(LayoutError, match="whole number"):
        reference_digests([[b"a" * 100]], 64, 0)
    from kvbridge.kernels import digest_cuda as d

    with pytest.raises(LayoutError, match="multiple of 4"):
        d.chunk_bytes_of(6)
    assert d.chunk_bytes_of(3 * 4096) == 1024 and d.chunk_bytes_of(96) == 32
    with pytest.raises(LayoutError, match="expected cuda"):
        d.device_block_digests(bound, "self", [0], 1)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_digest_kernel_source_compiles(tmp_path: Path) -> None:
    """Runs without a GPU wherever nvcc is installed (cupy compiles the same source via NVRTC)."""
    source = resources.files("kvbridge.kernels").joinpath("block_digest.cu")
    ptx = tmp_path / "block_digest.ptx"
    with resources.as_file(source) as cu:
        subprocess.run(
            ["nvcc", "--ptx", "-arch=sm_80", "-std=c++14", str(cu), "-o", str(ptx)],
            check=True,
            capture_output=True,
            timeout=120,
        )
    assert ".entry kvb_block_digest" in ptx.read_text()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("order", ["block-nhd", "layer-nhd", "block-hnd", "layer-hnd"])
def test_device_digest_matches_the_cpu_reference(order: str) -> None:
    layout, caches = _filled(order, seed=4)
    g_layout, g_caches = _filled(order, seed=4, device="cuda")
    cpu, gpu = layout.bind(caches), g_layout.bind(g_caches)
    assert digest_algo(gpu, "self") == ALGO_DEVICE
    ids = [7, 0, 3, 3]
    for key in (0, 1, 0xFFFFFFFFFFFFFFFF, 0x0123456789ABCDEF):
        want = reference_block_digests(cpu, "self", ids, key)
        assert block_digests(gpu, "self", ids, key) == want
    with pytest.raises(LayoutError, match="expected CPU memory"):
        block_digests(gpu, "self", ids, 1, algo=ALGO_XXH3)  # would need a host copy
    before = block_digests(gpu, "self", [3], 9)[0]
    last = g_caches[g_layout.owning_layers("self")[-1].name]
    last[1, 3, 5, 1, 7] = -last[1, 3, 5, 1, 7]  # flips the sign bit of one V element
    assert block_digests(gpu, "self", [3], 9)[0] != before
