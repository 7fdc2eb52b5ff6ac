"""How the engine-side offload clients reach the daemon: channel, credentials, notifications.

Shared by :class:`~kvbridge.connector.offload.client.OffloadClient` (worker
process) and :class:`~kvbridge.connector.offload.lookup.OffloadLookup`
(scheduler process), and by the daemon for :func:`store_notification`:

- :func:`open_channel`: plaintext, or TLS with ``root_cert`` (PEM of the CA
  that signed the daemon's ``--tls-cert``; ``server_name`` overrides the name
  checked against the certificate);
- :func:`call_metadata`: the shared token as ``kvbridge-token`` metadata, the
  control plane's mechanism (:data:`~kvbridge.connector.control.errors.TOKEN_KEY`);
- :func:`store_notification`: the ``notif_msg`` a worker's WRITE into a
  prepared store carries; the daemon commits the store only after NIXL
  delivered it from the store's writer (the WRITE completed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvbridge.connector.control.errors import TOKEN_KEY

if TYPE_CHECKING:
    import grpc

__all__ = ["STORE_NOTIFY_PREFIX", "call_metadata", "open_channel", "store_notification"]

STORE_NOTIFY_PREFIX = b"kvbridge-offload-store:"
"""A WRITE into a store's slots notifies the daemon with this prefix and the store id."""


def store_notification(store_id: str) -> bytes:
    """The ``notif_msg`` of a WRITE into the slots of ``store_id``."""
    return STORE_NOTIFY_PREFIX + store_id.encode("ascii")


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Metadata every call sends: the token, if any."""
    return () if token is None else ((TOKEN_KEY, token),)


def open_channel(
    address: str,
    options: list[tuple[str, Any]],
    *,
    root_cert: bytes | None = None,
    server_name: str | None = None,
) -> grpc.Channel:
    """A channel to the daemon at ``address``: TLS when ``root_cert`` is given."""
    import grpc

    options = list(options)
    if server_name is not None:
        options.append(("grpc.ssl_target_name_override", server_name))
    if root_cert is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=root_cert)
        return grpc.secure_channel(address, creds, options=options)
    return grpc.insecure_channel(address, options=options)
