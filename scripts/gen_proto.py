"""Generate the Python protobuf and gRPC modules from protos/ into each package that uses them.

The server (`service/proto`) and the client (`pooling_client.v1`) each carry their own
copy, so that neither imports the other and each installs alone; both are generated from
the one .proto, and the drift test runs this same script into a temporary folder and
compares both copies. Python's protobuf gives both copies the same message classes. The
gRPC module's absolute import of `pooling.v1.pooling_pb2` is rewritten to a relative one.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTO = "pooling/v1/pooling.proto"
# Every home of the generated modules: the client's and the server's.
HOMES = (ROOT / "clients" / "python" / "pooling_client" / "v1", ROOT / "service" / "proto")


def include_paths() -> list[str]:
    """The schema root, protoc's well-known types and googleapis-common-protos' .proto files."""
    well_known = resources.files("grpc_tools") / "_proto"
    import google.rpc.status_pb2 as status_pb2

    googleapis = Path(status_pb2.__file__).resolve().parent.parent.parent
    return [str(PROTO_ROOT), str(well_known), str(googleapis)]


def run_protoc(args: list[str]) -> None:
    includes = [f"-I{path}" for path in include_paths()]
    code = protoc.main(["grpc_tools.protoc", *includes, *args])
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")


def generate(out: Path) -> None:
    staging = out / "_staging"
    staging.mkdir(parents=True, exist_ok=True)
    run_protoc(
        [
            f"--python_out={staging}",
            f"--pyi_out={staging}",
            f"--grpc_python_out={staging}",
            PROTO,
        ]
    )
    generated = staging / "pooling" / "v1"
    for name in ("pooling_pb2.py", "pooling_pb2.pyi", "pooling_pb2_grpc.py"):
        text = (generated / name).read_text()
        text = text.replace("from pooling.v1 import pooling_pb2", "from . import pooling_pb2")
        (out / name).write_text(text)
    for path in sorted(staging.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    staging.rmdir()


def descriptor_set(out_file: Path) -> None:
    """A self-contained descriptor set (imports and comments included) for buf lint."""
    run_protoc(
        [
            "--include_imports",
            "--include_source_info",
            f"--descriptor_set_out={out_file}",
            PROTO,
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--out", type=Path, help="one folder for the modules (default: every home in HOMES)"
    )
    parser.add_argument("--descriptor-set", type=Path, help="write a descriptor set here instead")
    args = parser.parse_args(argv)
    if args.descriptor_set:
        descriptor_set(args.descriptor_set)
    else:
        for out in [args.out] if args.out else HOMES:
            out.mkdir(parents=True, exist_ok=True)
            generate(out)


if __name__ == "__main__":
    sys.exit(main())
