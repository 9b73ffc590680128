"""Build step of the kit's package (pyproject.toml holds the metadata): the
gRPC stubs are generated from the repository's proto/ into the build, as
the `samplerd.v1` package, with clients/service-config.json beside them, so
an installed kit needs neither the checkout nor grpcio-tools."""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_DIR = os.path.join(HERE, "..", "..", "proto")
SERVICE_CONFIG = os.path.join(HERE, "..", "service-config.json")
PROTO = "samplerd/v1/sampler.proto"


class BuildWithStubs(build_py):
    def run(self):
        super().run()
        import grpc_tools
        from grpc_tools import protoc

        out = self.build_lib
        well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
        rc = protoc.main(["grpc_tools.protoc", f"-I{PROTO_DIR}", f"-I{well_known}",
                          f"--python_out={out}", f"--grpc_python_out={out}", PROTO])
        if rc != 0:
            raise RuntimeError(f"protoc failed on {os.path.join(PROTO_DIR, PROTO)}")
        for d in ("samplerd", os.path.join("samplerd", "v1")):
            open(os.path.join(out, d, "__init__.py"), "a").close()
        shutil.copy(SERVICE_CONFIG, os.path.join(out, "samplerd", "service-config.json"))


setup(cmdclass={"build_py": BuildWithStubs})
