"""Package discovery only (metadata is in pyproject.toml).

The repository keeps the command line in a top-level `cli/` folder and the recipes in a
top-level `examples/` folder, but they install as the subpackages `relax.cli` and
`relax.examples`: top-level modules named `cli` or `examples` would clash with other projects,
and `relax init` reads the recipes from the installed package (`importlib.resources`), so it
works from a wheel as well as from a checkout.
"""

from setuptools import find_namespace_packages, find_packages, setup

packages = find_packages(include=["relax", "relax.*"])
packages += ["relax.cli" + name[len("cli") :] for name in find_packages(include=["cli", "cli.*"])]
# Recipe folders have no __init__.py (they are not meant to be imported as packages), so they
# are listed as namespace packages: their files travel as the data `relax init` copies — the
# cluster.toml and what it imports (agent programs) or reads.
recipes = [
    f"relax.{name}"
    for name in find_namespace_packages(include=["examples.*"], exclude=["*__pycache__*"])
]
packages += ["relax.examples", *recipes]
package_dir = {"relax": "relax", "relax.cli": "cli", "relax.examples": "examples"}
package_data = {name: ["*.toml", "*.md", "*.json", "*.jsonl"] for name in recipes}

setup(packages=packages, package_dir=package_dir, package_data=package_data)
