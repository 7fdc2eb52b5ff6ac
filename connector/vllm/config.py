"""``VllmConnectorConfig``: kvbridge's settings inside vLLM, from ``--kv-transfer-config``.

Built once per process from ``kv_role``, ``engine_id`` and
``kv_connector_extra_config`` (a JSON object); every knob is validated here
and a bad one raises :class:`ConfigError` naming it. No vLLM import: the
adapter passes plain values.

``kv_connector_extra_config`` keys (all optional; docs/VLLM.md lists them too, and a test
keeps both lists equal to ``_KNOWN``):

======================== ==================================================================
``control_port``         port of the control server of a ``kv_producer``/``kv_both`` (default
                         7600, :data:`DEFAULT_CONTROL_PORT`; TP rank ``r`` serves on
                         ``control_port + r``); the scheduler advertises it in
                         ``kv_transfer_params``
``control_host``         address the control server binds (default ``127.0.0.1``)
``advertise_host``       host decode peers reach it at (default ``control_host``)
``engine_id``            kvbridge engine id (default vLLM's ``engine_id``)
``model_id``             model identity for layouts and block hashes; must be equal on every
                         node (default: ``--served-model-name``, i.e. the model path)
``hash_seed``            block-hash seed, equal on every node (default ``""``)
``hash_algorithm``       ``sha256`` (default) or ``xxh3_128``
``token``                shared token of the control plane and of the offload daemon
                         (``kvbridge offload serve --token``); sent only to allowed peers.
                         Visible to anyone who can read the process's command line: prefer
``token_file``           a file holding the token (read once at start; not with ``token``)
``tls_cert``             PEM certificate chain file: the control server serves TLS only
                         (with ``tls_key``), like ``kvbridge serve --tls-cert``
``tls_key``              PEM private key file of ``tls_cert``
``tls_ca``               PEM roots file peers' control certificates must chain to: decode
                         dials prefill over TLS (default with ``tls_cert``: that certificate)
``insecure_plaintext_token`` ``true`` accepts a token served without TLS on a non-loopback
                         ``control_host`` (anyone on the path can read it); otherwise that
                         is a ConfigError
``allowed_peers``        list of prefill control addresses (``host:port``) decode may dial;
                         default: loopback addresses only. A request naming another address
                         is recomputed and the token is never sent there; decode links
                         to each at start
``lease_ttl_s``          how long prefill holds blocks for decode (default 30)
``max_lease_ttl_s``      longest lease a decode peer may ask for; longer asks are clamped
                         (default 600, at least ``lease_ttl_s``)
``load_timeout_s``       deadline of one READ (default 10)
``max_concurrent_loads`` loads (and offload stores) run at once, and handshakes with new peers
                         (default 4)
``offload_address``      host:port of the node's CPU offload daemon (``kvbridge offload serve``):
                         requests load the blocks it holds after their local prefix-cache hit,
                         and finished requests store their full prompt blocks in it
``offload_verify``       check every block loaded from the offload daemon against its
                         writer's digest before vLLM uses it (default ``true``); ``false``
                         trusts the daemon's memory
``verify_loads``         check loaded blocks against their hand-over digests (default true;
                         ConnectorConfig rejects a non-boolean); a vLLM prefill's worker
                         digests the blocks it holds and decode fetches the digests beside
                         its READ
``kv_cache_layout``      the KV cache layout kvbridge asks vLLM for: ``BLHNC`` (default,
                         block-outermost: one descriptor per block), ``BLNHC``, ``LBHNC``,
                         ``LBNHC``, or ``auto`` (ask for nothing). vLLM uses it only where
                         every attention backend declares it, otherwise warns and takes
                         its own choice (``LBHNC`` on the CPU backend)
``offload_kv_events``    ZMQ endpoint of the daemon's KV events (``offload serve --kv-events``):
                         the scheduler relays them on vLLM's own KV event stream (needs
                         vLLM's ``--kv-events-config`` with events enabled, and pyzmq)
``offload_kv_events_replay`` the daemon's replay endpoint (``--kv-events-replay``), optional
======================== ==================================================================
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbridge.connector.config import DEFAULT_MAX_CONCURRENT_LOADS, ConnectorConfig
from kvbridge.connector.control.peers import refuse_plaintext_token
from kvbridge.connector.server_options import check_port, check_tls_pair
from kvbridge.proto import codec
from kvbridge.proto.errors import ConfigError
from kvbridge.proto.hashing import HASH_ALGORITHMS, BlockHasher, HashConfig
from kvbridge.proto.specs import PageShape

if TYPE_CHECKING:
    from kvbridge.connector.offload.lookup import OffloadLookup

__all__ = [
    "DEFAULT_CONTROL_PORT",
    "KNOWN_KEYS",
    "KV_CACHE_LAYOUTS",
    "VLLM_ROLES",
    "VllmConnectorConfig",
    "required_layout",
]

VLLM_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
_KNOWN = frozenset(
    {
        "control_port",
        "control_host",
        "advertise_host",
        "engine_id",
        "model_id",
        "hash_seed",
        "hash_algorithm",
        "token",
        "insecure_plaintext_token",
        "token_file",
        "tls_cert",
        "tls_key",
        "tls_ca",
        "lease_ttl_s",
        "max_lease_ttl_s",
        "allowed_peers",
        "load_timeout_s",
        "offload_address",
        "offload_verify",
        "max_concurrent_loads",
        "kv_cache_layout",
        "offload_kv_events",
        "offload_kv_events_replay",
        "verify_loads",
    }
)
KNOWN_KEYS = _KNOWN
"""Every ``kv_connector_extra_config`` key (anything else is an error)."""
DEFAULT_CONTROL_PORT = 7600
"""Control port of a producer without ``control_port``; TP rank ``r`` listens on 7600 + r."""
KV_CACHE_LAYOUTS = ("BLHNC", "BLNHC", "LBHNC", "LBNHC")
"""vLLM layouts whose pages kvbridge can describe (a block's heads adjacent), preferred first."""
DEFAULT_KV_CACHE_LAYOUT = "BLHNC"


def required_layout(extra: Mapping[str, Any] | None) -> str | None:
    """The vLLM layout name to request from ``kv_connector_extra_config`` (None: ``auto``)."""
    value = (extra or {}).get("kv_cache_layout", DEFAULT_KV_CACHE_LAYOUT)
    if value == "auto":
        return None
    if value not in KV_CACHE_LAYOUTS:
        raise ConfigError(
            f"kv_connector_extra_config.kv_cache_layout {value!r} is not one of "
            f"{', '.join(KV_CACHE_LAYOUTS)} or 'auto' (BHLNC/LHBNC pages split a block's "
            "heads, which kvbridge cannot describe)"
        )
    return str(value)


@dataclass(frozen=True, slots=True)
class VllmConnectorConfig:
    """Everything the two halves need; see the module docstring for the knobs."""

    connector: ConnectorConfig
    model_id: str
    control_host: str = "127.0.0.1"
    control_port: int = 0
    hash: HashConfig = field(default_factory=HashConfig)
    kv_cache_layout: str | None = DEFAULT_KV_CACHE_LAYOUT
    """vLLM layout name to request (None: ``auto``); see :func:`required_layout`."""
    offload_events: tuple[str, str | None] | None = None
    """The daemon's KV events (endpoint, replay endpoint) to relay on vLLM's stream."""
    tls_cert: bytes | None = None
    """PEM certificate chain the control server serves TLS with (``tls_key`` its key)."""
    tls_key: bytes | None = None

    def __post_init__(self) -> None:
        knobs = "kv_connector_extra_config.tls_cert and tls_key"
        check_tls_pair(self.tls_cert, self.tls_key, knobs)
        check_port(self.control_port, "control_port")
        if self.connector.produces and self.control_port == 0:
            raise ConfigError(
                "kv_connector_extra_config.control_port is required for kv_producer/kv_both: "
                "the scheduler puts host:port into kv_transfer_params before the worker starts"
            )
        if not self.model_id:
            raise ConfigError("model_id must be non-empty (same on every node)")
        if "|" in self.model_id:
            # '|' starts kvbridge's layout tags (views.packed_suffix): a model id carrying
            # one would let real K/V pair with packed pages whose halves are not K and V
            raise ConfigError(
                f"model_id {self.model_id[:64]!r} contains '|', which kvbridge reserves for "
                "its layout tags; set kv_connector_extra_config.model_id to a name without it"
            )

    @classmethod
    def from_vllm(
        cls, kv_role: str | None, engine_id: str | None, extra: Mapping[str, Any] | None, model: str
    ) -> VllmConnectorConfig:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _KNOWN)
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config has unknown keys {unknown}; known: {sorted(_KNOWN)}"
            )
        if kv_role not in VLLM_ROLES:
            raise ConfigError(f"kv_role {kv_role!r} is not one of {', '.join(VLLM_ROLES)}")
        produces = VLLM_ROLES[kv_role] != "decode"
        port = _int(extra, "control_port", DEFAULT_CONTROL_PORT if produces else 0)
        host = _str(extra, "control_host", "127.0.0.1")
        refuse_plaintext_token(
            host,
            token=bool(extra.get("token")) or "token_file" in extra,
            tls="tls_cert" in extra,
            accepted=extra.get("insecure_plaintext_token") is True,
            flag="kv_connector_extra_config.insecure_plaintext_token=true",
            tls_flags="kv_connector_extra_config.tls_cert/tls_key",
        )
        advertise = _str(extra, "advertise_host", host)
        algorithm = str(extra.get("hash_algorithm", "sha256"))
        if algorithm not in HASH_ALGORITHMS:
            raise ConfigError(f"hash_algorithm {algorithm!r} is not one of {HASH_ALGORITHMS}")
        lease_ttl_s = _float(extra, "lease_ttl_s", 30.0)
        token = extra.get("token")
        if "token_file" in extra:
            if token is not None:
                raise ConfigError("kv_connector_extra_config: give token or token_file, not both")
            token = _token_file(extra)
        tls_cert = _pem(extra, "tls_cert")
        tls_ca = _pem(extra, "tls_ca")
        connector = ConnectorConfig(
            engine_id=str(extra.get("engine_id") or engine_id or ""),
            role=VLLM_ROLES[kv_role],
            control_address=f"{advertise}:{port}" if port else "",
            token=token,
            tls_root_cert=tls_ca if tls_ca is not None else tls_cert,
            allowed_peers=_peers(extra, "allowed_peers"),
            lease_ttl_s=lease_ttl_s,
            max_lease_ttl_s=_float(extra, "max_lease_ttl_s", max(600.0, lease_ttl_s)),
            load_timeout_s=_float(extra, "load_timeout_s", min(10.0, lease_ttl_s / 2)),
            max_concurrent_loads=_int(extra, "max_concurrent_loads", DEFAULT_MAX_CONCURRENT_LOADS),
            offload_address=_address(extra, "offload_address"),
            offload_verify=_offload_verify(extra),
            verify_loads=extra.get("verify_loads", True),
        )
        return cls(
            connector=connector,
            model_id=str(extra.get("model_id") or model),
            control_host=host,
            control_port=port,
            hash=HashConfig(algorithm=algorithm, seed=str(extra.get("hash_seed", ""))),
            kv_cache_layout=required_layout(extra),
            offload_events=_events(extra),
            tls_cert=tls_cert,
            tls_key=_pem(extra, "tls_key"),
        )

    def hasher(
        self,
        *,
        dtype: str,
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
        block_size: int,
        pages: Mapping[str, PageShape] | None = None,
    ) -> BlockHasher:
        """The block hasher, rooted in what both sides know before any KV tensor exists.
        ``pages``: KV cache groups' page shapes by kvbridge's group name; only those that
        differ from ``self``'s (``block_size``, ``num_kv_heads``, ``head_size``) enter the
        fingerprint, so a model whose groups all have one shape keeps its names."""
        identity: dict[str, Any] = {
            "model": self.model_id,
            "dtype": dtype,
            "layers": num_layers,
            "kv_heads": num_kv_heads,
            "head_size": head_size,
            "block_size": block_size,
        }
        own = PageShape(block_size, num_kv_heads, head_size)
        other = {str(g): p for g, p in (pages or {}).items() if p != own}
        if other:
            identity["pages"] = {
                g: [p.block_size, p.num_kv_heads, p.head_size] for g, p in sorted(other.items())
            }
        fingerprint = hashlib.sha256(codec.pack("VllmModel", identity)).digest()
        return BlockHasher(fingerprint, block_size, self.hash)

    def offload_lookup(self, tp_size: int) -> OffloadLookup | None:
        """The scheduler's lookup of the offload daemon (None without one). Each TP rank
        stores and loads its own heads, so it asks for the blocks of all ``tp_size`` ranks."""
        from kvbridge.connector.offload.lookup import OffloadLookup, OffloadLookupConfig

        address, token = self.connector.offload_address, self.connector.token
        return (
            OffloadLookup(OffloadLookupConfig(address, tp_size, token=token)) if address else None
        )


def _events(extra: Mapping[str, Any]) -> tuple[str, str | None] | None:
    if "offload_kv_events" not in extra:
        if "offload_kv_events_replay" in extra:
            raise ConfigError("offload_kv_events_replay needs offload_kv_events")
        return None
    endpoint = _str(extra, "offload_kv_events", "")
    replay = (
        _str(extra, "offload_kv_events_replay", "") if "offload_kv_events_replay" in extra else None
    )
    for key, value in (("offload_kv_events", endpoint), ("offload_kv_events_replay", replay)):
        if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(f"{key} {value!r} needs a tcp://, ipc:// or inproc:// scheme")
    return endpoint, replay


def _read(extra: Mapping[str, Any], key: str) -> bytes:
    path = extra[key]
    if not isinstance(path, str) or not path:
        raise ConfigError(f"kv_connector_extra_config.{key} must be a file path, got {path!r}")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(
            f"kv_connector_extra_config.{key} {path!r}: {exc.strerror or exc}"
        ) from None


def _token_file(extra: Mapping[str, Any]) -> str:
    """The token in ``token_file``, stripped; an empty file is an error (it must not leave
    the control server open)."""
    try:
        token = _read(extra, "token_file").decode().strip()
    except UnicodeDecodeError:
        raise ConfigError("kv_connector_extra_config.token_file is not UTF-8 text") from None
    if not token:
        raise ConfigError(
            f"kv_connector_extra_config.token_file {extra['token_file']!r} is empty: write the "
            "token into it, or leave the key out to run without one"
        )
    return token


def _pem(extra: Mapping[str, Any], key: str) -> bytes | None:
    """The PEM file named by ``key`` (None when absent); ConfigError unless it holds PEM."""
    if key not in extra:
        return None
    data = _read(extra, key)
    if b"-----BEGIN " not in data:
        raise ConfigError(
            f"kv_connector_extra_config.{key} {extra[key]!r} is not a PEM file "
            "(no '-----BEGIN' line)"
        )
    return data


def _address(extra: Mapping[str, Any], key: str) -> str:
    value = extra.get(key) or ""
    if not isinstance(value, str) or (value and not value.rpartition(":")[2].isdigit()):
        raise ConfigError(
            f"kv_connector_extra_config.{key} must be host:port (e.g. 127.0.0.1:50060), "
            f"got {value!r}"
        )
    return value


def _peers(extra: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = extra.get(key, [])
    if not isinstance(value, list | tuple) or not all(isinstance(x, str) for x in value):
        raise ConfigError(
            f"kv_connector_extra_config.{key} must be a list of host:port strings, got {value!r}"
        )
    return tuple(value)


def _float(extra: Mapping[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    try:
        out = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        out = math.nan
    if not (math.isfinite(out) and out > 0):
        raise ConfigError(
            f"kv_connector_extra_config.{key} must be a finite number of seconds > 0, got {value!r}"
        )
    return out


def _str(extra: Mapping[str, Any], key: str, default: str) -> str:
    value = extra.get(key, default)
    if not isinstance(value, str) or not value:
        raise ConfigError(
            f"kv_connector_extra_config.{key} must be a non-empty string, got {value!r}"
        )
    return value


def _int(extra: Mapping[str, Any], key: str, default: int) -> int:
    value = extra.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"kv_connector_extra_config.{key} must be an integer, got {value!r}")
    return value


def _offload_verify(extra: Mapping[str, Any]) -> bool:
    value = extra.get("offload_verify", True)
    if not isinstance(value, bool):
        raise ConfigError(f"offload_verify must be true or false, got {value!r}")
    return value
