"""Model kinds inside real vLLM (CPU): encoder-decoder and Mamba models, and hybrid models whose
KV cache groups have padded pages, are refused by name.

vLLM 0.32's scheduler runs no KV connector with an encoder-decoder model. Before the
connector checked the model kind, a Whisper-style model with KVBridgeConnector failed
earlier, in vLLM's KV cache grouping, with "Failed to promote local KV cache specs to one
unified type": vLLM turns its hybrid KV cache manager off for a connector without
``SupportsHMA`` and then cannot merge the decoder's cross-attention layers into one group.
The connector now refuses when vLLM first asks it for its KV cache layout, before that.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge.connector.vllm.kinds import ENCODER_DECODER_REFUSAL, check_model_kind
from kvbridge.proto import ConfigError
from kvbridge.worker import LaunchError
from kvbridge.worker import vllm as harness
from tests.harness.vllm import model_or_skip, nixl_pair, write_tiny_model


def test_an_encoder_decoder_model_is_refused_by_kind() -> None:
    with pytest.raises(ConfigError, match="WhisperForConditionalGeneration: it is an encoder-"):
        check_model_kind("WhisperForConditionalGeneration", is_encoder_decoder=True)
    check_model_kind("LlamaForCausalLM", is_encoder_decoder=False)  # no error


def test_a_model_with_mamba_layers_is_refused_by_kind() -> None:
    with pytest.raises(ConfigError, match="cannot serve JambaForCausalLM: its Mamba"):
        check_model_kind("JambaForCausalLM", is_encoder_decoder=False, has_state_space_layers=True)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_real_vllm_refuses_whisper_with_kvbridge_by_name(tmp_path: Path) -> None:
    model_or_skip(tmp_path)  # the venv
    model = write_tiny_model("whisper", tmp_path / "whisper")
    kv = harness.kv_config("kvbridge", "kv_consumer")
    with pytest.raises(LaunchError) as info:
        harness.Engine(
            model, core=1, kv=kv, log=tmp_path / "whisper.log", max_model_len=448, tokenizer=True
        ).close()
    log = (tmp_path / "whisper.log").read_text()
    assert "cannot serve WhisperForConditionalGeneration: it is an encoder-decoder" in log
    assert ENCODER_DECODER_REFUSAL in log
    assert "Failed to promote" not in log, str(info.value)[-2000:]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.extended  # NixlConnector, the reference: one more failed start (~75 s)
@pytest.mark.timeout(600)
def test_real_vllm_refuses_whisper_with_nixl_connector_in_its_scheduler(tmp_path: Path) -> None:
    """What kvbridge's refusal cites: vLLM itself runs no KV connector with an
    encoder-decoder model, NixlConnector included."""
    model_or_skip(tmp_path)  # the venv
    model = write_tiny_model("whisper", tmp_path / "whisper")
    kv = harness.kv_config("nixl", "kv_consumer")
    with pytest.raises(LaunchError):
        harness.Engine(
            model, core=1, kv=kv, log=tmp_path / "whisper.log", max_model_len=448, tokenizer=True
        ).close()
    log = (tmp_path / "whisper.log").read_text()
    assert "Encoder-decoder models are not currently supported with KV connectors" in log


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.extended  # the rule is the unit test above; this start costs ~75 s
@pytest.mark.timeout(600)
def test_real_vllm_refuses_mamba_with_kvbridge_by_name(tmp_path: Path) -> None:
    model_or_skip(tmp_path)  # the venv
    model = write_tiny_model("mamba", tmp_path / "mamba")
    kv = harness.kv_config("kvbridge", "kv_consumer")
    with pytest.raises(LaunchError):
        harness.Engine(model, core=1, kv=kv, log=tmp_path / "mamba.log", max_model_len=256).close()
    log = (tmp_path / "mamba.log").read_text()
    assert "cannot serve MambaForCausalLM: its Mamba (state-space) layers" in log, log[-3000:]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.extended  # the rule is tests/test_vllm_hma_plan.py's; this start costs ~75 s
@pytest.mark.timeout(600)
def test_real_vllm_refuses_hybrid_groups_of_padded_pages_by_name(tmp_path: Path) -> None:
    """vLLM keeps its hybrid KV cache groups with kvbridge (``SupportsHMA``). Groups of
    another page shape at equal page bytes are moved (``tests/test_vllm_gemma4_wide.py``);
    where a group's page does not divide the largest, vLLM pads it (read through a strided
    view), which kvbridge cannot move as dense pages: refused when the connector is made,
    naming the group."""
    model_or_skip(tmp_path)  # the venv
    model = write_tiny_model("gemma4-pad", tmp_path / "gemma4-pad")
    kv = harness.kv_config("kvbridge", "kv_consumer")
    with pytest.raises(LaunchError):
        harness.Engine(model, core=1, kv=kv, log=tmp_path / "g4.log", max_model_len=256).close()
    log = (tmp_path / "g4.log").read_text()
    assert "cannot serve Gemma4ForCausalLM: its KV cache group" in log, log[-3000:]
    assert "has padded pages of 1 KV heads x 64" in log, log[-3000:]
    assert "kvbridge moves dense pages only" in log, log[-3000:]


NIXL_PROMPT = [5, *range(10, 100), 7]  # 92 tokens: 2 full blocks + 28
PAGE = 32 * 64 * 2 * 4
"""One layer's page of one KV head of 64 per 32 tokens, K and V, fp32 (16 KiB)."""
NIXL_BYTES = {"gemma4": 5 * PAGE, "gemma4-wide": 3 * 2 * PAGE + 2 * 2 * PAGE}
"""NixlConnector's bytes for ``NIXL_PROMPT``. ``gemma4``: the full group's 3 blocks and the
sliding group's last 2 (``cdiv(32, 32) + 1``), one owning layer's page each (80 KiB).
``gemma4-wide``: the full group's 3 blocks of head size 128 (32 KiB each) and the sliding
group's 2 blocks, which vLLM made 64 tokens long to equalise the groups' page sizes
(32 KiB each, ``cdiv(32, 64) + 1``): 160 KiB."""
MAMBA_CPU = "no attribute 'selective_scan_fwd'"
"""vLLM 0.32's CPU build has no Mamba scan kernel: a Mamba layer's first forward fails
(``MambaMixer`` -> ``selective_scan_fn`` in ``vllm/model_executor/layers/mamba/ops/
mamba_ssm.py`` -> ``torch.ops._C.selective_scan_fwd``, ``vllm/_custom_ops.py``), whatever
the connector: no engine of this build serves Mamba."""


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.extended  # the reference connector: two engines per model (~2-3 min each)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["gemma4", "gemma4-wide", "mamba"])
def test_nixl_connector_pd_of_other_model_kinds(kind: str, tmp_path: Path) -> None:
    """NixlConnector P/D (TP=1) of kinds kvbridge moves or refuses: the decode's tokens equal
    the prefill engine's own answer to the prompt (a single instance), which depends on the
    first token, both engines keep vLLM's KV cache groups, and the decode read the KV (one
    transfer of the bytes in ``NIXL_BYTES``, nothing failed). A Mamba model starts with
    NixlConnector on both sides, but its first forward fails (:data:`MAMBA_CPU`)."""
    model_or_skip(tmp_path)  # the venv
    model = write_tiny_model(kind, tmp_path / kind)
    port = 35000 + (hash(str(tmp_path)) % 500) * 2
    started = nixl_pair(model, tmp_path, port, max_model_len=512, wait=False)
    with harness.running(started) as engines:
        prefill, decode = engines["prefill"], engines["decode"]
        if kind == "mamba":  # a plain request, no KV transfer: the model itself fails
            with pytest.raises(RuntimeError, match=MAMBA_CPU):
                prefill.generate([NIXL_PROMPT], 8)
            return
        (expected,) = harness.tokens(prefill.generate([NIXL_PROMPT], 8))
        assert expected != harness.tokens(prefill.generate([[9, *NIXL_PROMPT[1:]]], 8))[0]
        pre = prefill.generate([NIXL_PROMPT], 1, [{"do_remote_decode": True}])
        params = [o["kv_transfer_params"] for o in pre["outputs"]]
        assert harness.tokens(decode.generate([NIXL_PROMPT], 8, params)) == [expected]
        stats = decode.call(cmd="stats")
        groups = {n: sorted(e.call(cmd="stats")["kv_cache_groups"]) for n, e in engines.items()}
    print(f"{kind}: KV cache groups {groups}, NixlConnector bytes {stats['nixl_bytes']}")
    hybrid = ["FullAttentionSpec", "SlidingWindowSpec"]
    assert groups == {"prefill": hybrid, "decode": hybrid}
    assert stats["nixl_bytes"] == [NIXL_BYTES[kind]] and not stats["nixl_failed"], stats
