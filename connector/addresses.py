"""``HOST:PORT`` addresses as the connector's config and its peer checks read them.

Pure string and :mod:`ipaddress` work, no gRPC or protobuf: the engine's config
(:mod:`kvbridge.connector.config`) normalizes ``allowed_peers`` with it, and the peer
checks (:mod:`kvbridge.connector.control.peers`) compare a dialed address with them.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from kvbridge.proto.errors import ConfigError

__all__ = ["is_loopback", "normalize_address", "parse_allowed_peers"]

_MAX_ADDRESS_CHARS = 256


def normalize_address(address: str) -> str:
    """``HOST:PORT`` with the host lower-cased and IPv6 brackets kept; ValueError if malformed."""
    if not isinstance(address, str) or not 0 < len(address) <= _MAX_ADDRESS_CHARS:
        raise ValueError(f"address {str(address)[:64]!r} must be 1..{_MAX_ADDRESS_CHARS} chars")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address {address[:64]!r} is not HOST:PORT")
    if not 0 < int(port) <= 65535:
        raise ValueError(f"address {address[:64]!r} is not HOST:PORT (port 1 to 65535)")
    host = host.lower()
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not bare or any(c.isspace() or c in "/@?#[]" for c in bare):
        raise ValueError(f"address {address[:64]!r} has a bad host")
    if ":" in bare:
        host = f"[{ipaddress.IPv6Address(bare).compressed}]"  # ValueError if not IPv6
    return f"{host}:{int(port)}"


def is_loopback(address: str) -> bool:
    """Whether a normalized ``HOST:PORT`` names this host's loopback interface."""
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_allowed_peers(values: Iterable[str], knob: str) -> tuple[str, ...]:
    """Normalized, de-duplicated ``HOST:PORT`` entries; ConfigError naming ``knob`` if bad."""
    out: list[str] = []
    for value in values:
        try:
            addr = normalize_address(value)
        except ValueError as exc:
            raise ConfigError(f"{knob}: {exc}") from None
        if addr not in out:
            out.append(addr)
    return tuple(out)
