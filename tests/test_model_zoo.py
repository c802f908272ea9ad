"""Correctness over many diffusers architectures (tests/model_zoo.py: 24 tiny models beyond
``fxbackend.models``' table): each through ``torch.compile(backend="fxbackend")`` against eager.

- float32: every output within 1e-5 of eager (relative to its largest value);
- bf16: bit for bit eager's, except four models noted at ``BF16_NOT_EXACT``.

Graph breaks are the models' (HiDream's expert routing, Mochi's ``nonzero``, Lumina 2's
``.tolist()``): every piece between them runs through fxbackend.
"""
from __future__ import annotations

import pathlib
import re
import sys

import pytest
import torch

import fxbackend
from fxbackend.replay import ReplayError

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from ext_util import rel_err  # noqa: E402
from model_zoo import ZOO, build  # noqa: E402

#: bf16 outputs that differ from eager's by bf16 rounding, and why (measured: these and
#: Inductor's errors on the same models)
BF16_NOT_EXACT = {
    # group_norm_silu's float32 moments are summed in another order than torch's: at a few
    # shapes (48 channels in 8 groups at 16x16) some bf16 roundings move by one unit; 3.6e-3
    # at the output (Inductor 1.8e-2); unfused it is exact
    "kandinsky22_unet": 1e-2,
    # unfused and with every rewrite off too (1.9e-3 and 5.7e-3; Inductor 1.3e-2 and
    # 1.4e-2): the traced ATen graph itself gives some group norms a channels-last input where
    # eager's is NCHW.  Fake tensors stride a size-1 batch dim differently from eager after
    # the attention's transpose + reshape (and the VAE's division by a number), so
    # group_norm's contiguous(suggest_memory_format()) was a no-op at trace time and is not in
    # the graph; the channels-last group-norm kernel sums in another order and one bf16
    # rounding moves.  Every node of fxbackend's plan equals plain torch on the same inputs
    # and strides (checked node by node); torch's own aot_eager raises on these graphs in bf16
    "vae_decode": 1e-2,
    "kandinsky21_unet": 1e-2,
    # channels_last_convs: the RMS norm of every block (F.normalize over the channels) sums
    # its float32 squares along the channels-last rows, in another order than over eager's
    # NCDHW channel planes; on an AVX-512 CPU some bf16 roundings move (6.8e-3 at the output;
    # Inductor 2.0e-2), with the rule off it is exact
    "wanvae_decode": 1e-2,
}


#: ``rope`` rewrites per compiled model, for the models whose RoPE form has a rule of its own
#: (patterns/rope.py): HiDream's rotation matrices (q and k of its two attention layers) and
#: Lumina 2's complex128 frequencies (q and k of its two layers and two refiner layers, as
#: sd.rope_apply_f64.v1).
#: Measured in float32 and bf16; the other models are not counted here
ROPE_REWRITES = {"hidream": 4, "lumina2": 8}


def _channels_last_bf16_conv_is_exact() -> bool:
    """Whether this CPU's bf16 3x3 convolution gives the same bits channels-last as NCHW.
    On CPUs with native bf16 (AVX-512 BF16, AMX) oneDNN sums both in one order; on AVX2-only
    CPUs it does not, so a model that ``channels_last_convs`` rewrites is within bf16
    roundings of eager there, not bit for bit (the controlnet: 7e-3, exact with the rule off)."""
    g = torch.Generator().manual_seed(0)
    cl = torch.channels_last
    for c, hw in ((4, 16), (32, 16), (64, 8), (64, 16)):
        x = torch.randn(1, c, hw, hw, generator=g).bfloat16()
        w = (torch.randn(c, c, 3, 3, generator=g) * 0.1).bfloat16()
        if not torch.equal(torch.nn.functional.conv2d(x, w, padding=1),
                           torch.nn.functional.conv2d(x.contiguous(memory_format=cl),
                                                      w.contiguous(memory_format=cl), padding=1)):
            return False
    return True


def _tensors(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


def _run(name, dtype):
    model, kw = build(name, dtype)
    with torch.no_grad():
        ref = _tensors(model(**kw))
        torch._dynamo.reset()
        fxbackend.reset_stats()
        out = _tensors(torch.compile(model, backend="fxbackend")(**kw))
    assert ref and len(out) == len(ref)
    if name in ROPE_REWRITES:
        assert fxbackend.stats()["rewrites_by_rule"].get("rope", 0) == ROPE_REWRITES[name]
    return ref, out


@pytest.mark.parametrize("name", sorted(ZOO))
def test_float32_matches_eager(name):
    ref, out = _run(name, torch.float32)
    assert fxbackend.stats()["fallback_graphs"] == 0
    for r, o in zip(ref, out):
        assert o.dtype == r.dtype and o.shape == r.shape
        assert rel_err(o, r) <= 1e-5


@pytest.mark.parametrize("name", sorted(ZOO))
def test_bf16_is_eager_bit_for_bit(name):
    ref, out = _run(name, torch.bfloat16)
    relaid = fxbackend.stats()["rewrites_by_rule"].get("channels_last_convs", 0) > 0
    for r, o in zip(ref, out):
        assert o.dtype == r.dtype and o.shape == r.shape
        if name in BF16_NOT_EXACT:
            assert rel_err(o, r) <= BF16_NOT_EXACT[name]
        elif relaid and not _channels_last_bf16_conv_is_exact():
            assert rel_err(o, r) <= 1e-2
        else:
            assert torch.equal(o, r)


#: models that torch.export (non-strict) cannot export, with the cause: code of the model that
#: reads tensor values in Python, which one traced graph cannot hold; the export raises a
#: ReplayError naming the model's line (every other model of the zoo round-trips at batch 1
#: and 2; Mochi's data-dependent nonzero runs between stages of its plan)
NO_EXPORT = {
    "hidream": "its MoE feed-forward in eval mode (MOEFeedForwardSwiGLU.moe_infer) reads the "
               "routed expert indices in Python (bincount().cpu().numpy(), then a loop over "
               "the experts by token count): data-dependent Python control flow, at batch 1 "
               "and 2",
    "lumina2": "its RoPE embedder reads the caption lengths from the mask "
               "(attention_mask.sum(dim=1).tolist()) and forward hashes the sequence lengths "
               "made from them (len(set(seq_lengths))): torch.export traces those integers "
               "symbolically and cannot hash them",
}


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, raises=ReplayError,
                                            reason=NO_EXPORT[n]))
    if n in NO_EXPORT else n for n in sorted(ZOO)])
def test_saved_plan_loads_and_replays(name, batch, tmp_path):
    """Every zoo model exported (default options, no dynamic_shapes), saved, loaded and
    replayed: the loaded plan gives the exported plan's bits, within 1e-5 of eager.  Some
    models' recorded layouts differ from torch's meta functions' on size-1 dims (a batch of
    one in channels-last after a view, Wan's VAE's 3-D causal convolutions)."""
    model, kw = build(name, torch.float32, batch=batch)
    with torch.no_grad():
        ref = _tensors(model(**kw))
    plan = fxbackend.export(model, (), kw)
    got = _tensors(plan(**kw))
    plan.save(tmp_path / "plan.fxb")
    back = _tensors(fxbackend.load(tmp_path / "plan.fxb")(**kw))
    assert len(back) == len(got) == len(ref)
    for r, g, b in zip(ref, got, back):
        assert torch.equal(b, g) and rel_err(b, r) <= 1e-5


#: per model of NO_EXPORT: the model's line its export error names, and the cause it gives
EXPORT_ERRORS = {
    "hidream": (r"transformer_hidream_image\.py:\d+ in moe_infer: tokens_per_expert = "
                r"flat_expert_indices\.bincount\(\)\.cpu\(\)\.numpy\(\)",
                r"converts a tensor to numpy"),
    "lumina2": (r"transformer_lumina2\.py:\d+ in forward: use_mask = len\(set\(seq_lengths\)\)",
                r"hashes a traced integer"),
}


@pytest.mark.parametrize("name", sorted(NO_EXPORT))
def test_export_error_names_the_models_line_and_the_cause(name):
    """A model torch.export cannot trace gets a ReplayError naming the line of the model's code
    and why (not torch's internal error alone, which says neither)."""
    model, kw = build(name, torch.float32)
    line, cause = EXPORT_ERRORS[name]
    with pytest.raises(ReplayError, match=rf"cannot trace {type(model).__name__}: .*{cause}") \
            as info:
        fxbackend.export(model, (), kw)
    assert re.search(line, str(info.value)), str(info.value)
