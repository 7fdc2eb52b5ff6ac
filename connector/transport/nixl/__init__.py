"""The default transport: NIXL (UCX underneath: RDMA, TCP, shared memory, CMA).

Modules: ``config`` (settings, lazy nixl import), ``agent`` (the NIXL agent
behind one lock, and our progress thread), ``handle`` (one transfer),
``transport`` (the seam: registrations, links, posting, notifications). The
descriptor tables live beside this package in ``nixl_descs``. Importing this
package loads neither nixl nor torch.
"""

from kvbridge.connector.transport.nixl.config import NixlConfig, load_nixl
from kvbridge.connector.transport.nixl.handle import NixlTransferHandle
from kvbridge.connector.transport.nixl.transport import NixlTransport

__all__ = ["NixlConfig", "NixlTransport", "NixlTransferHandle", "load_nixl"]
