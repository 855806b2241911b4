"""Regenerate `ext_proc_pb2.py` (and its `.pyi` stub) from `ext_proc.proto`, next to this file.

Run from anywhere: `python -m gateway.epp.wire.regenerate` (needs `grpcio-tools`, in the test
extra). Only message classes are generated: the server registers the gRPC method itself, so
there is no `_pb2_grpc.py`. `tests/test_epp_wire.py` fails when the checked-in file no longer
matches the .proto (it compiles the .proto again and compares the descriptors).
"""
from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

__all__ = ["PROTO", "REPO_ROOT", "compile_to"]

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent.parent
PROTO = HERE / "ext_proc.proto"


def compile_to(out_dir: Path, *, stubs: bool = True) -> Path:
    """Compile the .proto into `out_dir`/gateway/epp/wire/ext_proc_pb2.py; returns that path."""
    try:
        from grpc_tools import protoc
    except ImportError:
        raise SystemExit("grpcio-tools is needed to regenerate: pip install -e '.[test]'") from None
    well_known = resources.files("grpc_tools") / "_proto"
    rel = PROTO.relative_to(REPO_ROOT).as_posix()  # the descriptor's file name: unique in the pool
    args = ["protoc", f"-I{REPO_ROOT}", f"-I{well_known}", f"--python_out={out_dir}", rel]
    if stubs:
        args.insert(-1, f"--pyi_out={out_dir}")
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"protoc failed ({rc}) on {rel}")
    return Path(out_dir) / "gateway" / "epp" / "wire" / "ext_proc_pb2.py"


def main() -> int:
    compile_to(REPO_ROOT)
    print(f"regenerated {HERE / 'ext_proc_pb2.py'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
