"""Package discovery only (metadata is in pyproject.toml).

The repository keeps the command line in a top-level `cli/` folder, but it installs as the
subpackage `relax.cli`: a top-level module named `cli` would clash with other projects.
"""

from setuptools import find_packages, setup

packages = find_packages(include=["relax", "relax.*"])
packages += ["relax.cli" + name[len("cli") :] for name in find_packages(include=["cli", "cli.*"])]
package_dir = {"relax": "relax", "relax.cli": "cli"}

setup(packages=packages, package_dir=package_dir)
