"""powerd: power steering for GPU AI factories."""

__version__ = "0.1.0"
