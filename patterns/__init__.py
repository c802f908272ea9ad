"""fxbackend.patterns: one module per pattern family (ops, idiom recognition, fusion rules).

Importing this package registers every family through the public extension API.
"""
from . import activation, gated_residual, groupnorm, modulation, rmsnorm, rope, scale_cast  # noqa: F401
from . import int8  # noqa: F401,E402  (INT8 W8A8 ops)
from . import int8_fusions  # noqa: F401,E402  (fusions around the INT8 ops)
from . import quantize  # noqa: F401,E402  (the quantize option; its ops come from int8)
from . import attention  # noqa: F401,E402  (the attention_dtype option)
from . import identity  # noqa: F401,E402  (multiplications/divisions by 1 dropped)
from . import conv_layout  # noqa: F401,E402  (patch-embedding convolutions in channels-last)
from . import channels_last  # noqa: F401,E402  (16-bit convolutional networks channels-last)
from . import upsample  # noqa: F401,E402  (nearest upsampling by index -> upsample_nearest2d)
from . import upcast  # noqa: F401,E402  (16-bit GEMMs in float32 where the CPU profile says)
