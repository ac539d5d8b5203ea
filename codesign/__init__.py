"""codesign: co-design a ZHEN recommendation model with its distributed training plan."""

__version__ = "0.1.0"
