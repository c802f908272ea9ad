"""Fuzzing the plan-file loader: mutated files are refused with fxbackend.ReplayError, or load.

Valid files of two small hand models (linears and a layer norm; one static, one exported with a
dynamic size, so that symbolic sizes and their ranges are in the file) are mutated by
hypothesis: byte flips, truncation, trailing bytes; JSON edits re-packed with a correct header
and CRC (so that they reach the decoder): deleted keys, values of other types, dangerous op
names, other format versions, other shapes; and edits of the weights (missing, reshaped,
other dtypes).  Loading, and running what loads, may only succeed or raise ReplayError.
"""
from __future__ import annotations

import copy
import json
import os

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch.export import Dim

import fxbackend
from fxbackend.replay import read_sections, write_sections

from test_replay import _Small  # the same small model as the round-trip tests


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{name: (path, bytes, inputs)} for a static and a dynamic-size export."""
    torch.manual_seed(0)
    model = _Small().eval()
    x = torch.randn(2, 6, 8)
    d = tmp_path_factory.mktemp("fuzz")
    out = {}
    for name, dyn in (("static", None), ("dynamic", {"x": {1: 2 * Dim("h", min=1, max=16)}})):
        path = d / f"{name}.fxb"
        fxbackend.export(model, (x,), dynamic_shapes=dyn).save(path)
        with open(path, "rb") as f:
            out[name] = (path, f.read(), [x])
    return out


def _paths(v, prefix=()):
    yield prefix
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _paths(x, prefix + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from _paths(x, prefix + (i,))


def _set(doc, path, value):
    if not path:
        return value
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    if value is _DELETE:
        if isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent.pop(path[-1])
    else:
        parent[path[-1]] = value
    return doc


_DELETE = object()
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.sampled_from(
        [0, 1, -1, 2 ** 63, 2 ** 62, 10 ** 12]) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids,
                                                              max_size=3),
    max_leaves=6)
_OPS = st.sampled_from(["builtins.eval", "os.system", "builtins.exec", "aten.__class__.default",
                        "aten.mul.__init__", "py.eval", "subprocess.run.default", "sym.add",
                        "getitem", "input", "constant", "aten.mul.Tensor", "aten.nonexistent.x",
                        "sd.rms_norm.v1", "prims.convert_element_type.default"])


def _outcome(path, inputs) -> str:
    """Load ``path`` and run what loads on ``inputs``: 'refused', 'refused at run' or 'ran'.
    Anything but ReplayError escapes (that is the failure hypothesis looks for); the outcome and
    the refusal's first words are hypothesis events (``--hypothesis-show-statistics``)."""
    try:
        plan = fxbackend.load(path)
    except fxbackend.ReplayError as e:
        assert str(e), "a ReplayError without a message"
        event("refused: " + str(e).split(": ", 1)[-1][:40])
        return "refused"
    try:
        plan.run(inputs)
        plan(*inputs)
    except fxbackend.ReplayError as e:
        assert str(e), "a ReplayError without a message"
        event("refused at run")
        return "refused at run"
    event("ran")
    return "ran"


# FXB_FUZZ_EXAMPLES=5000 runs a longer, random (not derandomized) campaign
_EXAMPLES = int(os.environ.get("FXB_FUZZ_EXAMPLES", "60"))
_SETTINGS = settings(max_examples=_EXAMPLES, deadline=None, database=None,
                     derandomize="FXB_FUZZ_EXAMPLES" not in os.environ,
                     suppress_health_check=[HealthCheck.function_scoped_fixture,
                                            HealthCheck.too_slow])


@_SETTINGS
@given(which=st.sampled_from(["static", "dynamic"]), data=st.data())
def test_byte_mutations(files, tmp_path, which, data):
    path0, raw, inputs = files[which]
    raw = bytearray(raw)
    kind = data.draw(st.sampled_from(["flip", "truncate", "append", "header"]))
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] = data.draw(st.integers(0, 255))
    elif kind == "truncate":
        raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
    elif kind == "append":
        raw += data.draw(st.binary(min_size=1, max_size=16))
    else:
        i = data.draw(st.integers(0, 31))
        raw[i] = data.draw(st.integers(0, 255))
    p = tmp_path / "m.fxb"
    p.write_bytes(bytes(raw))
    _outcome(p, inputs)


@_SETTINGS
@given(which=st.sampled_from(["static", "dynamic"]), data=st.data())
def test_json_mutations(files, tmp_path, which, data):
    path0, _, inputs = files[which]
    version, doc0, blob = read_sections(path0)
    doc = copy.deepcopy(doc0)
    for _ in range(data.draw(st.integers(1, 3))):
        if not isinstance(doc, dict):
            break
        doc = _mutate_json(doc, data)
    p = tmp_path / "m.fxb"
    header_version = data.draw(st.sampled_from([version] * 7 + [0, 2, 2 ** 31]))
    write_sections(p, doc, blob, header_version)
    _outcome(p, inputs)


def _mutate_json(doc, data):
    paths = list(_paths(doc))
    kind = data.draw(st.sampled_from(["delete", "value", "value", "op", "version", "int", "int",
                                      "shape", "node", "node"]))
    pick = {
        "op": [p for p in paths if p and p[-1] == "op"],
        "int": [p for p in paths if isinstance(_get(doc, p), int)],
        "shape": [p for p in paths if p and p[-1] in ("shape", "stride")],
        "node": [p for p in paths if len(p) > 3 and p[:2] == ("graph", "nodes")],
        "delete": [p for p in paths if p],
    }.get(kind, paths)
    if not pick:
        return doc
    path = data.draw(st.sampled_from(pick))
    if kind == "delete":
        return _set(doc, path, _DELETE)
    if kind == "op":
        return _set(doc, path, data.draw(_OPS))
    if kind == "version":
        doc["format_version"] = data.draw(st.sampled_from([0, 2, 99, "1", None, 1.5]))
        return doc
    if kind == "int":
        return _set(doc, path, data.draw(st.sampled_from([-1, 0, 1, 2, 3, 7, 100, 2 ** 40,
                                                         2 ** 64])))
    if kind == "shape":
        return _set(doc, path, data.draw(st.lists(st.integers(0, 20), max_size=4)))
    if kind == "node":  # a field inside one node: sources, params, aliasing, layout, meta
        return _set(doc, path, data.draw(
            st.sampled_from([0, 1, 3, 5, -1, 7, None, [], [0], [1, 2], True, "x", {"node": 8},
                             {"tuple": [1]}, {"dtype": "int64"}, {"s": "s39"}]) | _JSON))
    return _set(doc, path, data.draw(_JSON))


def _get(doc, path):
    for k in path:
        doc = doc[k]
    return doc


@_SETTINGS
@given(which=st.sampled_from(["static", "dynamic"]), data=st.data())
def test_weight_mutations(files, tmp_path, which, data):
    path0, _, inputs = files[which]
    version, doc, blob = read_sections(path0)
    tensors = safetensors.torch.load(blob)
    name = data.draw(st.sampled_from(sorted(tensors)))
    kind = data.draw(st.sampled_from(["drop", "reshape", "dtype", "extra", "table"]))
    if kind == "drop":
        del tensors[name]
    elif kind == "reshape":
        t = tensors[name]
        tensors[name] = torch.zeros(data.draw(st.lists(st.integers(0, 5), max_size=3)),
                                    dtype=t.dtype)
    elif kind == "dtype":
        tensors[name] = tensors[name].to(data.draw(st.sampled_from(
            [torch.float16, torch.float64, torch.int64, torch.bool, torch.bfloat16])))
    elif kind == "extra":
        tensors["extra." + name] = tensors[name].clone()
    else:
        entry = doc["weights"][name]
        entry[data.draw(st.sampled_from(["tensor", "kind"]))] = data.draw(_JSON)
    p = tmp_path / "m.fxb"
    write_sections(p, doc, safetensors.torch.save(tensors) if tensors else
                   safetensors.torch.save({}), version)
    _outcome(p, inputs)


def test_fuzz_files_are_valid(files):
    # the unmutated files load and match the model: the mutations start from working files
    for name, (path, _, inputs) in files.items():
        plan = fxbackend.load(path)
        torch.manual_seed(0)
        with torch.no_grad():
            ref = _Small().eval()(*inputs)
        assert torch.allclose(plan(*inputs), ref, rtol=1e-5, atol=1e-6), name
        assert json.dumps(read_sections(path)[1])  # the document is plain JSON
