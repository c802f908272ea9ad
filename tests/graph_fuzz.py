"""Random straight-line programs of tensor ops, for fuzzing whole graphs against eager.

A program is a list of statements over values ``v0, v1, ...`` (the first ones are the inputs);
each statement makes one new value from earlier ones: elementwise ops, broadcasting binary
ops, views (slices, transposes, reshapes, ``unsqueeze``, ``select``, ``expand``, ``split``
pieces), ``cat``/``stack``, matmuls and linears, reductions, ``softmax``, LayerNorm and
RMSNorm (also written out), ``1 + scale`` products, bf16 round trips, the chains the fusion
rules look for (:data:`IDIOMS`, with operands drawn from any value), clones, and in-place
writes (``add_``, ``mul_``, ``copy_`` into a slice, ``relu_``), including writes
through views and into the inputs.  Every value has a known shape, so each choice is valid by
construction.  :func:`source` renders a program as a Python function; ``draw_program`` draws one
with hypothesis.

The ops are the ones the backend's planner, view handling, concatenation in place, identity
elision, constant folding, rewrites and fusions look at; the values stay small and the
elementwise ops are bounded (``tanh``, ``sigmoid``, ``exp`` of a ``tanh``) so that no value
overflows whatever the program.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import strategies as st


@dataclass
class Program:
    """Statements ``vN = <expr>`` (or in-place ``<expr>`` lines), the input shapes, the shape
    of every value, and which values are returned."""
    inputs: list[tuple[int, ...]]
    lines: list[str] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    #: whether a statement computes something (not only views of the inputs)
    computes: bool = False

    def new(self, expr: str, shape: tuple[int, ...]) -> int:
        i = len(self.shapes)
        self.lines.append(f"v{i} = {expr}")
        self.shapes.append(tuple(shape))
        return i


def source(p: Program, name: str = "program") -> str:
    """The program as a Python function ``name(v0, v1, ...)`` returning a tuple."""
    args = ", ".join(f"v{i}" for i in range(len(p.inputs)))
    body = "\n".join("    " + line for line in p.lines) or "    pass"
    outs = ", ".join(f"v{i}" for i in p.outputs)
    return f"def {name}({args}):\n{body}\n    return ({outs},)\n"


_UNARY = ["torch.tanh({})", "torch.sigmoid({})", "torch.relu({})", "({} * 0.5)", "(-{})",
          "torch.exp(torch.tanh({}))", "torch.nn.functional.silu({})",
          "torch.nn.functional.gelu({})", "torch.nn.functional.gelu({}, approximate='tanh')",
          "({} + 1.0)", "torch.abs({})",
          # a round trip through bf16 (the casts the rules keep exact)
          "{0}.bfloat16().to({0}.dtype)"]
#: normalisations over the last dim, as models write them (the rules' idioms)
_NORMS = ["torch.nn.functional.layer_norm({}, ({},))",
          "torch.nn.functional.rms_norm({}, ({},), eps=1e-6)",
          "({0} * torch.rsqrt({0}.pow(2).mean(-1, keepdim=True) + 1e-6))"]
_BINARY = ["({} + {})", "({} * {})", "({} - {})", "torch.maximum({}, {})",
           "({} * (1 + {}))"]
_INPLACE = ["{}.add_({})", "{}.mul_({})", "{}.copy_({})"]


@st.composite
def draw_program(draw, max_steps: int = 14) -> Program:
    """A random valid program over two to three float inputs of small shapes."""
    dims = st.integers(1, 5)
    n_in = draw(st.integers(1, 3))
    base = (draw(dims), draw(dims), draw(dims))
    inputs = []
    for _ in range(n_in):
        # inputs share the base shape or a broadcastable / lower-rank form of it
        kind = draw(st.sampled_from(["same", "row", "2d"]))
        inputs.append(base if kind == "same" else (1, 1, base[2]) if kind == "row"
                      else base[1:])
    p = Program(inputs, shapes=[tuple(s) for s in inputs])
    # values that may be written in place: made by this program, not views of inputs
    own: set[int] = set()
    views_of: dict[int, int] = {}

    def root(i: int) -> int:
        while i in views_of:
            i = views_of[i]
        return i

    steps = draw(st.integers(1, max_steps))
    for _ in range(steps):
        i = draw(st.integers(0, len(p.shapes) - 1))
        s = p.shapes[i]
        op = draw(st.sampled_from([
            "unary", "unary", "binary", "binary", "slice", "transpose", "reshape", "unsqueeze",
            "select", "expand", "split", "cat", "stack", "matmul", "sum", "softmax",
            "norm", "norm", "linear", "clone", "contiguous", "inplace", "inplace_slice", "relu_",
            "mutate_input", "idiom", "idiom", "idiom"]))
        if op == "unary":
            p.new(draw(st.sampled_from(_UNARY)).format(f"v{i}"), s)
            own.add(len(p.shapes) - 1)
        elif op == "binary":
            same = [j for j, t in enumerate(p.shapes) if t == s]
            # a broadcasting partner: the last dim or a scalar-like shape
            j = draw(st.sampled_from(same))
            if draw(st.booleans()) and len(s) >= 1:
                k = p.new(f"v{j}.sum(0, keepdim=True)" if len(s) >= 2 else f"v{j}.sum()",
                          ((1,) + s[1:]) if len(s) >= 2 else ())
                j = k
            p.new(draw(st.sampled_from(_BINARY)).format(f"v{i}", f"v{j}"), s)
            own.add(len(p.shapes) - 1)
        elif op == "slice" and s and s[-1] >= 2:
            a = draw(st.integers(0, s[-1] - 1))
            b = draw(st.integers(a + 1, s[-1]))
            k = p.new(f"v{i}[..., {a}:{b}]", s[:-1] + (b - a,))
            views_of[k] = i
        elif op == "transpose" and len(s) >= 2:
            k = p.new(f"v{i}.transpose(-1, -2)", s[:-2] + (s[-1], s[-2]))
            views_of[k] = i
        elif op == "reshape" and len(s) >= 2:
            k = p.new(f"v{i}.reshape({s[0]}, -1)", (s[0], _prod(s[1:])))
            views_of[k] = i  # a view when the layout allows it, else a copy: both are fine
        elif op == "unsqueeze" and len(s) <= 3:
            k = p.new(f"v{i}.unsqueeze(0)", (1,) + s)
            views_of[k] = i
        elif op == "select" and len(s) >= 2:
            k = p.new(f"v{i}.select(0, {draw(st.integers(0, s[0] - 1))})", s[1:])
            views_of[k] = i
        elif op == "expand" and s and s[0] == 1:
            k = p.new(f"v{i}.expand(3, *v{i}.shape[1:])", (3,) + s[1:])
            views_of[k] = i
        elif op == "split" and s and s[-1] >= 2:
            cut = draw(st.integers(1, s[-1] - 1))
            piece = draw(st.integers(0, 1))
            k = p.new(f"torch.split(v{i}, [{cut}, {s[-1] - cut}], -1)[{piece}]",
                      s[:-1] + ((cut,) if piece == 0 else (s[-1] - cut,)))
            views_of[k] = i
        elif op in ("cat", "stack") and s:
            same = [j for j, t in enumerate(p.shapes) if t == s]
            parts = draw(st.lists(st.sampled_from(same), min_size=1, max_size=3))
            names = ", ".join(f"v{j}" for j in [i] + parts)
            if op == "cat":
                d = draw(st.integers(0, len(s) - 1))
                shape = list(s)
                shape[d] *= 1 + len(parts)
                p.new(f"torch.cat([{names}], {d})", tuple(shape))
            else:
                p.new(f"torch.stack([{names}], 0)", (1 + len(parts),) + s)
            own.add(len(p.shapes) - 1)
        elif op == "matmul" and len(s) >= 2:
            # s @ s^T: [..., m, k] @ [..., k, m]
            p.new(f"torch.matmul(v{i}, v{i}.transpose(-1, -2))", s[:-1] + (s[-2],))
            own.add(len(p.shapes) - 1)
        elif op == "sum" and s:
            d = draw(st.integers(0, len(s) - 1))
            keep = draw(st.booleans())
            shape = s[:d] + ((1,) if keep else ()) + s[d + 1:]
            p.new(f"v{i}.sum({d}, keepdim={keep})", shape)
            own.add(len(p.shapes) - 1)
        elif op == "softmax" and s:
            p.new(f"torch.softmax(v{i}, -1)", s)
            own.add(len(p.shapes) - 1)
        elif op == "norm" and s:
            form = draw(st.sampled_from(_NORMS))
            p.new(form.format(f"v{i}", s[-1]) if "{}" in form else form.format(f"v{i}"), s)
            own.add(len(p.shapes) - 1)
        elif op == "linear" and s:
            # x @ w.T (+ b) with a 2-D value whose last dim is x's as the weight
            ws = [j for j, t in enumerate(p.shapes) if len(t) == 2 and t[1] == s[-1]]
            if not ws:
                continue
            w = draw(st.sampled_from(ws))
            bias = f", v{w}.sum(1)" if draw(st.booleans()) else ""
            p.new(f"torch.nn.functional.linear(v{i}, v{w}{bias})",
                  s[:-1] + (p.shapes[w][0],))
            own.add(len(p.shapes) - 1)
        elif op == "clone":
            p.new(f"v{i}.clone()", s)
            own.add(len(p.shapes) - 1)
        elif op == "contiguous":
            k = p.new(f"v{i}.contiguous()", s)
            views_of[k] = i  # the value itself when already contiguous
        elif op in ("inplace", "relu_"):
            # write into a value the program made (or a view of one), read its writer's shape
            targets = [j for j in range(len(p.shapes)) if root(j) in own
                       and not _aliases_itself(p, j, views_of)]
            if not targets:
                continue
            t = draw(st.sampled_from(targets))
            if op == "relu_":
                p.lines.append(f"v{t}.relu_()")
            else:
                # not a view of the target's storage: eager refuses partly overlapping
                # in-place sources
                srcs = [j for j, u in enumerate(p.shapes) if u == p.shapes[t]
                        and root(j) != root(t)]
                if not srcs:
                    continue
                p.lines.append(draw(st.sampled_from(_INPLACE)).format(
                    f"v{t}", f"v{draw(st.sampled_from(srcs))}"))
        elif op == "inplace_slice" and s and s[-1] >= 2:
            targets = [j for j in range(len(p.shapes)) if root(j) in own and p.shapes[j]
                       and p.shapes[j][-1] >= 2 and not _aliases_itself(p, j, views_of)]
            if not targets:
                continue
            t = draw(st.sampled_from(targets))
            n = p.shapes[t][-1]
            a = draw(st.integers(0, n - 1))
            p.lines.append(f"v{t}[..., {a}:{n}].mul_(2.0)")
        elif op == "mutate_input":
            j = draw(st.integers(0, len(p.inputs) - 1))
            p.lines.append(f"v{j}.add_(0.25)")
        elif op == "idiom" and s:
            _draw_idiom(draw, p, i, own)
    # return the last value and a few others (views and inputs included)
    extra = draw(st.lists(st.integers(0, len(p.shapes) - 1), max_size=3))
    p.outputs = sorted({len(p.shapes) - 1, *extra})
    in_place = len(p.lines) > len(p.shapes) - len(p.inputs)  # lines that make no value
    p.computes = bool(own) or in_place
    return p


#: the chains the fusion rules look for, over x (``{x}``), same-shaped operands (``{a}``,
#: ``{b}``: any value of x's shape, or one broadcast over x's rows), a weight ``{w}`` (a 2-D
#: value whose last dim is x's) and x's feature count ``{d}``; name -> (template, output's
#: last dim: "d" for x's, "w" for the weight's rows)
IDIOMS = {
    # adaLN modulation: norm(x) * (1 + scale) + shift
    "modulation": ("torch.nn.functional.layer_norm({x}, ({d},)) * (1 + {a}) + {b}", "d"),
    "modulation_rms": ("torch.nn.functional.rms_norm({x}, ({d},), eps=1e-6) * {a} + {b}",
                       "d"),
    # gated residual: residual + gate * linear(x) (a square weight made from w)
    "gated_residual": ("{a} + {b} * torch.nn.functional.linear({x}, {w}.transpose(0, 1) @ {w}, "
                       "{w}.sum(0))", "d"),
    # linear -> activation
    "linear_gelu": ("torch.nn.functional.gelu(torch.nn.functional.linear({x}, {w}, "
                    "{w}.sum(1)), approximate='tanh')", "w"),
    "linear_silu": ("torch.nn.functional.silu(torch.nn.functional.linear({x}, {w}))", "w"),
    # scale, then a 16-bit copy (read back in float32)
    "scale_cast": ("({x} * 0.125).bfloat16().to({x}.dtype)", "d"),
}


def _draw_idiom(draw, p: Program, i: int, own: set) -> None:
    """Append one of :data:`IDIOMS` over value ``i``, its operands drawn from the values the
    program has (any of them: inputs, views, values that are read elsewhere or returned)."""
    s = p.shapes[i]
    name = draw(st.sampled_from(sorted(IDIOMS)))
    template, last = IDIOMS[name]
    fill = {"x": f"v{i}", "d": s[-1]}
    for key in ("a", "b"):
        if "{" + key + "}" not in template:
            continue
        same = [j for j, t in enumerate(p.shapes) if t == s]
        j = draw(st.sampled_from(same))
        # broadcast over the rows (the conditioning of a modulation), or the value itself
        fill[key] = (f"v{j}.mean(-2, keepdim=True)" if len(s) >= 2 and draw(st.booleans())
                     else f"v{j}")
    if "{w}" in template:
        ws = [j for j, t in enumerate(p.shapes) if len(t) == 2 and t[1] == s[-1]]
        if not ws:
            return
        w = draw(st.sampled_from(ws))
        fill["w"] = f"v{w}"
        s = s[:-1] + (p.shapes[w][0],)
    p.new(template.format(**fill), s if last == "w" else p.shapes[i])
    own.add(len(p.shapes) - 1)


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def _aliases_itself(p: Program, j: int, views_of: dict[int, int]) -> bool:
    """Whether value ``j`` is (a view of) an ``expand`` result, whose elements share memory:
    eager refuses in-place writes into it."""
    while True:
        line = next((x for x in p.lines if x.startswith(f"v{j} = ")), "")
        if ".expand(" in line:
            return True
        if j not in views_of:
            return False
        j = views_of[j]
