"""What several test modules share; nothing here is collected as a test.

- ``frames``: the length-prefixed msgpack protocol between a test and a helper process,
  and the helper side's loop (``READY {json}`` on stdout, then frames);
- ``peer``: :class:`PeerProc`, the test side of one helper process (a
  :class:`kvbridge.worker.ChildProcess`), :func:`start_peers`, and the attack tests'
  token holder (:func:`attacker_peer`, behind the ``attacker`` fixture);
- ``transport_peer`` / ``offload_worker``: the helper processes (``python -m``), a
  transport or an :class:`~kvbridge.connector.offload.OffloadClient` each;
- ``offload``: the offload daemon and offload workers as processes;
- ``transport_contract``: the :class:`TransportContract` every transport backend passes;
- ``nodes``: a prefill and a decode node (``kvbridge serve``) with a router, for P/D tests;
- ``engine``: the in-process reference engine run to the end of its requests;
- ``fresh``: code run in a fresh interpreter (what an import loads);
- ``vllm``: the vLLM tests' environment and models, or a skip; ``tiny_models`` (run in
  ``.venv-vllm``) writes the tiny models of kinds other than Llama;
- ``descs``: an oracle that expands NIXL's strided descriptor tables.

Fixtures live in ``tests/conftest.py``.
"""
