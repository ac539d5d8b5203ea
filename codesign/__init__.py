"""codesign: co-design a ZHEN recommendation model with its distributed training plan."""

from importlib import metadata

__version__ = metadata.version("codesign")  # pyproject.toml's: bumped with every change that changes results
