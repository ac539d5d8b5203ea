"""codesign: co-design a ZHEN recommendation model with its distributed training plan."""

import tomllib
from importlib import metadata
from pathlib import Path


def _version() -> str:
    """pyproject.toml's version (bumped with every change that changes results): from the installed
    package's metadata, else from the checkout it runs from (scripts/python.sh on a GPU machine)."""
    try:
        return metadata.version("codesign")
    except metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"]


__version__ = _version()
