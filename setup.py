"""Maps the `flotilla` namespace package, spread over three source roots, for setuptools.

libs/flotilla/<area> (engine and shared code), services/flotilla/<service>, operators/flotilla/<operator>:
each `flotilla.<area>` package is mapped to its folder; its subpackages follow from that mapping.
"""

from pathlib import Path

from setuptools import find_packages, setup

SOURCE_ROOTS = ("libs", "services", "operators")

package_dir: dict[str, str] = {}
packages: list[str] = []
for root in SOURCE_ROOTS:
    namespace_dir = Path(root) / "flotilla"
    if not namespace_dir.is_dir():
        continue
    for area in sorted(p for p in namespace_dir.iterdir() if (p / "__init__.py").exists()):
        package_dir[f"flotilla.{area.name}"] = str(area)
        packages.append(f"flotilla.{area.name}")
        packages += [f"flotilla.{area.name}.{sub}" for sub in find_packages(str(area))]

setup(packages=packages, package_dir=package_dir)
