"""A Gemma-4-style layout whose two groups differ in page shape, for the page-shape tests:
``self`` (full attention) and ``g1`` (sliding), two layers each, interleaved as vLLM's
model interleaves them."""

from __future__ import annotations

from kvbridge.proto import GroupSpec, KVGroup, KVLayout, LayerSpec, ModelSpec, attention_group
from kvbridge.proto.layout import PageShape

SELF, G1 = KVGroup.SELF, attention_group(1)


def wide_layout(
    page: PageShape | None,
    *,
    num_blocks: int,
    heads: int,
    order: str = "block-nhd",
    name: str = "gemma4-wide",
) -> KVLayout:
    """``self``: ``heads`` KV heads x 128 in 32-token blocks; ``g1``: ``page`` (None: the
    layout's own shape); ``num_blocks`` blocks per group."""
    return KVLayout(
        model=ModelSpec(name, "float32", 2, heads, 128),
        block_size=32,
        groups=(GroupSpec(SELF, num_blocks), GroupSpec(G1, num_blocks, page)),
        layers=(
            LayerSpec("layers.0", G1),
            LayerSpec("layers.1", SELF),
            LayerSpec("layers.2", G1),
            LayerSpec("layers.3", SELF),
        ),
    ).with_order(order)
