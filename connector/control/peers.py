"""Which control addresses this engine may dial, and the one place it dials them.

A decode engine learns a prefill's control address from ``kv_transfer_params``:
a claim made by whoever sent the request, not a fact. Dialing it sends the
shared token, so an address inside a request is never enough: the operator
names the peers (``kvbridge serve --allow-peer HOST:PORT``, ``allowed_peers``
in the vLLM extra config). With none named, only loopback addresses are
allowed (a one-host deployment works out of the box; nothing leaves the host).

:func:`dial_control` is the only way the connector creates a control client
for an address it was handed; it refuses a disallowed address before any
channel exists, so the token is never sent there.

Tensor parallelism: rank ``r`` of a prefill serves its control port at the
advertised (rank-0) port ``+ r`` (:func:`rank_address`). A request names only
rank 0; a reader of rank ``r`` checks *that* address against the allowed peers
first and only then derives rank ``r``'s port itself, never taking it from the
request: naming ``HOST:PORT`` allows ``HOST:PORT+r`` for the ranks of that prefill.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvbridge.connector.addresses import is_loopback, normalize_address
from kvbridge.proto.errors import ConfigError, PeerError

if TYPE_CHECKING:
    from kvbridge.connector.config import ConnectorConfig
    from kvbridge.connector.control.client import ControlClient

__all__ = [
    "peer_allowed",
    "check_peer",
    "dial_control",
    "nixl_agent_name",
    "rank_address",
    "rank_port",
    "refuse_plaintext_token",
]


def peer_allowed(address: str, allowed: Iterable[str]) -> bool:
    """Whether ``address`` may be dialed: it is named in ``allowed`` or, when that names
    nothing, it is a loopback address."""
    try:
        addr = normalize_address(address)
    except ValueError:
        return False
    named = frozenset(allowed)
    return addr in named if named else is_loopback(addr)


def check_peer(address: str, allowed: Iterable[str]) -> None:
    """Raise :class:`PeerError` (naming the fix) unless ``address`` may be dialed."""
    named = tuple(allowed)
    if peer_allowed(address, named):
        return
    scope = f"the allowed peers {sorted(named)}" if named else "loopback (no peers were named)"
    raise PeerError(
        f"control address {address[:64]!r} is not in {scope}; not dialing it. If that is a "
        "prefill you trust, name it with `kvbridge serve --allow-peer HOST:PORT` or the "
        "allowed_peers extra config; if it is an unspecified address (0.0.0.0), start that "
        "prefill with --advertise HOST:PORT"
    )


def nixl_agent_name(engine_id: str, tp_rank: int, tp_size: int) -> str:
    """The NIXL agent name of TP rank ``tp_rank`` of engine ``engine_id``: the engine id at
    TP=1, else ``<engine id>-tp<rank>``. Every rank's agent needs its own name: a reader of
    several ranks (heterogeneous TP) loads them all, and NIXL keys remote agents by name."""
    return engine_id if tp_size == 1 else f"{engine_id}-tp{tp_rank}"


def rank_port(port: int, tp_rank: int) -> int:
    """The control port of TP rank ``tp_rank`` of an engine whose rank 0 serves ``port``."""
    if tp_rank < 0 or not 0 < port + tp_rank <= 65535:
        raise ConfigError(
            f"control port {port} + TP rank {tp_rank} is not a port: pick a control_port "
            "with room for one port per rank"
        )
    return port + tp_rank


def rank_address(address: str, tp_rank: int) -> str:
    """``HOST:PORT`` of TP rank ``tp_rank`` of the engine whose rank 0 is at ``address``
    (PeerError if that is not a port)."""
    try:
        host, _, port = normalize_address(address).rpartition(":")
        return f"{host}:{rank_port(int(port), tp_rank)}"
    except (ValueError, ConfigError) as exc:
        raise PeerError(
            f"no TP rank {tp_rank} control address for {address[:64]!r}: {exc}"
        ) from None


def dial_control(address: str, config: ConnectorConfig, tp_rank: int = 0) -> ControlClient:
    """A control client for TP rank ``tp_rank`` of the peer whose rank 0 is at ``address``.

    ``address`` (a claim from a request) must be allowed first (PeerError otherwise:
    nothing is sent); only then is rank ``tp_rank``'s port derived from it."""
    check_peer(address, config.allowed_peers)
    target = rank_address(address, tp_rank) if tp_rank else address
    from kvbridge.connector.control.client import ControlClient

    return ControlClient(
        target,
        token=config.token,
        root_cert=config.tls_root_cert,
        timeout_s=config.control_timeout_s,
    )


def refuse_plaintext_token(
    host: str, *, token: bool, tls: bool, accepted: bool, flag: str, tls_flags: str
) -> None:
    """ConfigError unless a token on ``host`` is safe from the path: no token, TLS, a
    loopback ``host``, or the operator said ``flag`` (accepting that anyone on the path
    can read the token and use it). ``tls_flags`` names how to turn TLS on ("": this
    server has no TLS, so the fix is a loopback host)."""
    if not token or tls or accepted or is_loopback(f"{host}:0"):
        return
    fix = f"serve TLS ({tls_flags})" if tls_flags else "listen on loopback only"
    raise ConfigError(
        f"refusing to serve a token in plaintext on {host or '(every interface)'}: anyone on "
        f"the network path can read it and then act as any peer. Fix: {fix}, or pass "
        f"{flag} to accept that risk"
    )
