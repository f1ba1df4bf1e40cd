"""Build step of capctl's PEP 517 build (setuptools.build_meta): everything is in pyproject.toml
except two things ``build_py`` adds while building, so that an sdist or a wheel never depends on
the Makefile:

1. the gRPC/protobuf code ``capctl/v1/*_pb2*.py`` generated from ``protos/`` by
   ``grpc_tools.protoc`` (a build requirement, see ``[build-system]``);
2. the shipped files of :data:`capctl.resources.SOURCES` (systemd units, example policies, the
   dashboard, the status schema) copied under ``capctl/share/``.

In an editable install (``pip install -e .``) the code is generated in place (as ``make build``
does) and nothing is copied (capctl.resources then reads the checkout).
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _resources():
    spec = importlib.util.spec_from_file_location("_capctl_resources", HERE / "capctl" / "resources.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def generate_protos(out_dir: Path) -> list[Path]:
    """Run grpc_tools.protoc on every ``protos/**/*.proto`` into ``out_dir``; returns the files made.

    Raises:
        RuntimeError: protoc failed (its messages are on stderr).
    """
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(HERE / "protos")) for p in (HERE / "protos").rglob("*.proto"))
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = ["grpc_tools.protoc", f"-I{HERE / 'protos'}", f"-I{well_known}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"grpc_tools.protoc failed on {protos}")
    return sorted(out_dir.joinpath("capctl", "v1").glob("*_pb2*.py*"))


class BuildPyWithProtos(build_py):
    """setuptools build_py + the generated protocol code + the shipped files under capctl/share/."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            generate_protos(HERE)
            return
        build_lib = Path(self.build_lib)
        generate_protos(build_lib)
        share = build_lib / "capctl" / "share"
        for name, (source, patterns) in _resources().SOURCES.items():
            for pattern in patterns:
                for f in sorted((HERE / source).glob(pattern)):
                    dest = share / name / f.relative_to(HERE / source)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(f, dest)


setup(cmdclass={"build_py": BuildPyWithProtos})
