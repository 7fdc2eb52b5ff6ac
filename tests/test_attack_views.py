"""Attacks on the layout description of vLLM's KV views (connector/vllm/views.py and
KVLayout.from_tensors): views whose layers share bytes without aliasing one tensor must be
a LayoutError, never a layout whose loads overwrite another layer's KV."""

from __future__ import annotations

import pytest
import torch

from kvbridge.connector.vllm.views import logical_views, packed_suffix
from kvbridge.proto import KVLayout, LayoutError

L, B, H, N, C = 3, 5, 2, 4, 8
PAGE = H * N * 2 * C  # elements of one packed (H, N, 2C) page
SPAN = N * H * C  # elements of one K or V span


def describe(caches: dict[str, torch.Tensor]) -> KVLayout:
    views, interior = logical_views(caches, num_kv_heads=H, head_size=C, block_size=N)
    name = "m" + (packed_suffix(interior) if interior else "")
    return KVLayout.from_tensors(views, model_name=name, block_size=N)


def packed_layers(offsets: list[int]) -> dict[str, torch.Tensor]:
    """Packed LBHNC pages of ``B`` blocks per layer, layer ``i`` at element ``offsets[i]``."""
    raw = torch.zeros(64 * PAGE)
    return {
        f"layers.{i}.attn": torch.as_strided(raw, (B, H, N, 2 * C), (PAGE, N * 2 * C, 2 * C, 1), o)
        for i, o in enumerate(offsets)
    }


@pytest.mark.parametrize(
    "offsets",
    [
        [0, 2 * PAGE, 12 * PAGE],  # layer 1 starts inside layer 0 (uneven steps)
        [0, 2 * PAGE, 4 * PAGE],  # an even step shorter than a layer
        [0, 12 * PAGE, 2 * PAGE],  # the overlap is not with the previous layer
    ],
)
def test_packed_layers_that_overlap_are_rejected(offsets: list[int]) -> None:
    with pytest.raises(LayoutError, match="overlap"):
        describe(packed_layers(offsets))


def test_split_kv_layers_that_overlap_are_rejected() -> None:
    raw = torch.zeros(64 * SPAN)
    caches = {
        f"layers.{i}.attn": torch.as_strided(raw, (2, B, N, H, C), (B * SPAN, SPAN, H * C, C, 1), o)
        for i, o in enumerate([0, 7 * SPAN, 14 * SPAN + 3])
    }
    with pytest.raises(LayoutError, match="overlap"):
        describe(caches)


def test_separate_and_aliased_layers_are_still_accepted() -> None:
    separate = describe(packed_layers([0, 5 * PAGE + 7, 17 * PAGE]))  # gaps between layers
    assert separate.kind == "layer-separate" and separate.num_regions == L
    caches = packed_layers([0, B * PAGE])
    caches["layers.2.attn"] = caches["layers.0.attn"]  # KV sharing: one tensor, one region
    shared = describe(caches)
    assert [x.kv_source for x in shared.layers] == [None, None, "layers.0.attn"]


def test_a_model_id_carrying_a_layout_tag_is_refused() -> None:
    # why: a split-K/V engine whose model id ends in the packed tag would describe itself
    # under the very name a packed engine tags itself with, and the two would pair
    from kvbridge.connector.vllm.config import VllmConnectorConfig
    from kvbridge.proto import ConfigError, TransferMode

    packed = describe(packed_layers([0, B * PAGE, 2 * B * PAGE]))
    raw = torch.zeros(64 * SPAN)
    split = {
        f"layers.{i}.attn": torch.as_strided(
            raw, (2, B, N, H, C), (B * SPAN, SPAN, H * C, C, 1), i * 2 * B * SPAN
        )
        for i in range(L)
    }
    views, _ = logical_views(split, num_kv_heads=H, head_size=C, block_size=N)
    forged = KVLayout.from_tensors(views, model_name=packed.model.name, block_size=N)
    assert packed.negotiate(forged).mode is not TransferMode.INCOMPATIBLE  # the hazard
    for model_id in (packed.model.name, "m|anything"):
        with pytest.raises(ConfigError, match=r"model_id .* contains '\|'"):
            VllmConnectorConfig.from_vllm("kv_consumer", "e", {"model_id": model_id}, "served-name")
    with pytest.raises(ConfigError, match=r"contains '\|'"):
        VllmConnectorConfig.from_vllm("kv_consumer", "e", {}, "org/model|x")
