"""The default transport: NIXL (UCX underneath: RDMA, TCP, shared memory, CMA).

Modules: ``config`` (settings, lazy nixl import), ``agent`` (the NIXL agent
behind one lock, and our progress thread), ``handle`` (one transfer),
``transport`` (the seam: registrations, links, posting, notifications). The
descriptor tables live beside this package in ``nixl_descs``. Importing this
package loads neither nixl nor torch.
"""

from kvbridge.connector.transport.nixl.agent import (
    FD_TABLE_SLOTS,
    NixlAgent,
    fd_table_size,
    reserve_fd_table,
)
from kvbridge.connector.transport.nixl.config import NixlConfig, load_nixl
from kvbridge.connector.transport.nixl.handle import NixlTransferHandle
from kvbridge.connector.transport.nixl.transport import NixlTransport

__all__ = [
    "FD_TABLE_SLOTS",
    "NixlAgent",
    "NixlConfig",
    "NixlTransport",
    "NixlTransferHandle",
    "fd_table_size",
    "load_nixl",
    "reserve_fd_table",
]
