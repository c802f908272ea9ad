"""fxbackend.cuda_kernels: Triton kernels, one module per pattern family."""

from . import (activation, gated_residual, groupnorm, modulation, rms_rope, rmsnorm,  # noqa: F401
               rope, scale_cast)
from . import int8  # noqa: F401,E402
from . import int8_fusions  # noqa: F401,E402


def _import_triton() -> None:
    """Triton's import (its one-time start-up here; kernels still compile when a plan needs
    them)."""
    import triton  # noqa: F401
    import triton.language  # noqa: F401


import fxbackend as _fxb  # noqa: E402

_fxb.services.register_warm_up("cuda", "triton", _import_triton)
