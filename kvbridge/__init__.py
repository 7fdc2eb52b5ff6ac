"""kvbridge: KV-cache block transfer and CPU offload for disaggregated prefill/decode.

The four subpackages live at the top of the source tree (``proto/``, ``connector/``,
``worker/``, ``kernels/``); this directory holds relative symlinks to them so that
setuptools, mypy, pyright and IDEs all see one ``kvbridge`` package (docs/DESIGN-NOTES.md,
"Packaging"). Importing it loads nothing else.
"""

from kvbridge.proto.version import __version__

__all__ = ["__version__"]
