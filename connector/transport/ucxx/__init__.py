"""The optional second transport: host memory over UCX tagged messages (``kvbridge[ucxx]``).

Modules: ``config`` (settings, lazy ucxx import), ``worker`` (the UCX worker and its
endpoints), ``wire`` (message formats and the protocol), ``handle`` (one transfer), ``links``
(links, peers, hello), ``service`` (the owner's thread answering peers' READ/WRITE
requests), ``transport`` (the seam).
"""

from kvbridge.connector.transport.ucxx.transport import UcxxConfig, UcxxStats, UcxxTransport

__all__ = ["UcxxConfig", "UcxxStats", "UcxxTransport"]
