"""Regenerate the committed protobuf/gRPC stubs from ``proto/*.proto``.

Run ``python -m kvbridge.proto.generate`` after editing a ``.proto`` file (it
needs the ``dev`` extra: ``grpcio-tools`` and ``mypy-protobuf``). Every
``.proto`` file next to this module is copied into a temporary include tree as
``kvbridge/proto/<name>.proto`` so that generated code imports its siblings as
``kvbridge.proto.<name>_pb2``, and one ``.proto`` may import another as
``"kvbridge/proto/<name>.proto"``. ``--out DIR`` writes elsewhere (the
regeneration test compares that with the committed files).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

__all__ = ["PROTO_DIR", "generate", "generated_names", "main"]

PROTO_DIR = Path(__file__).resolve().parent
_PACKAGE = Path("kvbridge", "proto")


def generated_names(proto_dir: Path = PROTO_DIR) -> list[str]:
    """The files :func:`generate` writes for the ``.proto`` files in ``proto_dir``."""
    names = []
    for proto in sorted(proto_dir.glob("*.proto")):
        stem = proto.stem
        names += [
            f"{stem}_pb2.py",
            f"{stem}_pb2.pyi",
            f"{stem}_pb2_grpc.py",
            f"{stem}_pb2_grpc.pyi",
        ]
    return names


def _plugin(name: str) -> str:
    """Path of a protoc plugin installed next to this Python (venvs are not always on PATH)."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} not found; install the dev extra (pip install 'kvbridge[dev]')")
    return found


def generate(out_dir: Path = PROTO_DIR, proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Generate ``*_pb2.py``, ``*_pb2_grpc.py`` and their ``.pyi`` types into ``out_dir``."""
    from importlib.resources import files

    from grpc_tools import protoc

    protos = sorted(proto_dir.glob("*.proto"))
    if not protos:
        raise RuntimeError(f"no .proto files in {proto_dir}")
    with tempfile.TemporaryDirectory() as tmp:
        include = Path(tmp, "include")
        gen = Path(tmp, "gen")
        (include / _PACKAGE).mkdir(parents=True)
        gen.mkdir()
        for proto in protos:
            shutil.copyfile(proto, include / _PACKAGE / proto.name)
        args = [
            "grpc_tools.protoc",
            f"-I{include}",
            f"-I{files('grpc_tools') / '_proto'}",
            f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
            f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
            f"--python_out={gen}",
            f"--mypy_out={gen}",
            f"--grpc_python_out={gen}",
            f"--mypy_grpc_out=only_sync:{gen}",  # no grpc.aio overloads: kvbridge is sync
            *(str(_PACKAGE / p.name) for p in protos),
        ]
        code = protoc.main(args)
        if code != 0:
            raise RuntimeError(f"protoc failed with exit code {code}: {' '.join(args)}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in generated_names(proto_dir):
            target = out_dir / name
            shutil.copyfile(gen / _PACKAGE / name, target)
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=PROTO_DIR, help="output directory")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
