"""Maps the `flotilla` namespace package, spread over three source roots, for setuptools.

libs/flotilla/<area> (shared libraries and the generated `api` stubs), services/flotilla/<area> (services,
command line, one-machine launcher), operators/flotilla/<area> (Kubernetes operator): each `flotilla.<area>`
package lives in exactly one of them and is mapped to its folder; its subpackages follow from that mapping.
`flotilla` itself is an implicit namespace package (no __init__.py anywhere).
"""

import runpy
from pathlib import Path

from setuptools import find_packages, setup

SOURCE_ROOTS = ("libs", "services", "operators")
HERE = Path(__file__).resolve().parent


def generate_stubs() -> None:
    """flotilla.api from protos/, when grpcio-tools is at hand (it is in the build requirements)."""
    stubs = runpy.run_path(str(HERE / "protos" / "generate_stubs.py"))
    try:
        import grpc_tools  # noqa: F401
    except ImportError:
        if stubs["is_stale"]():
            raise SystemExit("grpcio-tools is needed to generate flotilla.api from protos/")
        return
    if stubs["is_stale"]():
        stubs["generate"]()


def mapped_packages() -> tuple[list[str], dict[str, str]]:
    package_dir: dict[str, str] = {}
    packages: list[str] = []
    for root in SOURCE_ROOTS:
        for area in sorted(p for p in (Path(root) / "flotilla").iterdir() if (p / "__init__.py").exists()):
            name = f"flotilla.{area.name}"
            if name in package_dir:  # one folder per package: a split package breaks the wheel
                raise SystemExit(f"{name} is in two source roots: {package_dir[name]} and {area}")
            package_dir[name] = str(area)
            packages += [name, *(f"{name}.{sub}" for sub in find_packages(str(area)))]
    return packages, package_dir


generate_stubs()
packages, package_dir = mapped_packages()
setup(
    packages=packages,
    package_dir=package_dir,
    # The decode kernel is compiled from its C source on first use, so the source ships with the package.
    package_data={"flotilla.engine.model": ["csrc/*.c", "csrc/*.h"], "flotilla.api": ["**/*.pyi"]},
)
