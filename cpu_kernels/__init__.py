"""fxbackend.cpu_kernels: numba CPU kernels, one module per pattern family."""
from . import (activation, gated_residual, groupnorm, modulation, rms_rope, rmsnorm,  # noqa: F401
               rope, scale_cast)
