"""Saving and replaying plans (fxbackend.replay, docs/FORMAT.md).

- round trips of diffusers Flux, SD3 and UNet (tiny): exported, saved, loaded and run in a fresh
  process: bitwise equal to the plan before saving, within 1e-5 of eager;
- plans from torch.compile (record_graphs / from_compiled), dynamic shapes and their ranges,
  update_weights against re-exporting, calls with other layouts, numbers as 0-dim tensors and
  models writing their inputs, custom ops (serialize/deserialize, unknown ops naming
  their extension), dangerous op names, damaged files, the CLI, moving attention to another
  device type, and the golden files of every format version (tests/golden/).
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap

import pytest
import safetensors.torch
import torch
from torch.export import Dim

import fxbackend
from fxbackend import models
from fxbackend.ir import Graph
from fxbackend.replay import (FORMAT_VERSION, ReplayError, portable_attention, read_sections,
                              write_sections)
from ext_util import contiguous_meta, rel_err, reg, registry_guard  # noqa: F401

#: tiny Flux's multiplications/divisions by 1 (timestep scale, RoPE frequencies) that the
#: identity_arith rewrite drops
_FLUX_IDENTITY = {"identity_arith": 8}

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FAMILIES = ["flux", "sd3", "unet", "wan"]  # wan: functionalised slice writes (its RoPE)


def _tensor_inputs(inputs: dict) -> dict:
    return {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}


def _fresh_python(code: str, timeout: int = 240) -> str:
    """Run ``code`` in a new interpreter (repository root as cwd, tests/ importable)."""
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


class _Small(torch.nn.Module):
    """Linears, a layer norm and a reshape whose sizes depend on the input's (for dynamic
    shapes: dim 1 must be even)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.out = torch.nn.Linear(16, 8)
        self.register_buffer("gain", torch.tensor(0.5))

    def forward(self, x):
        h = torch.nn.functional.gelu(self.norm(self.inp(x)))
        b, n, _ = h.shape
        h = h.reshape(b, n // 2, 32).reshape(b, n, 16)
        return self.out(h) * self.gain + x


def _small():
    torch.manual_seed(0)
    return _Small().eval(), torch.randn(2, 6, 8)


# -- diffusers models: export, save, load in a fresh process -------------------------------------

@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """Per family: the file, its inputs file, the plan's outputs before saving, eager's."""
    d = tmp_path_factory.mktemp("replay_models")
    out = {}
    for family in FAMILIES:
        model = models.build_model(family, "tiny")
        inputs = models.make_inputs(family, "tiny")
        ref = models.run_eager(model, inputs)
        plan = fxbackend.export(model, (), inputs)
        got = plan(**inputs)
        assert isinstance(got, tuple) and len(got) == 1  # the model's (return_dict=False) tuple
        path, in_path = d / f"{family}.fxb", d / f"{family}_inputs.safetensors"
        plan.save(path)
        safetensors.torch.save_file(_tensor_inputs(inputs), in_path)
        out[family] = dict(path=path, inputs=in_path, plan_out=got[0], ref=ref, plan=plan,
                           kwargs=inputs)
    return out


def test_round_trip_in_a_fresh_process(saved_models, tmp_path):
    code = f"""
        import safetensors.torch, torch, fxbackend
        for family, path, inputs, out in {[(f, str(v["path"]), str(v["inputs"]),
                                             str(tmp_path / f"{f}_out.safetensors"))
                                            for f, v in saved_models.items()]!r}:
            plan = fxbackend.load(path)
            assert all(t.data_ptr() % 64 == 0 for t in plan.weights.values())
            # the inputs in fresh tensors: safetensors may give views at the file's offsets,
            # and torch's CPU GEMM gives other bits for an input aligned to less than 16 bytes
            # (eager as well: SD3's context_embedder)
            outs = plan.run({{k: v.clone()
                              for k, v in safetensors.torch.load_file(inputs).items()}})
            safetensors.torch.save_file({{"0": outs[0]}}, out)
        import sys
        print("model code imported:", "diffusers" in sys.modules)
    """
    assert "model code imported: False" in _fresh_python(code)  # no diffusers in that process
    for family, v in saved_models.items():
        loaded = safetensors.torch.load_file(tmp_path / f"{family}_out.safetensors")["0"]
        assert torch.equal(loaded, v["plan_out"]), family
        assert v["ref"].abs().max() > 0
        assert rel_err(v["plan_out"], v["ref"]) <= 1e-5, family


def test_exported_plans_fuse_like_the_compiled_path(saved_models):
    # export gives the same ATen graph as aot_autograd, so the same rewrites and fusions fire
    fxbackend.reset_stats()
    plan = fxbackend.load(saved_models["flux"]["path"])
    plan(**saved_models["flux"]["kwargs"])
    s = fxbackend.stats()
    assert s["rewrites_by_rule"] == {"rope": 4, "rms_norm": 6, "attention_kv_contiguous": 2,
                                     **_FLUX_IDENTITY}, \
        s["rewrites_by_rule"]
    assert s["fusions_by_rule"]["rms_rope"] == 2, s["fusions_by_rule"]


def test_plan_call_conventions(saved_models):
    v = saved_models["sd3"]
    plan = fxbackend.load(v["path"])
    kwargs = v["kwargs"]
    assert plan.input_names == ["hidden_states", "encoder_hidden_states", "pooled_projections",
                                "timestep"]
    by_order = plan.run([kwargs[n] for n in plan.input_names])
    by_index = plan.run({str(i): kwargs[n] for i, n in enumerate(plan.input_names)})
    assert torch.equal(by_order[0], v["plan_out"]) and torch.equal(by_index[0], v["plan_out"])
    with pytest.raises(ReplayError, match="return_dict.*False"):
        plan(**dict(kwargs, return_dict=True))
    with pytest.raises(ReplayError, match=r"missing input\(s\) \['timestep'\]"):
        plan(**{k: x for k, x in kwargs.items() if k != "timestep"})
    with pytest.raises(ReplayError, match="unexpected key"):
        plan(**kwargs, bogus=1)
    with pytest.raises(ReplayError, match="'hidden_states': expected dtype torch.float32"):
        plan(**dict(kwargs, hidden_states=kwargs["hidden_states"].double()))
    with pytest.raises(ReplayError, match="'hidden_states': dim 2 is 17, expected 16"):
        plan(**dict(kwargs, hidden_states=torch.zeros(1, 4, 17, 16)))
    # a non-contiguous input is made contiguous, with the same result
    nc = kwargs["hidden_states"].transpose(2, 3).contiguous().transpose(2, 3)
    assert torch.equal(plan(**dict(kwargs, hidden_states=nc))[0], v["plan_out"])


def test_attention_moves_to_another_device_type(saved_models):
    # what load(device=<another type>) does to the CPU attention op, checked on the CPU:
    # scaled_dot_product_attention instead of _scaled_dot_product_flash_attention_for_cpu
    v = saved_models["flux"]
    plan = fxbackend.load(v["path"])
    assert portable_attention(plan.graph) == 2
    ops = {n.op for n in plan.graph.nodes}
    assert "aten.scaled_dot_product_attention.default" in ops
    assert not any("flash_attention" in op for op in ops)
    out = plan(**v["kwargs"])[0]
    assert rel_err(out, v["ref"]) <= 1e-5


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(16, 16)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(o.transpose(1, 2).reshape(b, s, 16))


@pytest.mark.parametrize("dynamic", [False, True])
def test_attention_layout_of_cuda_kernels_is_kept(tmp_path, dynamic):
    # a graph saved on CUDA has attention outputs in [B, S, H, D]-major layout; pretend this CPU
    # graph's is, and check that the portable replacement keeps that layout (static plans use
    # the file's metadata, symbolic ones re-plan on the meta device)
    torch.manual_seed(0)
    model, x = _Attention().eval(), torch.randn(2, 6, 16)
    dyn = {"x": {1: Dim("s", min=2, max=32)}} if dynamic else None
    fxbackend.export(model, (x,), dynamic_shapes=dyn).save(tmp_path / "attn.fxb")
    plan = fxbackend.load(tmp_path / "attn.fxb")
    attn = next(n for n in plan.graph.nodes if "flash_attention" in n.op)
    m = attn.meta[0]
    b, h, s, d = m.shape
    bshd = m.__class__(m.shape, (s * h * d, d, h * d, 1), m.dtype, m.device)
    attn.meta = (bshd,) + attn.meta[1:]
    for n in plan.graph.nodes:
        if n.op == "getitem" and n.srcs == [attn] and n.params["index"] == 0:
            n.meta = bshd
    assert portable_attention(plan.graph) == 1
    ops = [n.op for n in plan.graph.nodes]
    i = ops.index("aten.scaled_dot_product_attention.default")
    assert ops[i + 1:i + 4] == ["aten.transpose.int", "aten.clone.default", "aten.transpose.int"]
    for n_tokens in ((6, 10) if dynamic else (6,)):
        xs = torch.randn(2, n_tokens, 16)
        with torch.no_grad():
            assert torch.allclose(plan(xs), model(xs), rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
def test_cpu_file_runs_on_cuda_and_back(saved_models, tmp_path):
    v = saved_models["flux"]
    plan = fxbackend.load(v["path"], device="cuda")
    kwargs = {k: (x.cuda() if isinstance(x, torch.Tensor) else x) for k, x in v["kwargs"].items()}
    out = plan(**kwargs)[0]
    assert out.device.type == "cuda" and rel_err(out.cpu(), v["ref"]) <= 1e-5
    plan.save(tmp_path / "cuda.fxb")
    back = fxbackend.load(tmp_path / "cuda.fxb", device="cpu")
    assert rel_err(back(**v["kwargs"])[0], v["ref"]) <= 1e-5


# -- torch.compile -------------------------------------------------------------------------------

def test_plan_from_torch_compile(tmp_path):
    model = models.build_model("unet", "tiny")
    inputs = models.make_inputs("unet", "tiny")
    compiled = torch.compile(model, backend="fxbackend")
    with fxbackend.record_graphs() as graphs:
        out = models.run_eager(compiled, inputs)
    assert len(graphs) == 1
    plan = fxbackend.from_compiled(graphs[0], model)
    assert set(plan.weights) == set(model.state_dict())  # named as in the state dict
    assert plan.input_names == ["sample", "timestep", "encoder_hidden_states"]
    fxbackend.save(graphs[0], tmp_path / "unet.fxb", model=model)
    loaded = fxbackend.load(tmp_path / "unet.fxb")
    got = loaded(*[inputs[n] for n in loaded.input_names])  # a flat list of outputs
    assert isinstance(got, list) and torch.equal(got[0], out)
    # names from the recorded call alone (no model): Dynamo's source names
    assert all(k.startswith("l_self_") for k in fxbackend.from_compiled(graphs[0]).weights)


def test_dynamic_plan_from_torch_compile(tmp_path):
    model = models.build_model("flux", "tiny")
    compiled = torch.compile(model, backend="fxbackend", dynamic=True)
    res = models.MODEL_CONFIGS[("flux", "tiny")]["inputs"]["resolutions"]
    with fxbackend.record_graphs() as graphs:
        out = models.run_eager(compiled, models.make_inputs("flux", "tiny"))
    plan = fxbackend.from_compiled(graphs[0], model)
    assert plan.derived_inputs  # symbolic sizes come from the tensors, not from the caller
    plan.save(tmp_path / "flux_dyn.fxb")
    loaded = fxbackend.load(tmp_path / "flux_dyn.fxb")
    first = _tensor_inputs(models.make_inputs("flux", "tiny"))
    assert torch.equal(loaded.run({k: first[k] for k in loaded.input_names})[0], out)
    other = models.make_inputs("flux", "tiny", resolution=res[1])
    got = loaded.run({k: other[k] for k in loaded.input_names})[0]
    assert rel_err(got, models.run_eager(model, other)) <= 1e-5


# -- dynamic shapes --------------------------------------------------------------------------------

def test_dynamic_export_replays_within_its_range(tmp_path):
    model, x = _small()
    plan = fxbackend.export(model, (x,), dynamic_shapes={"x": {1: 2 * Dim("h", min=1, max=16)}})
    (sym, rng), = plan.symbols.items()
    assert (rng.min, rng.max, rng.hint) == (2, 16, 3)  # torch.export specialises sizes 0 and 1
    plan.save(tmp_path / "dyn.fxb")
    loaded = fxbackend.load(tmp_path / "dyn.fxb")
    with torch.no_grad():
        for n in (4, 10, 32):
            xn = torch.randn(2, n, 8)
            got = loaded(xn)
            assert torch.equal(got, plan(xn))
            assert torch.allclose(got, model(xn), rtol=1e-5, atol=1e-6)
    assert len(loaded.plans) == 3  # one plan per signature, no re-lowering
    with pytest.raises(ReplayError, match=r"input 'x': dim 1 is 34, outside the range .* "
                                          r"\[2, 16\], i\.e\. 4 to 32"):
        loaded(torch.randn(2, 34, 8))
    with pytest.raises(ReplayError, match=r"input 'x': dim 1 is 2, outside the range"):
        loaded(torch.randn(2, 2, 8))
    with pytest.raises(ReplayError, match=r"input 'x': dim 1 is 7, but the plan needs it to be "
                                          r"2\*s\d+ for an integer"):
        loaded(torch.randn(2, 7, 8))
    with pytest.raises(ReplayError, match=r"input 'x': dim 0 is 3, expected 2"):
        loaded(torch.randn(3, 6, 8))


class _MatrixRope(torch.nn.Module):
    """RoPE in the rotation-matrix form (the original Flux code, ComfyUI, HiDream)."""

    def forward(self, q, k, freqs_cis):
        from diffusers.models.transformers.transformer_hidream_image import apply_rope
        q, k = apply_rope(q, k, freqs_cis)
        return q * 2, k + 1


@pytest.mark.parametrize("rope_rewrite", [True, False], ids=["rewrite", "no_rewrite"])
def test_export_with_an_example_input_that_is_a_view(tmp_path, rope_rewrite):
    """A static export whose example input is a view (HiDream's frequency matrices,
    ``rope(...).unsqueeze(2)``) saves and loads: torch.export gives the sizes of that view's
    base range constraints that no node uses and no input binds (no sample value), which the
    plan leaves out and the file never holds (the loader requires every symbol's hint)."""
    from diffusers.models.transformers.transformer_hidream_image import rope
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(1, 10, 2, 12, generator=g) for _ in range(2))
    pos = (torch.arange(10, dtype=torch.float64).view(1, 10) * 7) % 11
    freqs = rope(pos, 12, 10000).unsqueeze(2)
    assert freqs._base is not None  # the case: an example input that is a view
    model = _MatrixRope().eval()
    options = None if rope_rewrite else {"disable_rewrites": ["rope"]}
    plan = fxbackend.export(model, (q, k, freqs), options=options)
    plan.save(tmp_path / "matrix_rope.fxb")
    loaded = fxbackend.load(tmp_path / "matrix_rope.fxb", options=options)
    fxbackend.reset_stats()
    with torch.no_grad():
        want = model(q, k, freqs)
        got = loaded(q, k, freqs)
    assert fxbackend.stats()["rewrites_by_rule"].get("rope", 0) == (2 if rope_rewrite else 0)
    for a, b, c in zip(got, want, plan(q, k, freqs)):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert plan.symbols == {} and read_sections(tmp_path / "matrix_rope.fxb")[1]["symbols"] == {}


def test_save_leaves_out_symbols_no_node_uses():
    """Every symbol the file holds has a sample value: one the plan knows but no node uses is
    left out, one a node uses without a sample value is refused at save (not at load)."""
    import sympy
    from fxbackend.inputs import SymbolRange
    from fxbackend.planfile import encode_plan
    model, x = _small()
    plan = fxbackend.export(model, (x,), dynamic_shapes={"x": {1: 2 * Dim("h", min=1, max=16)}})
    (sym, rng), = plan.symbols.items()
    unused = sympy.Symbol("s999", integer=True, positive=True)
    plan.symbols[unused] = SymbolRange(2, None, None)
    doc, _ = encode_plan(plan.parts(), plan.device)
    assert doc["symbols"] == {str(sym): {"min": 2, "max": 16, "hint": 3, "positive": True}}
    plan.symbols[sym] = SymbolRange(2, 16, None)
    with pytest.raises(ReplayError, match=rf"the symbolic size {sym} has no sample value"):
        encode_plan(plan.parts(), plan.device)


class _ReadsNumpy(torch.nn.Module):
    def forward(self, x):
        counts = (x > 0).sum(0).numpy()
        return x * float(counts.max())


class _HashesLengths(torch.nn.Module):
    def forward(self, x, mask):
        lengths = mask.sum(1).tolist()
        return x * len(set(lengths))


@pytest.mark.parametrize("model, cause, line", [
    (_ReadsNumpy(), "converts a tensor to numpy", r"counts = \(x > 0\)\.sum\(0\)\.numpy\(\)"),
    (_HashesLengths(), "hashes a traced integer", r"return x \* len\(set\(lengths\)\)")],
    ids=["numpy", "hash"])
def test_export_error_names_the_models_line_and_the_cause(model, cause, line):
    """torch.export's errors on Python code reading tensor data become a ReplayError that says
    why and names the line of the model's code (torch's own message says neither)."""
    x, mask = torch.randn(2, 3), torch.ones(2, 3, dtype=torch.bool)
    args = (x,) if isinstance(model, _ReadsNumpy) else (x, mask)
    with pytest.raises(ReplayError, match=rf"export: torch\.export cannot trace "
                                          rf"{type(model).__name__}: .*{cause}.*; at "
                                          rf".*test_replay\.py:\d+ in forward: {line} "
                                          rf"\(torch\.export: \w+: "):
        fxbackend.export(model.eval(), args)


# -- calls: layouts, numbers, inputs written ------------------------------------------------------

def test_export_with_an_unbounded_range():
    """A ``Dim`` with no upper bound gives a range constraint ending in torch's ``int_oo``
    (which says ``is_finite`` True and cannot be converted with ``int()``): the plan records
    no upper bound and replays at any size from the lower one."""
    from torch.utils._sympy.numbers import int_oo
    from fxbackend.exporter import _finite
    assert not _finite(int_oo) and not _finite(-int_oo) and _finite(7)
    model = torch.nn.Linear(4, 3).eval()
    plan = fxbackend.export(model, (torch.randn(2, 4),),
                            dynamic_shapes=({0: Dim("b", min=2)},))
    (rng,) = plan.symbols.values()
    assert (rng.min, rng.max) == (2, None)
    for rows in (2, 5, 300):
        x = torch.randn(rows, 4)
        with torch.no_grad():
            assert torch.allclose(plan(x), model(x), rtol=1e-6, atol=1e-6)


def test_non_contiguous_inputs_on_every_call():
    """A plan exported for a contiguous input gets a contiguous copy of a transposed one on every
    call, not only the first (the check's result is cached per layout)."""
    class M(torch.nn.Module):
        def forward(self, x):
            return x.view(-1) * 2

    plan = fxbackend.export(M().eval(), (torch.randn(4, 3),))
    for _ in range(3):
        x = torch.randn(3, 4).t()
        assert torch.equal(plan(x), x.contiguous().view(-1) * 2)


def test_number_inputs_given_as_0_dim_tensors():
    """A symbolic number input (``n`` of a ``dynamic=True`` compile) given as a 0-dim tensor is
    its value, on every call and whatever the value."""
    def f(x, n):
        return x * n + x.shape[0]

    compiled = torch.compile(f, backend="fxbackend", dynamic=True)
    with fxbackend.record_graphs() as graphs:
        compiled(torch.randn(4, 3), 3)
    plan = fxbackend.from_compiled(graphs[0])
    assert plan.input_names == ["x", "n"]
    x = torch.randn(4, 3)
    for n in (3, 5, torch.tensor(3), torch.tensor(5), 7):
        assert torch.equal(plan.run([x, n])[0], f(x, int(n)))


class _WritesInputs(torch.nn.Module):
    def forward(self, x, y):
        x.add_(1)             # the whole input
        y[:, 1:].mul_(2)      # through a view
        return y * x


def test_export_of_a_model_writing_its_inputs(tmp_path):
    """The plan writes the caller's tensors as the model does (after saving and loading too),
    also when the caller's tensor has another layout than the export's (the plan runs on a
    contiguous copy and writes it back); a model writing a buffer is refused."""
    model = _WritesInputs().eval()
    example = (torch.randn(4, 3), torch.randn(3, 4).t())
    plan = fxbackend.export(model, tuple(t.clone() for t in example))
    plan.save(tmp_path / "writes.fxb")
    loaded = fxbackend.load(tmp_path / "writes.fxb")
    for p in (plan, loaded):
        for x, y in (example, (torch.randn(3, 4).t(), torch.randn(4, 3))):
            want_x, want_y = x.clone(), y.clone()
            want = model(want_x, want_y)
            got = p(x, y)
            assert torch.equal(got, want)
            assert torch.equal(x, want_x) and torch.equal(y, want_y)

    class Counter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("steps", torch.zeros(()))

        def forward(self, x):
            self.steps.add_(1)
            return x * self.steps

    with pytest.raises(ReplayError, match=r"writes steps during its forward \(BUFFER_MUTATION\)"):
        fxbackend.export(Counter().eval(), (torch.randn(3),))


# -- update_weights --------------------------------------------------------------------------------

def _perturbed(state: dict, seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen, dtype=v.dtype)
            for k, v in state.items()}


def test_update_weights_equals_reexport(saved_models):
    v = saved_models["flux"]
    inputs = v["kwargs"]
    new = _perturbed(models.build_model("flux", "tiny").state_dict())
    # the reference: export a model that has the new weights
    reexported = models.build_model("flux", "tiny")
    reexported.load_state_dict(new)
    want = fxbackend.export(reexported, (), inputs)(**inputs)[0]
    loaded = fxbackend.load(v["path"])
    before = loaded(**inputs)[0]
    ptrs = {k: t.data_ptr() for k, t in loaded.weights.items()}
    plans = list(loaded.plans)
    built = fxbackend.stats()["plans_built"]
    loaded.update_weights(new)
    got = loaded(**inputs)[0]
    assert torch.equal(got, want) and not torch.equal(got, before)
    assert {k: t.data_ptr() for k, t in loaded.weights.items()} == ptrs  # in place
    assert loaded.plans == plans and fxbackend.stats()["plans_built"] == built  # no re-plan
    # an exported (not loaded) plan too
    model = models.build_model("flux", "tiny")
    plan = fxbackend.export(model, (), inputs)
    plan(**inputs)
    plan.update_weights(new)
    assert torch.equal(plan(**inputs)[0], want)


def test_update_weights_checks_names_shapes_dtypes():
    model, x = _small()
    plan = fxbackend.export(model, (x,))
    before = plan(x)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ReplayError, match=r"unknown weight name\(s\) \['bogus.weight'\]"):
        plan.update_weights(dict(good, **{"bogus.weight": torch.zeros(1)}))
    with pytest.raises(ReplayError, match=r"missing weight\(s\) \['gain'\]"):
        plan.update_weights({k: t for k, t in good.items() if k != "gain"})
    with pytest.raises(ReplayError, match=r"weight 'inp.weight': expected shape \(16, 8\), "
                                          r"got \(8, 16\)"):
        plan.update_weights(dict(good, **{"inp.weight": torch.zeros(8, 16)}), strict=False)
    with pytest.raises(ReplayError, match="weight 'out.bias': expected dtype torch.float32, "
                                          "got torch.float64"):
        plan.update_weights({"out.bias": torch.zeros(8, dtype=torch.float64)}, strict=False)
    assert torch.equal(plan(x), before)  # nothing was written by the failed calls
    plan.update_weights({"out.bias": torch.ones(8), "bogus": torch.zeros(1)}, strict=False)
    # an exported plan shares its weights with the model (no copy): the model sees them too
    assert torch.equal(model.out.bias.detach(), torch.ones(8))
    with torch.no_grad():
        want = model(x)
    assert not torch.equal(want, before)
    assert torch.allclose(plan(x), want, rtol=1e-5, atol=1e-6)


# -- custom ops ------------------------------------------------------------------------------------

class _NoSerialize:
    name = "test.no_serialize.v1"
    attrs = {"k": (float, 2.0)}

    def infer_meta(self, srcs, attrs):
        return contiguous_meta(srcs[0].shape)

    def execute(self, ctx, node, state, inputs, out, workspace):
        out.copy_(inputs[0] * node.params["k"])


def _graph_with(op_name: str) -> tuple[Graph, torch.Tensor]:
    g = Graph()
    x = g.append(g.new_node("input", meta=contiguous_meta((2, 4)), is_input=True))
    x.annotations["name"] = "x"
    y = fxbackend.op_create(g, op_name, [x])
    y.is_output = True
    g.outputs = [y]
    return g, torch.randn(2, 4)


def test_save_refuses_a_custom_op_without_serialize(reg, tmp_path):
    reg.op(_NoSerialize)
    g, x = _graph_with("test.no_serialize.v1")
    plan = fxbackend.from_compiled(g)
    assert torch.equal(plan.run([x])[0], 2 * x)
    path = tmp_path / "never.fxb"
    with pytest.raises(ReplayError, match=r"custom op test\.no_serialize\.v1 .*no "
                                          r"serialize/deserialize"):
        plan.save(path)
    assert not path.exists() and os.listdir(tmp_path) == []


def test_custom_op_round_trip_and_unknown_op_names_its_extension(registry_guard, tmp_path):
    import ext_example_op
    ext_example_op.register()
    try:
        g, x = _graph_with(ext_example_op.OP_NAME)
        g.nodes[-1].params["scale"] = 3.0
        fxbackend.from_compiled(g).save(tmp_path / "hand.fxb")
        # a model calling the op's torch.library twin, through torch.export
        model = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
        fn = _TanhModel(model)
        exported = fxbackend.export(fn, (x,))
        want = exported(x)
        exported.save(tmp_path / "lib.fxb")
        doc = read_sections(tmp_path / "lib.fxb")[1]
        assert doc["custom_ops"] == {ext_example_op.OP_NAME: {"module": "ext_example_op",
                                                              "library": True}}
        assert torch.equal(fxbackend.load(tmp_path / "lib.fxb")(x), want)
        hand = fxbackend.load(tmp_path / "hand.fxb")
        assert torch.allclose(hand.run([x])[0], 3.0 * torch.tanh(x))
    finally:
        ext_example_op.unregister()
    for name in ("hand.fxb", "lib.fxb"):
        with pytest.raises(ReplayError, match=r"unknown op 'example\.scaled_tanh\.v1'.*"
                                              r"extension module 'ext_example_op'"):
            fxbackend.load(tmp_path / name)


class _TanhModel(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        import ext_example_op
        return ext_example_op.scaled_tanh(self.inner(x), 0.5)


def test_project_custom_ops_serialize():
    # every custom op the project registers can be saved (the golden custom_op file uses two)
    for name in fxbackend.ops.registered_ops():
        assert fxbackend.ops.can_serialize(fxbackend.get_op(name)), name


# -- files that are not what they should be --------------------------------------------------------

@pytest.fixture
def small_file(tmp_path):
    model, x = _small()
    path = tmp_path / "small.fxb"
    fxbackend.export(model, (x,)).save(path)
    return path, x


def _rewrite(path, fn, version=None):
    v, doc, blob = read_sections(path)
    doc, blob = fn(doc, blob)
    write_sections(path, doc, blob, v if version is None else version)


@pytest.mark.parametrize("bad_op", ["builtins.eval", "os.system", "aten.__class__.default",
                                    "subprocess.run.default", "py.eval"])
def test_dangerous_op_names_are_refused(small_file, bad_op):
    path, _ = small_file

    def edit(doc, blob):
        node = next(n for n in doc["graph"]["nodes"] if n["op"] == "aten.gelu.default")
        node["op"] = bad_op
        return doc, blob

    _rewrite(path, edit)
    with pytest.raises(ReplayError, match=f"unknown op '{bad_op}'"):
        fxbackend.load(path)


def test_damaged_files_are_refused(small_file, tmp_path):
    path, x = small_file
    raw = path.read_bytes()
    cases = {
        "truncated": (raw[:len(raw) // 2], "truncated"),
        "empty": (b"", "shorter than the 32-byte header"),
        "not a plan": (b"PK\x03\x04" + raw[4:], "not an fxbackend plan file"),
        "flipped JSON byte": (raw[:40] + bytes([raw[40] ^ 0x55]) + raw[41:], "CRC-32"),
        "trailing bytes": (raw + b"\0", "trailing data"),
        "future version": (raw[:8] + (FORMAT_VERSION + 1).to_bytes(4, "little") + raw[12:],
                           f"format version {FORMAT_VERSION + 1} is newer"),
    }
    for label, (data, message) in cases.items():
        bad = tmp_path / "bad.fxb"
        bad.write_bytes(data)
        with pytest.raises(ReplayError, match=message):
            fxbackend.load(bad)
    with pytest.raises(ReplayError, match="cannot read"):
        fxbackend.load(tmp_path / "does-not-exist.fxb")

    def reshape(doc, blob):
        t = safetensors.torch.load(blob)
        t["inp.weight"] = torch.zeros(4, 4)
        return doc, safetensors.torch.save(t)

    def drop(doc, blob):
        t = safetensors.torch.load(blob)
        del t["out.bias"]
        return doc, safetensors.torch.save(t)

    def bad_json(doc, blob):
        doc["graph"]["nodes"][3]["meta"] = "f32[16]"
        return doc, blob

    def bad_type(doc, blob):
        doc["graph"]["nodes"][9]["srcs"] = {"0": 1}
        return doc, blob

    def json_version(doc, blob):
        doc["format_version"] = FORMAT_VERSION + 1
        return doc, blob

    for fn, message in ((reshape, r"weight 'inp.weight': the file holds torch.float32 \[4, 4\], "
                                  r"the graph needs torch.float32 \[16, 8\]"),
                        (drop, r"weight 'out.bias': its tensor \"out.bias\" is missing"),
                        (bad_json, r"node %3 \(input\).meta: expected an object"),
                        (bad_type, r"expected a list"),
                        (json_version, "the graph section says format")):
        fresh = tmp_path / f"{fn.__name__}.fxb"
        fresh.write_bytes(raw)
        _rewrite(fresh, fn)
        with pytest.raises(ReplayError, match=message):
            fxbackend.load(fresh)
    # a section that is not JSON at all, behind a correct header
    junk = b"{not json"
    body_start = 32
    import struct
    import zlib
    n_json = struct.unpack_from("<Q", raw, 16)[0]
    blob = raw[body_start + n_json:]
    header = struct.pack("<8sIIQQ", raw[:8], FORMAT_VERSION, zlib.crc32(junk), len(junk),
                         len(blob))
    (tmp_path / "junk.fxb").write_bytes(header + junk + blob)
    with pytest.raises(ReplayError, match="not valid JSON"):
        fxbackend.load(tmp_path / "junk.fxb")


def test_metadata_that_lies_is_refused(small_file):
    path, _ = small_file

    def edit(doc, blob):  # the layer norm's output claimed to be twice as wide
        node = next(n for n in doc["graph"]["nodes"] if n["op"] == "aten.gelu.default")
        node["meta"]["shape"][-1] = 32
        node["meta"]["stride"] = [192, 32, 1]
        return doc, blob

    _rewrite(path, edit)
    with pytest.raises(ReplayError, match=r"aten\.gelu\.default\): the file says f32\[2,6,32\] "
                                          r"but the op computes f32\[2,6,16\]"):
        fxbackend.load(path)


# -- the command line ------------------------------------------------------------------------------

def test_cli_replay_and_inspect(saved_models, tmp_path, capsys):
    v = saved_models["flux"]
    out_path = tmp_path / "out.safetensors"
    proc = subprocess.run([sys.executable, "-m", "fxbackend", "replay", str(v["path"]),
                           "--inputs", str(v["inputs"]), "--bench", "2", "--out", str(out_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "output 0: float32 [1, 64, 16]" in proc.stdout
    assert "steady state (median of 2):" in proc.stdout and "arena" in proc.stdout
    assert torch.equal(safetensors.torch.load_file(out_path)["0"], v["plan_out"])
    proc = subprocess.run([sys.executable, "-m", "fxbackend", "inspect", str(v["path"])],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "node list:" in text and "ops used:" in text
    assert "aten.addmm.default  (ATen)" in text
    assert "[rms_rope] uses sd.rms_norm.v1, sd.rope_apply.v1" in text  # a fused step's ops
    # inputs named 0, 1, ... in order; a file with wrong names is a clear error
    from fxbackend.__main__ import main
    plan = fxbackend.load(v["path"])
    by_index = {str(i): v["kwargs"][n] for i, n in enumerate(plan.input_names)}
    safetensors.torch.save_file(by_index, tmp_path / "idx.safetensors")
    assert main(["replay", str(v["path"]), "--inputs", str(tmp_path / "idx.safetensors")]) == 0
    safetensors.torch.save_file({"nope": torch.zeros(1)}, tmp_path / "bad.safetensors")
    assert main(["replay", str(v["path"]), "--inputs", str(tmp_path / "bad.safetensors")]) == 2
    assert "this plan takes ['hidden_states'" in capsys.readouterr().err


# -- golden files of every format version ----------------------------------------------------------

def test_golden_files():
    """Every golden file (tests/golden/v<version>_<name>.fxb) loads and reproduces the outputs
    stored next to it.  Goldens are written once per format version by
    ``python tests/golden/make_goldens.py`` and never regenerated: a new format version adds
    its own files, and this test keeps checking the old ones (docs/FORMAT.md, "Versioning")."""
    files = sorted(glob.glob(os.path.join(HERE, "golden", "v*_*.fxb")))
    versions = {int(os.path.basename(f)[1:].split("_")[0]) for f in files}
    assert versions == set(range(1, FORMAT_VERSION + 1)), versions  # one set per version
    for path in files:
        io = safetensors.torch.load_file(path[:-4] + "_io.safetensors")
        plan = fxbackend.load(path)
        inputs = {k[3:]: t for k, t in io.items() if k.startswith("in.")}
        outs = plan.run(inputs)
        want = [io[f"out.{i}"] for i in range(len(outs))]
        assert len(want) == sum(k.startswith("out.") for k in io), path
        for got, w in zip(outs, want):
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6)


def test_golden_static_structure():
    # the static golden keeps its calling convention: keyword input, constant, dict/tuple out
    path = os.path.join(HERE, "golden", "v1_static.fxb")
    io = safetensors.torch.load_file(path[:-4] + "_io.safetensors")
    plan = fxbackend.load(path)
    out = plan(io["in.x"], cond=io["in.cond"], flag=True)
    assert set(out) == {"out", "aux"} and isinstance(out["aux"], tuple)
    assert torch.equal(out["out"], plan.run([io["in.x"], io["in.cond"]])[0])
    assert json.loads(json.dumps(read_sections(path)[1]))["format_version"] == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_layer_norm_plan_loads_with_its_check(dtype, tmp_path):
    """The CPU's native_layer_norm gives 16-bit mean and rstd, the meta device's float32: the
    load check used the meta device and refused every saved 16-bit plan with a LayerNorm."""
    m = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.GELU()).to(dtype).eval()
    x = torch.randn(2, 8, 16).to(dtype)
    path = tmp_path / "ln.fxb"
    fxbackend.export(m, (x,)).save(str(path))
    with torch.no_grad():
        torch.testing.assert_close(fxbackend.load(str(path))(x), m(x))
