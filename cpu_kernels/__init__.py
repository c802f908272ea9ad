"""fxbackend.cpu_kernels: filled in by the pattern and kernel issues."""
from . import rms_rope, rmsnorm, rope  # noqa: F401
