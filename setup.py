"""Packages of the wheel: `engine/` and `service/` installed under the one import root
`pooling_server` (metadata and dependencies are in pyproject.toml)."""

from setuptools import find_packages, setup

ROOTS = ("engine", "service")

setup(
    packages=["pooling_server"]
    + [f"pooling_server.{name}" for name in find_packages(include=[f"{r}*" for r in ROOTS])],
    package_dir={"pooling_server": "pooling_server"}
    | {f"pooling_server.{root}": root for root in ROOTS},
)
