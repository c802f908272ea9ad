"""Steps computed from weights alone (a weight cast, a weight's channels-last copy) run once and
again only when a weight changes (``Plan.cached``, executor ``_weight_derived``)."""
from __future__ import annotations

import pytest
import torch

import fxbackend


class _CastWeight(torch.nn.Module):
    """``x @ w.to(x.dtype).t()``: the cast of the float32 weight is weight-derived."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(8, 16, generator=g))

    def forward(self, x):
        return x @ self.w.to(x.dtype).t().contiguous()


def _compile(model, x, options=None):
    torch._dynamo.reset()
    with fxbackend.record_graphs() as graphs:
        c = torch.compile(model, backend="fxbackend", options=options or {})
        out = c(x)
    (g,) = graphs
    (plan,) = g.all_plans()
    return c, plan, out


def _values(plan):
    return plan.derived_values()


@pytest.mark.usefixtures("no_grad")
def test_weight_steps_run_once_until_the_weight_changes():
    model = _CastWeight()
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    fxbackend.reset_stats()
    c, plan, out = _compile(model, x)
    assert torch.equal(out, model(x))
    cached_ops = sorted(n.op for n in plan.cached)
    assert cached_ops == ["aten._to_copy.default", "aten.clone.default"]
    assert fxbackend.stats()["weight_steps_cached"] == 2
    assert "kept between calls: 2" in plan.report()
    first = _values(plan)
    assert all(isinstance(v, torch.Tensor) for v in first.values())
    # an unchanged weight: the same values, not recomputed
    assert torch.equal(c(x), model(x))
    assert all(v is first[n] for n, v in _values(plan).items())
    # an in-place update (a LoRA fuse) bumps the version: recomputed, the result follows
    model.w.mul_(-0.5)
    assert torch.equal(c(x), model(x))
    second = _values(plan)
    assert all(v is not first[n] for n, v in second.items())
    # new storage behind the same parameter (another address)
    model.w.data = torch.randn(8, 16)
    assert torch.equal(c(x), model(x))
    assert all(v is not second[n] for n, v in _values(plan).items())


def test_inference_mode_weights_are_derived_every_call():
    """A tensor created in inference mode has no version counter: no staleness check is
    possible, so its steps run on every call (still correct after an in-place update)."""
    with torch.inference_mode():
        model = _CastWeight()
        x = torch.randn(4, 16, dtype=torch.bfloat16)
        c, plan, out = _compile(model, x)
        assert torch.equal(out, model(x))
        before = _values(plan)
        model.w.mul_(3.0)
        assert torch.equal(c(x), model(x))
        assert all(v is not before[n] for n, v in _values(plan).items())


@pytest.mark.usefixtures("no_grad")
def test_user_inputs_and_cuda_graph_plans_are_not_cached():
    # a step reading a user input is per call
    def fn(x, w):
        return x @ w.to(x.dtype).t().contiguous()
    torch._dynamo.reset()
    with fxbackend.record_graphs() as graphs:
        c = torch.compile(fn, backend="fxbackend")
        w = torch.randn(8, 16)
        x = torch.randn(4, 16, dtype=torch.bfloat16)
        c(x, w)
    (plan,) = graphs[0].all_plans()
    assert not plan.cached
    w.mul_(2)
    assert torch.equal(c(x, w), fn(x, w))
    # under cuda_graphs a replay could neither skip nor redo the step: nothing is cached
    _, plan, _ = _compile(_CastWeight(), x, {"cuda_graphs": True})
    assert not plan.cached


class _Crop(torch.nn.Module):
    """``x + pos[:, :n].clone()``: SD3's crop of a positional embedding larger than the input."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = torch.nn.Parameter(torch.randn(1, 8, 8, 16, generator=torch.Generator()
                                                  .manual_seed(0)))

    def forward(self, x):  # x: [1, 4, 16], the pos rows of a 2 x 2 patch
        return x * 2 + self.pos[:, 2:4, 2:4].contiguous().view(1, 4, 16)


@pytest.mark.usefixtures("no_grad")
def test_a_small_copy_of_a_large_weight_is_redone_not_checked():
    """Keeping a 2 x 2 crop of an 8 x 8 weight would fingerprint all 64 rows every call;
    redoing it copies 4: it runs every call, named in the report, and follows the weight."""
    model = _Crop()
    x = torch.randn(1, 4, 16)
    _, plan, out = _compile(model, x)
    c = torch.compile(model, backend="fxbackend")
    assert torch.equal(out, model(x))
    redone = plan.state.recomputed
    assert redone and not plan.cached
    assert all(b == 64 * 16 * 4 for b in redone.values())
    assert "redone every call (cheaper than checking their weights)" in plan.report()
    model.pos.data[:, 2:4, 2:4].mul_(-3.0)  # .data: no version counter moves
    assert torch.equal(c(x), model(x))


@pytest.mark.usefixtures("no_grad")
def test_a_weight_cast_is_kept_whatever_its_size():
    """A cast's result is at least half its weight's bytes: kept, never redone."""
    _, plan, _ = _compile(_CastWeight(), torch.randn(4, 16, dtype=torch.bfloat16))
    assert plan.cached and not plan.state.recomputed


# -- every way users change weights, on whole models -----------------------------------------
# A model compiled and run once, then its weights changed by one path; the next compiled call
# must be what a freshly compiled plan gives (bit for bit) and eager's within the dtype's
# tolerance.  On the code before fxbackend.weights, ``.data`` writes left the bf16 UNet's
# channels-last weight copies and the W8A8 plans' quantized weights stale.

def _perturb(p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A new value for ``p``: different in every element, of the same scale."""
    return (p.float() * 0.5 + 0.5 * p.float().std().nan_to_num() *
            torch.randn(p.shape, generator=gen)).to(p.dtype)


def _modules_with_weight(model):
    return [m for m in model.modules()
            if isinstance(getattr(m, "weight", None), torch.nn.Parameter)]


def _change_inplace(model, gen):  # in place under no_grad: bumps the version counter
    for p in model.parameters():
        p.copy_(_perturb(p, gen))


def _change_data(model, gen):  # through .data: the version counter does not move
    for p in model.parameters():
        p.data.copy_(_perturb(p, gen))


def _change_ema(model, gen):  # ema_p.data.mul_(d).add_(p.data, alpha=1 - d)
    for p in model.parameters():
        other = _perturb(p, gen)
        p.data.mul_(0.5).add_(other, alpha=0.5)


def _change_new_storage(model, gen):  # p.data = new tensor
    for p in model.parameters():
        p.data = _perturb(p, gen)


def _change_load_state_dict(model, gen):
    model.load_state_dict({k: _perturb(v, gen) for k, v in model.state_dict().items()})


def _change_load_state_dict_assign(model, gen):  # new Parameter objects
    model.load_state_dict({k: _perturb(v, gen) for k, v in model.state_dict().items()},
                          assign=True)


def _change_reassign(model, gen):  # module.weight = nn.Parameter(...)
    for m in _modules_with_weight(model):
        m.weight = torch.nn.Parameter(_perturb(m.weight, gen), requires_grad=False)


CHANGES = {
    "in_place": _change_inplace, "data": _change_data, "ema": _change_ema,
    "new_storage": _change_new_storage, "load_state_dict": _change_load_state_dict,
    "load_state_dict_assign": _change_load_state_dict_assign, "reassign": _change_reassign,
}

#: (family, dtype, options, tolerance against eager: max |diff| / max |eager|)
MODELS = {
    "unet_bf16": ("unet", torch.bfloat16, {}, 3e-2),
    "flux_f32": ("flux", torch.float32, {}, 1e-4),
    "flux_w8a8": ("flux", torch.float32, {"quantize": "w8a8", "quantize_min_size": 0}, 5e-2),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _remade(compiled, inputs):
    """``compiled``'s output with every derived value made again from the weights as they are
    now (each cell emptied, as when its weight goes): what a fresh plan computes from them,
    without compiling one (a compile of the tiny bf16 UNet takes seconds)."""
    from fxbackend import weights
    for c in weights.live_cells():
        c.clear()
    return compiled(**inputs)[0]


@pytest.mark.usefixtures("no_grad")
@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("which", sorted(MODELS))
def test_every_weight_change_path_is_seen(which, change):
    from fxbackend import models
    family, dtype, options, tol = MODELS[which]
    model = models.build_model(family, "tiny", dtype=dtype)
    inputs = models.make_inputs(family, "tiny", dtype=dtype)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxbackend", options=options)
    before = compiled(**inputs)[0]
    assert _rel(before, model(**inputs)[0]) <= tol
    CHANGES[change](model, torch.Generator().manual_seed(1))
    after = compiled(**inputs)[0]
    eager = model(**inputs)[0]
    assert _rel(eager, before) > 10 * tol, "the change must move the output"
    assert _rel(after, eager) <= tol, f"{which} after {change}: stale"
    assert torch.equal(after, _remade(compiled, inputs)), \
        f"{which} after {change}: not what the weights give now"


@pytest.mark.usefixtures("no_grad")
@pytest.mark.parametrize("which", sorted(MODELS))
def test_lora_adapters_set_fused_unfused_and_unloaded(which):
    """peft LoRA adapters through diffusers' adapter API: two adapters, switched with
    ``set_adapters``, fused into the base weights (``safe_fusing=False``: peft adds the delta
    to ``base_layer.weight.data``, which the version counter does not see), unfused (the same
    graph: no recompilation) and unloaded; every compiled call within the tolerance of eager."""
    pytest.importorskip("peft")
    from peft import LoraConfig
    from fxbackend import models
    family, dtype, options, tol = MODELS[which]
    model = models.build_model(family, "tiny", dtype=dtype)
    inputs = models.make_inputs(family, "tiny", dtype=dtype)
    targets = ["to_q", "to_k", "to_v"] + (["conv1", "conv2"] if family == "unet" else [])
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=targets), adapter_name="a")
    model.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=targets), adapter_name="b")
    gen = torch.Generator().manual_seed(3)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: a LoRA that changes nothing
            p.copy_(0.3 * torch.randn(p.shape, generator=gen).to(p.dtype))
    model.set_adapters(["a"])
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxbackend", options=options)
    base = model(**inputs)[0]

    def check(step: str) -> torch.Tensor:
        eager = model(**inputs)[0]
        assert _rel(compiled(**inputs)[0], eager) <= tol, f"{which}: {step}"
        return eager

    check("adapter a")
    model.set_adapters(["a", "b"], [1.0, 0.5])
    mixed = check("set_adapters a + 0.5 b")
    assert _rel(mixed, base) > 2 * tol, "the adapters must move the output"
    model.fuse_lora(lora_scale=1.0, safe_fusing=False)
    check("fused")
    model.unfuse_lora()
    # the unfused graph is the one compiled before the fuse; its weights are back only up to
    # the roundings of adding and subtracting the delta: a value derived before would be stale
    unfused = compiled(**inputs)[0]
    check("unfused")
    assert torch.equal(unfused, _remade(compiled, inputs)), f"{which}: unfused is stale"
    model.unload_lora()
    check("unloaded")


#: the changes a frozen weight's check still sees (through the weight itself, or new storage
#: or new Parameter objects), and those it does not (writes through a ``.data`` alias)
SEEN_FROZEN = ("in_place", "new_storage", "load_state_dict", "load_state_dict_assign",
               "reassign")
UNSEEN_FROZEN = ("data", "ema")


def _count_fingerprints(monkeypatch) -> list:
    from fxbackend import weights
    calls = []
    fp = weights._FINGERPRINTS["cpu"]
    monkeypatch.setitem(weights._FINGERPRINTS, "cpu", lambda t: calls.append(t) or fp(t))
    return calls


@pytest.mark.usefixtures("no_grad")
@pytest.mark.parametrize("change", SEEN_FROZEN)
@pytest.mark.parametrize("which", ["unet_bf16", "flux_w8a8"])
def test_frozen_weights_skip_the_fingerprint_and_still_see_changes_through_themselves(
        which, change, monkeypatch):
    from fxbackend import models
    family, dtype, options, tol = MODELS[which]
    model = models.build_model(family, "tiny", dtype=dtype)
    inputs = models.make_inputs(family, "tiny", dtype=dtype)
    assert fxbackend.freeze_weights(model) == len([*model.parameters(), *model.buffers()])
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxbackend", options=options)
    compiled(**inputs)
    calls = _count_fingerprints(monkeypatch)
    before = compiled(**inputs)[0]
    assert calls == [], "a frozen weight's check read its bytes"
    CHANGES[change](model, torch.Generator().manual_seed(1))
    after = compiled(**inputs)[0]
    eager = model(**inputs)[0]
    assert _rel(eager, before) > 10 * tol, "the change must move the output"
    assert _rel(after, eager) <= tol, f"{which} after {change}: stale"
    assert torch.equal(after, _remade(compiled, inputs))


@pytest.mark.usefixtures("no_grad")
@pytest.mark.parametrize("change", UNSEEN_FROZEN)
def test_frozen_weights_miss_writes_through_data_until_unfrozen(change, monkeypatch):
    """The promise ``freeze_weights`` documents: a ``.data`` write goes unseen (the derived
    values stay as they were), and taking the promise back makes the next call see it."""
    from fxbackend import models
    family, dtype, options, tol = MODELS["unet_bf16"]
    model = models.build_model(family, "tiny", dtype=dtype)
    inputs = models.make_inputs(family, "tiny", dtype=dtype)
    fxbackend.freeze_weights(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxbackend", options=options)
    before = compiled(**inputs)[0]
    CHANGES[change](model, torch.Generator().manual_seed(1))
    eager = model(**inputs)[0]
    assert _rel(eager, before) > 10 * tol, "the change must move the output"
    assert _rel(compiled(**inputs)[0], eager) > 10 * tol  # the documented blind spot
    assert fxbackend.freeze_weights(model, frozen=False) > 0
    calls = _count_fingerprints(monkeypatch)
    assert _rel(compiled(**inputs)[0], eager) <= tol and calls


def test_freeze_weights_rejects_what_is_not_tensors():
    with pytest.raises(TypeError, match="nn.Module, a tensor or an iterable of tensors, got int"):
        fxbackend.freeze_weights(3)
    with pytest.raises(TypeError, match="must be tensors, got str"):
        fxbackend.freeze_weights([torch.zeros(2), "w"])
    t = torch.zeros(3)
    assert fxbackend.freeze_weights(t) == 1 and fxbackend.freeze_weights([t], frozen=False) == 1
    from fxbackend import weights
    assert weights.weight_key(t)[-1] == weights.fingerprint(t)  # unfrozen: the bytes again


def test_a_derived_value_is_keyed_by_serial_number_not_by_its_bytes(monkeypatch):
    from fxbackend import weights
    w = torch.randn(8, 4)
    value = torch.cat([w, w])  # a value derived from w, held by the plan that made it
    weights.mark_derived(value, (w,))
    monkeypatch.setitem(weights._FINGERPRINTS, "cpu", lambda t: pytest.fail("fingerprinted"))
    key = weights.weight_key(value)
    assert key == weights.weight_key(value)
    again = torch.cat([w, w])  # computed again: a new number, even at the same address
    weights.mark_derived(again, (w,))
    assert weights.weight_key(again)[-1] != key[-1]
    value.add_(1)  # nothing writes a derived value, but if something did, it is seen
    assert weights.weight_key(value) != key


def test_a_value_that_aliases_its_weight_is_not_marked(monkeypatch):
    from fxbackend import weights
    w = torch.randn(8, 4)
    weights.mark_derived(w.view(4, 8), (w,))  # an op that returned a view of its input
    weights.mark_derived(w, (w,))
    calls = []
    monkeypatch.setitem(weights._FINGERPRINTS, "cpu", lambda t: calls.append(t) or 7)
    assert weights.weight_key(w)[-1] == 7 and len(calls) == 1
