"""fxbackend.cpu_kernels: filled in by the pattern and kernel issues."""
from . import rope  # noqa: F401
