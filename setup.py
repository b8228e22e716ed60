"""Maps the top-level source folders onto the ``polyspec`` import package (docs/architecture.md, "Layers").

pyproject.toml holds all metadata; this file only computes the package list, so that a new
sub-package under core/, backends/ or kernels/ is picked up without editing a list.
"""

from setuptools import find_packages, setup

ROOTS = {"polyspec": "core", "polyspec.backends": "backends", "polyspec.kernels": "kernels"}

packages = []
package_dir = {}
for pkg, folder in ROOTS.items():
    packages.append(pkg)
    package_dir[pkg] = folder
    for sub in find_packages(where=folder):
        packages.append(f"{pkg}.{sub}")
        package_dir[f"{pkg}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={
        "polyspec": ["heads/*/*.json", "heads/*/*.safetensors", "heads/*/*.md"],
        "polyspec.bench": ["data/*.jsonl", "data/*.md"],
        "polyspec.backends": ["cpu/*.cpp"],
    },
)
