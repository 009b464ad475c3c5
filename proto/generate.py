"""Rebuild every artefact generated from the proto: Python modules and Envoy's descriptor set.

Usage: python proto/generate.py [--out-root DIR]

Outputs (relative to the repository root, or to --out-root for drift checks):
  clients/python/src/llmcompletions/v2/completions_pb2{.py,.pyi,_grpc.py}  (the client distribution)
  facade/completions.pb   (descriptor set with imports, for the gRPC-JSON transcoder)
  facade/openapi.json     (the REST surface as OpenAPI 3.1, served by Envoy)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import grpc_tools
from google.api import annotations_pb2
from grpc_tools import protoc
from openapi import openapi_document

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_FILES = ["llmcompletions/v2/completions.proto"]
# Envoy needs these in the descriptor set to turn error details into JSON.
RPC_STATUS_PROTOS = ["google/rpc/status.proto", "google/rpc/error_details.proto"]
PYTHON_OUT = Path("clients/python/src")
DESCRIPTOR_OUT = Path("facade/completions.pb")
OPENAPI_OUT = Path("facade/openapi.json")
API_VERSION = "v2"


def include_paths() -> list[str]:
    """Import roots: our protos, grpc_tools' google/protobuf, googleapis-common-protos."""
    grpc_tools_protos = Path(grpc_tools.__file__).parent / "_proto"
    googleapis_root = Path(annotations_pb2.__file__).parent.parent.parent
    return [str(PROTO_ROOT), str(grpc_tools_protos), str(googleapis_root)]


def run_protoc(args: list[str]) -> None:
    includes = [f"-I{path}" for path in include_paths()]
    exit_code = protoc.main(["grpc_tools.protoc", *includes, *args])
    if exit_code != 0:
        sys.exit(f"protoc failed with exit code {exit_code}: {' '.join(args)}")


def generate(out_root: Path) -> None:
    python_out = out_root / PYTHON_OUT
    descriptor_out = out_root / DESCRIPTOR_OUT
    python_out.mkdir(parents=True, exist_ok=True)
    descriptor_out.parent.mkdir(parents=True, exist_ok=True)
    run_protoc(
        [
            f"--python_out={python_out}",
            f"--pyi_out={python_out}",
            f"--grpc_python_out={python_out}",
            *PROTO_FILES,
        ]
    )
    run_protoc(
        [
            "--include_imports",
            "--include_source_info",
            f"--descriptor_set_out={descriptor_out}",
            *PROTO_FILES,
            *RPC_STATUS_PROTOS,
        ]
    )
    for package_dir in (python_out / "llmcompletions", python_out / "llmcompletions" / "v2"):
        (package_dir / "__init__.py").touch()
    (python_out / "llmcompletions" / "py.typed").touch()
    document = openapi_document(descriptor_out.read_bytes(), API_VERSION)
    (out_root / OPENAPI_OUT).write_text(json.dumps(document, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-root", type=Path, default=REPO_ROOT)
    generate(parser.parse_args().out_root)


if __name__ == "__main__":
    main()
