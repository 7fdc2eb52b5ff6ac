"""What several test modules share; nothing here is collected as a test.

- ``frames``: the length-prefixed msgpack protocol between a test and a helper process,
  and the helper side's serving loop (``READY {json}`` on stdout, then frames);
- ``peer``: :class:`PeerProc`, the test side of one helper process (a
  :class:`kvbridge.worker.ChildProcess`), and :func:`start_peers`;
- ``transport_peer`` / ``offload_worker``: the helper processes (``python -m``), a
  transport or an :class:`~kvbridge.connector.offload.OffloadClient` each;
- ``offload``: the offload daemon and offload workers as processes;
- ``transport_contract``: the :class:`TransportContract` every transport backend passes.
"""
