"""fxbackend.cpu_kernels: numba CPU kernels, one module per pattern family."""
from . import (activation, fingerprint, gated_residual, gemm, groupnorm, modulation,  # noqa: F401
               rms_rope, rmsnorm, rope, scale_cast)
from . import int8  # noqa: F401,E402
from . import int8_fusions  # noqa: F401,E402

import fxbackend as _fxb  # noqa: E402

from . import _numba  # noqa: E402

_fxb.services.register_warm_up("cpu", "numba", _numba.warm_up)
_fxb.services.register_concurrency_check("numba", _numba.concurrency_blocker)
