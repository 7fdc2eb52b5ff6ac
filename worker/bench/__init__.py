"""``kvbridge bench ...``: one module per benchmark; each prints a table and writes
JSON + PNG (``report``). Modules load torch, NIXL or gRPC only inside ``run``."""
