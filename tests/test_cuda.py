"""CUDA checks (marked ``cuda``; skipped without a GPU): the diffusers models on the GPU through
fxbackend against eager, static and dynamic shapes, arena on the device."""
from __future__ import annotations

import pytest
import torch

import fxbackend
from fxbackend import models
from ext_util import rel_err as _rel_err

pytestmark = pytest.mark.cuda
FAMILIES = ["flux", "sd3", "pixart", "unet"]


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_models_on_cuda_float32(family, dynamic):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = models.build_model(family, "tiny", device="cuda")
    resolutions = models.MODEL_CONFIGS[(family, "tiny")]["inputs"]["resolutions"][:2]
    with torch.no_grad():
        compiled = torch.compile(model, backend="fxbackend", dynamic=dynamic)
        for res in resolutions:
            inputs = models.make_inputs(family, "tiny", resolution=res, device="cuda")
            ref = models.run_eager(model, inputs)
            out = models.run_eager(compiled, inputs)
            assert out.device.type == "cuda"
            assert _rel_err(out, ref) <= 1e-5, (family, res)
    s = fxbackend.stats()
    assert s["fallback_graphs"] == 0 and s["arena_bytes"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_models_on_cuda_bfloat16(family):
    model = models.build_model(family, "tiny", device="cuda", dtype=torch.bfloat16)
    inputs = models.make_inputs(family, "tiny", device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = models.run_eager(model, inputs)
        out = models.run_eager(torch.compile(model, backend="fxbackend"), inputs)
    # the same ATen kernels run in the same order: results agree to bf16 rounding at most
    assert _rel_err(out, ref) <= 1e-2


def test_plan_arena_lives_on_the_device():
    def f(x, w):
        return torch.relu(x @ w).sin() * 2 + 1

    x = torch.randn(64, 64, device="cuda")
    w = torch.randn(64, 64, device="cuda")
    with torch.no_grad():
        out = torch.compile(f, backend="fxbackend")(x, w)
    torch.testing.assert_close(out, f(x, w))
    assert out.device.type == "cuda"
    assert fxbackend.stats()["arena_bytes"] > 0
