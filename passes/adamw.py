"""Joint pass: the compiled AdamW update becomes one ``cstack::fused_adamw_`` call.

A compiled ``optimizer.step`` reaches the joint stage as a functionalized
inference graph: per parameter a chain of elementwise aten ops (plain, or
``_foreach_*`` ops over lists) computes new values of the parameter ``p`` and
its moments ``m`` and ``v`` from them and the gradient ``g``, and an epilogue
``copy_`` writes them back into those graph inputs. This pass replaces every
such chain, with the epilogue, by one call of our fused op over lists, which
updates the inputs in place. It knows no particular optimizer's code; it
finds and proves the update:

1. Roles, from data flow alone: ``m`` and ``v`` are mutated inputs whose new
   value reads only themselves and one unmutated input ``g``; ``p`` is a
   mutated input whose new value reads exactly ``p``, ``m``, ``v`` and that
   same ``g``; all four of one shape. Foreach ops are followed element by
   element. A moment's new value may instead be *returned* by the graph
   (Dynamo stores it into the optimizer's state): from a zero tensor the
   graph creates (state made lazily, on the first step), or from an unmutated
   input (``state['m'] = b1 * m + ...``, stored back out of place); of the two
   tensors such a value reads, the moment is the one no other returned value
   reads. The fused call then updates the zero tensor, or a clone of the
   input (which keeps its value, as in eager), in place and the graph returns
   that. A chain may also read scalar inputs (SymInts, SymFloats, 0-d
   tensors: the step, torch.optim's 0-d step tensor, an lr a scheduler
   changes, a tensor lr), constants and 0-d constant tensors, through
   whitelisted elementwise ops and Python scalar arithmetic only. A scalar
   input that an exponent of a power reads is a *step* input; any other is a
   *hyperparameter* input.
2. Semantics, by identity testing: the chain is evaluated in float64 on
   probe values (special points that read off β₁, β₂, the decay 1 − lr·wd,
   the update's scale A and its eps term E; then random and tiny values) at
   several values of its scalar inputs (step inputs at several steps,
   hyperparameter inputs scaled independently), and must equal the AdamW
   update with the extracted coefficients to 1e-9 — in the reference form
   (eps outside the bias correction) or torch.optim's (eps scaled by
   √(1 − β₂ᵗ)). β₁, β₂, eps and the weight decay must be the same at every
   probe; lr may change. The step t is the exponent of the graph's β₁ᵗ/β₂ᵗ
   powers and becomes the op's ``step`` tensor. An lr that is the same at
   every probe is a constant of the call; one that changes (a scalar input,
   or computed in the step from the step count: warmup, cosine) must be, at
   every probe, a constant multiple k of one scalar value the graph computes
   (the input itself, a cast of it, lr·wd...): that value times k becomes the
   op's ``lr`` tensor. A chain with no step input (the reference optimizer's
   first compile, t baked in) is rewritten with step 1 and the lr/weight
   decay that give the same update. Anything else is left alone with a
   ``note``.

Chains with equal coefficients and the same lr source form one call (torch.optim param
groups with different lr/wd give one call each); the pass returns the number of fused
calls inserted, normally 1 per optimizer graph. torch.optim keeps one step
tensor per parameter; the call takes the first and, where a group has
several, an in-graph ``_assert_async`` checks at run time that they are equal
(they differ only for a parameter that missed updates: then the step fails
loudly rather than update it with the wrong bias correction).
"""
import functools
import math
import operator

import torch
from torch.fx import Graph, Node
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.node import map_arg

import custom_ops.adamw  # noqa: F401  (registers torch.ops.cstack.fused_adamw_)
from passes.graph_edit import erase_dead, fake_value, insert_call, reachable
from passes.registry import note, register_pass

aten = torch.ops.aten
NAME = "adamw"

# Elementwise aten/prims ops a chain may use, by name; their foreach forms
# (``_foreach_`` prefix) too. The comparisons and ``where`` are how torch's reference
# decomposition of ``lerp`` picks its formula from the weight (torch 2.11's Inductor uses it).
_ELEMENTWISE = {"add", "sub", "rsub", "mul", "div", "true_divide", "sqrt", "rsqrt", "neg", "reciprocal", "pow",
                "addcdiv", "addcmul", "lerp", "copy", "clone", "convert_element_type", "_to_copy",
                "scalar_tensor", "full", "fma", "abs", "ge", "gt", "le", "lt", "where",
                "_local_scalar_dense", "cos", "sin", "exp", "log", "minimum", "maximum", "clamp",
                "alias", "detach", "lift_fresh_copy"}  # aliases: a `.data` or `.detach()` read, the same values
# Comparisons, min/max and the transcendental functions may read constants and scalar inputs only:
# a branch on the data (clipping, say) could agree with AdamW at every probe and still differ elsewhere.
_DATA_FREE = {"ge", "gt", "le", "lt", "minimum", "maximum", "clamp", "cos", "sin", "exp", "log"}
# Python-level scalar arithmetic on SymInts/SymFloats (an lr schedule computed inside the step, say).
_SCALAR_FUNCTIONS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod,
                     operator.pow, operator.neg, math.sqrt, math.cos, math.sin, math.exp, math.log,
                     torch.sym_float, torch.sym_min, torch.sym_max, torch._sym_sqrt}
_SCALAR_FUNCTIONS |= {getattr(torch, f"_sym_{f}") for f in ("cos", "sin", "exp", "log") if hasattr(torch, f"_sym_{f}")}

# Step values the chains are evaluated at (a step input's value; t is a function of it).
_STEP_PROBES = (0, 1, 6, 999)
# Factors a hyperparameter input's traced value is scaled by at those same probes; input j also
# by (1 + j/3), so that two such inputs never move together.
_HYPER_PROBES = (1.0, 0.5, 2.0, 0.3)
# Agreement required between a chain and the AdamW update in float64.
_RTOL = 1e-9


def _op_name(target) -> str | None:
    """``add`` for aten.add.Tensor, ``_foreach_add`` for aten._foreach_add.Scalar; None if not aten/prims."""
    if isinstance(target, torch._ops.OpOverload) and target.namespace in ("aten", "prims"):
        return target.overloadpacket.__name__
    return None


def _base_name(node: Node) -> str | None:
    """``add`` for aten.add.Tensor and aten._foreach_add.List alike; None if not aten/prims."""
    name = _op_name(node.target)
    return name.removeprefix("_foreach_") if name is not None else None


def _constant(node: Node):
    """The tensor a ``get_attr`` node reads from the graph's module (None if there is none)."""
    module = node.graph.owning_module
    try:
        return getattr(module, node.target) if module is not None else None
    except AttributeError:
        return None


def _is_foreach(node: Node) -> bool:
    name = _op_name(node.target) if node.op == "call_function" else None
    return name is not None and name.startswith("_foreach_")


def _allowed(node: Node) -> bool:
    if node.op == "get_attr":  # a constant the step made (torch.tensor(0.0)): a 0-d tensor
        val = _constant(node)
        return isinstance(val, torch.Tensor) and val.dim() == 0
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return isinstance(node.args[0], Node) and _is_foreach(node.args[0])
    if node.target in _SCALAR_FUNCTIONS:
        return True
    return _base_name(node) in _ELEMENTWISE


def _is_data(node: Node) -> bool:
    """A tensor input of rank >= 1 (parameter, gradient, moment); rank-0 inputs and numbers are scalars."""
    val = fake_value(node)
    return node.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() >= 1


def _returned(chain, x: Node) -> bool:
    """Whether the chain's new value of ``x`` is returned by the graph rather than copied back into ``x``."""
    return x not in chain.copies


def _is_fresh(node: Node) -> bool:
    """A zero tensor of rank >= 1 the graph creates (``full(shape, 0)``): a moment made on the first step."""
    val = fake_value(node)
    return (node.op == "call_function" and node.target in (aten.full.default, aten.zeros.default)
            and (node.target is aten.zeros.default or node.args[1] == 0)
            and isinstance(val, torch.Tensor) and val.dim() >= 1)


class _Flow:
    """Data flow per value: a value is (node, None), or (foreach node, i) for element i of its result."""

    def __init__(self):
        self.memo: dict[tuple[Node, int | None], tuple[frozenset, frozenset, frozenset]] = {}

    def inputs(self, node: Node, index: int | None) -> list[tuple[Node, int | None]]:
        if node.target is operator.getitem and isinstance(node.args[0], Node) and _is_foreach(node.args[0]):
            return [(node.args[0], node.args[1])]
        refs = []
        for arg in (*node.args, *node.kwargs.values()):
            if index is not None and isinstance(arg, (list, tuple)):
                arg = arg[index]
            map_arg(arg, lambda n: refs.append((n, None)))
        return refs

    def reach(self, node: Node, index: int | None = None):
        """(data inputs, scalar inputs, values passed through) of a value, following foreach elements."""
        key = (node, index)
        if key not in self.memo:
            if _is_fresh(node):
                self.memo[key] = (frozenset([node]), frozenset(), frozenset())
            elif node.op == "placeholder":
                data, scalars = (frozenset([node]), frozenset()) if _is_data(node) else (frozenset(), frozenset([node]))
                self.memo[key] = (data, scalars, frozenset())
            else:
                data, scalars, values = set(), set(), {key}
                for ref in self.inputs(node, index):
                    d, s, v = self.reach(*ref)
                    data |= d
                    scalars |= s
                    values |= v
                self.memo[key] = (frozenset(data), frozenset(scalars), frozenset(values))
        return self.memo[key]


class _Chain:
    """One parameter's update: its inputs, values, epilogue copies and (once proven) coefficients."""

    def __init__(self, p, g, m, v, new, copies, flow: _Flow):
        self.p, self.g, self.m, self.v = p, g, m, v
        self.new = new  # input -> node holding its new value
        self.copies = copies  # input -> its epilogue copy_
        self.values = set()
        self.scalars = set()
        for x in (p, m, v):
            _, scalars, values = flow.reach(new[x])
            self.values |= values
            self.scalars |= scalars
        self.nodes = {node for node, _ in self.values}
        self.step: Node | None = None  # node holding t, None when t is baked in
        self.coefficients: tuple | None = None  # (β₁, β₂, weight_decay, eps, torch_semantics)
        self.lr: tuple | None = None  # (lr,) when constant, else (node, index, k): lr = k·value

    def __repr__(self):
        return f"update of {self.p.name}"


def _find_chains(graph: Graph, flow: _Flow) -> list[_Chain]:
    """Chains with AdamW's roles: p' reads {p, m, v, g}; m' reads {m, g}; v' reads {v, g}; one shape."""
    copies, new = {}, {}
    for node in graph.nodes:
        if node.target is aten.copy_.default and node.args[0].op == "placeholder":
            dst = node.args[0]
            if dst in copies:
                note(NAME, f"left {dst.name} alone: written back twice")
                copies[dst] = None
                continue
            copies[dst], new[dst] = node, node.args[1]
    mutated = {x for x, c in copies.items() if c is not None and _is_data(x) and isinstance(new[x], Node)}
    # Returned moments: a value the graph returns that reads exactly two tensors, each an unmutated
    # input or a fresh zero tensor, is a candidate new value of either; the moment is the one of the
    # two that only this returned value reads (the gradient is read by both moments).
    candidates: dict[Node, set[Node]] = {}
    for out in graph.find_nodes(op="output")[0].all_input_nodes:
        data = flow.reach(out)[0]
        if len(data) == 2 and all(_is_fresh(x) or (_is_data(x) and x not in mutated) for x in data):
            for x in data:
                candidates.setdefault(x, set()).add(out)
    for x, outs in candidates.items():
        if len(outs) == 1:
            new[x] = next(iter(outs))
            mutated.add(x)
    reads = {x: flow.reach(new[x]) for x in mutated}
    chains, taken = [], set()
    for p in [n for n in graph.nodes if n in mutated and n.op == "placeholder"]:
        data, scalars, _ = reads[p]
        if p not in data or len(data) < 3:
            continue
        others = data - {p}
        moments = [x for x in others if x in mutated and len(reads[x][0]) == 2 and x in reads[x][0]]
        grads = {next(iter(reads[x][0] - {x})) for x in moments}
        g = next(iter(grads)) if len(grads) == 1 else None
        if len(others) != 3 or len(moments) != 2 or g is None or g in mutated or g not in others:
            note(NAME, f"left {p.name} alone: its update reads {sorted(n.name for n in data)}, "
                       "not the AdamW inputs (param, grad, exp_avg, exp_avg_sq)")
            continue
        m, v = moments  # which is which: _prove tells them apart
        if taken & {p, g, m, v}:
            note(NAME, f"left {p.name} alone: shares inputs with another update")
            continue
        shapes = {tuple(fake_value(x).shape) for x in (p, g, m, v)}
        if len(shapes) != 1:
            note(NAME, f"left {p.name} alone: param, grad and moments differ in shape")
            continue
        taken |= {p, g, m, v}
        chains.append(_Chain(p, g, m, v, new, copies, flow))
    return chains


def _elementwise(chain: _Chain, flow: _Flow) -> bool:
    """Every value of the chain is a whitelisted elementwise op; data-dependent ones have the param's shape."""
    shape = tuple(fake_value(chain.p).shape)
    for node, index in chain.values:
        if not _allowed(node):
            note(NAME, f"left {chain} alone: {node.name} ({node.target}) is not an elementwise update op")
            return False
        reads_data = bool(flow.reach(node, index)[0])
        if reads_data and _base_name(node) in _DATA_FREE:
            note(NAME, f"left {chain} alone: {node.name} compares data")
            return False
        val = fake_value(node, index)
        if reads_data and not (isinstance(val, torch.Tensor) and tuple(val.shape) == shape):
            note(NAME, f"left {chain} alone: {node.name} is not shaped like the parameter")
            return False
    return True


def _probe_call(target, args, kwargs, probes: int):
    """Run ``target`` on float64 probe values: float casts keep float64, constants fill the probe shape."""
    name = _op_name(target)
    if name in ("convert_element_type", "_to_copy", "scalar_tensor", "full"):
        kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "pin_memory", "layout", "memory_format")}
        dtype = args[1] if name == "convert_element_type" else kwargs.pop("dtype", None)
        dtype = torch.float64 if dtype is None or dtype.is_floating_point else dtype
        if name in ("convert_element_type", "_to_copy"):
            return args[0].to(dtype)
        if name == "full":
            size, value = args
            return torch.full([probes] if len(size) else [], value, dtype=dtype)
        return torch.scalar_tensor(args[0], dtype=dtype)
    return target(*args, **kwargs)


def _as_float(x) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


@functools.cache
def _expected(beta1, beta2, lr, weight_decay, eps, torch_semantics, t):
    """(p', m', v') the fused op makes from the probes, in float64."""
    p, g, m, v = (_probes()[r] for r in "pgmv")
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1, bc2 = 1 - beta1**t, 1 - beta2**t
    p = p - lr * weight_decay * p
    if torch_semantics:
        p = p - lr / bc1 * m / (v.sqrt() / math.sqrt(bc2) + eps)
    else:
        p = p - lr * math.sqrt(bc2) / bc1 * m / (v.sqrt() + eps)
    return p, m, v


@functools.cache
def _probes() -> dict[str, torch.Tensor]:
    """Float64 values per role (p, g, m, v), one probe a column.

    Columns 0–3 read off the coefficients (see ``_read_off``), 4–11 are random
    and 12–15 tiny, where √v' is near eps and its placement shows.
    """
    gen = torch.Generator().manual_seed(0)
    special = torch.tensor([[1.0, 0, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1], [0, 1, 0, 0]], dtype=torch.float64)
    rand = torch.randn(8, 4, generator=gen, dtype=torch.float64)
    rand[:, 3] = torch.rand(8, generator=gen, dtype=torch.float64)
    tiny = torch.randn(4, 4, generator=gen, dtype=torch.float64) * 1e-9
    tiny[:, 3] = torch.rand(4, generator=gen, dtype=torch.float64) * 1e-18
    return dict(zip("pgmv", torch.cat([special, rand, tiny]).T))


def _read_off(p_new, m_new, v_new):
    """(decay, β₁, β₂, A, E) for p' = decay·p − A·m'/(√v' + E), from probe columns 0–3; None if degenerate."""
    decay, beta1, beta2 = _as_float(p_new[0]), _as_float(m_new[1]), _as_float(v_new[2])
    u_a, u_b = -_as_float(p_new[1]), -_as_float(p_new[2])  # m' = β₁ in both; v' = 0, then v' = β₂
    if not (0 < beta1 < 1 and 0 < beta2 < 1 and u_b != 0 and u_a != u_b):
        return None
    big_e = u_b * math.sqrt(beta2) / (u_a - u_b)
    return decay, beta1, beta2, u_b * (math.sqrt(beta2) + big_e) / beta1, big_e


def _close(values) -> bool:
    return all(math.isclose(x, values[0], rel_tol=_RTOL, abs_tol=0.0) for x in values)


def _tidy(x: float) -> float:
    """Drop the float noise the extraction arithmetic leaves (0.0010000000000000002 → 0.001)."""
    return float(f"{x:.15g}")


def _exponent(chain: _Chain, env, flow: _Flow, order, betas) -> Node | None:
    """The node holding t: the exponent of the chain's β₁ᵗ / β₂ᵗ (None if the chain has no such power)."""
    for node, index in sorted(chain.values, key=lambda ref: (order[ref[0]], ref[1] or 0)):
        if node.target is not operator.pow and _op_name(node.target) not in ("pow", "_foreach_pow"):
            continue
        base, exponent = node.args[0], node.args[1]
        if index is not None and isinstance(exponent, (list, tuple)):
            exponent = exponent[index]
        if not isinstance(exponent, Node) or not flow.reach(exponent)[1]:
            continue
        base = _as_float(env[base]) if isinstance(base, Node) else base
        if isinstance(base, (int, float)) and any(math.isclose(base, b, rel_tol=1e-12) for b in betas):
            return exponent
    return None


def _coefficients(readings):
    """((β₁, β₂, weight_decay, eps, torch_semantics), lr per reading) if every reading is the AdamW
    update with those coefficients and its own lr, else None."""
    _, beta1, beta2, _, _ = readings[0][0]
    if not all(_close([r[0][i] for r in readings]) for i in (1, 2)):
        return None
    ts = [r[1] for r in readings]
    bc1 = [1 - beta1**t for t in ts]
    bc2 = [1 - beta2**t for t in ts]
    if not all(b1 != 0 and b2 > 0 for b1, b2 in zip(bc1, bc2)):  # no bias correction to read lr through
        return None
    lrs = [r[0][3] * b1 / math.sqrt(b2) for r, b1, b2 in zip(readings, bc1, bc2)]
    if not all(math.isfinite(lr) and lr > 0 for lr in lrs):
        return None
    es = [r[0][4] for r in readings]
    if _close(es):
        torch_semantics, eps = False, es[0]
    elif _close([e / math.sqrt(b2) for e, b2 in zip(es, bc2)]):
        torch_semantics, eps = True, es[0] / math.sqrt(bc2[0])
    else:
        return None
    decays = [(1 - r[0][0]) / lr for r, lr in zip(readings, lrs)]  # weight decay, per reading
    if all(abs(d) < 1e-12 for d in decays):
        decays = [0.0] * len(decays)
    if not (_close(decays) and math.isfinite(eps) and eps >= 0):
        return None
    beta1, beta2, weight_decay, eps = map(_tidy, (beta1, beta2, decays[0], eps))
    if weight_decay < 0:
        return None
    lrs = [_tidy(lr) for lr in lrs]
    for (_, t, outputs), lr in zip(readings, lrs):
        expected = _expected(beta1, beta2, lr, weight_decay, eps, torch_semantics, t)
        if not all(torch.allclose(got, exp, rtol=_RTOL, atol=0.0) for got, exp in zip(outputs, expected)):
            return None
    return (beta1, beta2, weight_decay, eps, torch_semantics), lrs


def _step_inputs(chain: _Chain, flow: _Flow) -> set[Node]:
    """The scalar inputs an exponent of a power in the chain reads (the step's)."""
    steps = set()
    for node, index in chain.values:
        if node.target is not operator.pow and _op_name(node.target) not in ("pow", "_foreach_pow"):
            continue
        exponent = node.args[1]
        if index is not None and isinstance(exponent, (list, tuple)):
            exponent = exponent[index]
        if isinstance(exponent, Node):
            steps |= flow.reach(exponent)[1]
    return steps


def _hint(node: Node):
    """The value a SymInt/SymFloat input was traced with; None for a tensor or when unknown."""
    val = fake_value(node)
    hint = getattr(getattr(val, "node", None), "hint", None)
    return hint if isinstance(hint, (int, float)) else None


def _scalar_probe(node: Node, k: int, steps: set[Node], j: int):
    """Scalar input ``node``'s value at probe ``k``: a step at ``_STEP_PROBES[k]``; hyperparameter
    input ``j`` at its traced value (1e-3 for a tensor) scaled by ``_HYPER_PROBES[k]·(1 + j/3)``."""
    val = fake_value(node)
    if node in steps:
        value = _STEP_PROBES[k]
    elif isinstance(val, torch.SymInt) or isinstance(val, int):
        value = (_hint(node) or 1) * (1, 2, 3, 5)[k] + j
    else:
        value = (_hint(node) or 1e-3) * _HYPER_PROBES[k] * (1 + j / 3)
    if isinstance(val, torch.Tensor):
        return torch.tensor(float(value), dtype=torch.float64)
    return value


def _lr_source(chain: _Chain, envs, lrs, flow: _Flow, order):
    """(node, index, k) with lr = k·value at every probe: the earliest scalar value of the chain
    (an input, a cast of it, lr·wd...) proportional to the changing lr; None if there is none."""
    candidates = chain.values | {(s, None) for s in chain.scalars}
    for node, index in sorted(candidates, key=lambda ref: (order[ref[0]], ref[1] or 0)):
        if flow.reach(node, index)[0]:
            continue
        val = fake_value(node, index)
        if not (isinstance(val, (torch.SymInt, torch.SymFloat, int, float))
                or (isinstance(val, torch.Tensor) and val.dim() == 0 and val.dtype.is_floating_point)):
            continue
        values = []
        for env in envs:
            x = env[node]
            x = x[index] if index is not None else x
            if isinstance(x, torch.Tensor) and x.dim() != 0:
                break
            values.append(_as_float(x))
        if len(values) != len(envs) or not all(math.isfinite(x) and x != 0 for x in values):
            continue
        ks = [lr / x for lr, x in zip(lrs, values)]
        if _close(ks) and ks[0] > 0:
            return node, index, _tidy(ks[0])
    return None


def _prove(chains: list[_Chain], graph: Graph, flow: _Flow, order) -> list[_Chain]:
    """Evaluate the chains on float64 probes; keep those equal to AdamW, with coefficients, lr and step set."""
    needed = reachable([n for c in chains for n in c.nodes], lambda n: n.all_input_nodes)  # foreach lists too
    roles = {getattr(c, r): r for c in chains for r in "pgmv"}
    steps = set().union(*(_step_inputs(c, flow) for c in chains))
    hyper = sorted({s for c in chains for s in c.scalars} - steps, key=order.__getitem__)

    def run(k, values):
        inputs = {}
        for node in needed:
            if _is_fresh(node) and node in roles:
                inputs[node] = values[roles[node]]
                continue
            if node.op != "placeholder":
                continue
            if _is_data(node):
                inputs[node] = values[roles[node]] if node in roles else torch.ones_like(values["p"])
            else:
                inputs[node] = _scalar_probe(node, k, steps, hyper.index(node) if node in hyper else 0)
        env = dict(inputs)
        for node in graph.nodes:
            if node in needed and node not in env:
                if node.op == "get_attr" and isinstance(_constant(node), torch.Tensor):
                    value = _constant(node)
                    env[node] = value.double() if value.is_floating_point() else value
                    continue
                if node.op != "call_function":
                    raise ValueError(f"{node.name} is a {node.op} node")
                args, kwargs = map_arg((node.args, node.kwargs), env.__getitem__)
                env[node] = _probe_call(node.target, args, kwargs, len(values["p"]))
        return env

    try:
        # m' is linear in g, v' quadratic: with g = 1, then 2, m' doubles and v' quadruples.
        zeros = torch.zeros(2, dtype=torch.float64)
        env = run(1, {"p": zeros, "g": torch.tensor([1.0, 2.0], dtype=torch.float64), "m": zeros, "v": zeros})
        for chain in chains:
            a = env[chain.new[chain.m]]
            if math.isclose(_as_float(a[1] / a[0]), 4.0, rel_tol=1e-9):
                chain.m, chain.v = chain.v, chain.m
                roles[chain.m], roles[chain.v] = "m", "v"
        probes = _probes()
        scalar_inputs = any(c.scalars for c in chains)
        envs = [run(k, probes) for k in (range(len(_STEP_PROBES)) if scalar_inputs else (1,))]
    except Exception as e:  # an op the float64 probes cannot run: nothing is proven
        note(NAME, f"left the optimizer update alone: evaluating it on probes failed ({type(e).__name__}: {e})")
        return []

    proven = []
    for chain in chains:
        outputs = [tuple(env[chain.new[x]] for x in (chain.p, chain.m, chain.v)) for env in envs]
        first = _read_off(*outputs[0])
        if first is None:
            note(NAME, f"left {chain} alone: not of the form p' = decay·p − A·m'/(√v' + E) with 0 < β < 1")
            continue
        if chain.scalars & steps:
            chain.step = _exponent(chain, envs[0], flow, order, first[1:3])
            if chain.step is None:
                note(NAME, f"left {chain} alone: it reads a step but raises no beta to its power")
                continue
            ts = [_as_float(env[chain.step]) for env in envs]
        else:
            ts = [1.0] * len(envs)  # t baked in: step 1 with the lr and weight decay that give the same update
        # AdamW is defined from step 1: a probe whose exponent is below it (a step read before the
        # count is incremented) says nothing, and would divide by a zero bias correction.
        valid = [(env, out, t) for env, out, t in zip(envs, outputs, ts) if t >= 1]
        readings = []
        for _, out, t in valid:
            read = _read_off(*out)
            if read is None:
                break
            readings.append((read, t, out))
        enough = len(readings) == len(valid) and len(valid) >= min(2, len(envs))
        proven_update = _coefficients(readings) if enough else None
        if proven_update is None:
            note(NAME, f"left {chain} alone: its update is not AdamW's (reference or torch.optim form) "
                       "with constant betas, eps and weight decay")
            continue
        chain.coefficients, lrs = proven_update
        chain.lr = (lrs[0],) if _close(lrs) else _lr_source(chain, [env for env, _, _ in valid], lrs, flow, order)
        if chain.lr is None:
            note(NAME, f"left {chain} alone: its lr changes with the scalar inputs but is no multiple of "
                       "one value the graph computes")
            continue
        proven.append(chain)
    return proven


def _isolated(chain: _Chain, flow: _Flow, order, insert_at: Node) -> bool:
    """The chain's tensor values feed only itself and its epilogue; nothing after the call reads p, m or v."""
    inside = chain.nodes | {chain.copies[x] for x in (chain.p, chain.m, chain.v) if x in chain.copies}
    returned = {chain.new[x] for x in (chain.m, chain.v) if _returned(chain, x)}  # the graph returns these
    for node, index in chain.values:
        if order[node] >= order[insert_at]:
            note(NAME, f"left {chain} alone: its update is computed after the epilogue starts")
            return False
        users = {u for u in node.users if not (u.op == "output" and node in returned)}
        if index is None and not _is_foreach(node) and flow.reach(node)[0] and not users <= inside:
            note(NAME, f"left {chain} alone: {node.name} is also used outside the update")
            return False
    for x in (chain.p, chain.m, chain.v):
        late = [u for u in x.users if u not in inside and order[u] >= order[insert_at]]
        if late:
            note(NAME, f"left {chain} alone: {late[0].name} reads {x.name} after the update")
            return False
    return True


def _f32(add, step: Node, device) -> Node:
    """A scalar value (t, lr) as a 0-d float32 tensor: a tensor is cast, a SymInt/SymFloat becomes a
    tensor on ``device``."""
    val = fake_value(step)
    if isinstance(val, torch.Tensor):
        if val.dtype == torch.float32:
            return step
        return add(torch.ops.prims.convert_element_type.default, (step, torch.float32))
    return add(aten.scalar_tensor.default, (step,), {"dtype": torch.float32, "device": device})


def _fuse(graph: Graph, group: list[_Chain], fake_mode) -> Node:
    """Insert one fused call for ``group`` (at the graph's insertion point); returns the call node."""
    add = functools.partial(insert_call, graph, fake_mode=fake_mode)
    beta1, beta2, weight_decay, eps, torch_semantics = group[0].coefficients
    device = fake_value(group[0].p).device
    if len(group[0].lr) == 1:  # constant
        lr_node = add(aten.scalar_tensor.default, group[0].lr, {"dtype": torch.float32, "device": device})
    else:  # k times a scalar value of the graph
        node, index, k = group[0].lr
        if index is not None:
            node = add(operator.getitem, (node, index))
        lr_node = _f32(add, node, device)
        if k != 1.0:
            lr_node = add(aten.mul.Tensor, (lr_node, k))
    steps = list(dict.fromkeys(c.step for c in group))
    if steps == [None]:
        step = add(aten.scalar_tensor.default, (1.0,), {"dtype": torch.float32, "device": device})
    else:
        step_values = [_f32(add, s, device) for s in steps]
        step = step_values[0]
        if len(steps) > 1:
            # Past decomposition, only ops Inductor lowers: cat of [1]-views (not stack), any (not all).
            stacked = add(aten.cat.default, ([add(aten.view.default, (s, [1])) for s in step_values],))
            same = add(aten.logical_not.default, (add(aten.any.default, (add(aten.ne.Tensor, (stacked, step)),)),))
            add(aten._assert_async.msg,
                (same, "fused AdamW: parameters of one group are at different steps (one missed updates)"))
    for c in group:
        # A returned moment read from an input (its new value stored back out of place): the call
        # updates a copy, so the input keeps its value as in eager; a fresh zero tensor is its own.
        c.buffers = {x: add(aten.clone.default, (x,)) if _returned(c, x) and not _is_fresh(x) else x
                     for x in (c.p, c.m, c.v)}
    lists = [[c.buffers.get(getattr(c, r), getattr(c, r)) for c in group] for r in "pgmv"]
    call = add(torch.ops.cstack.fused_adamw_.default,
               (*lists, lr_node, step, beta1, beta2, eps, weight_decay, torch_semantics))
    call.meta["val"] = None
    return call


@register_pass(NAME, stage="joint")
def fuse_adamw(graph: Graph) -> int:
    """Replace AdamW per-parameter update chains (reference, torch.optim single/foreach) by fused calls."""
    flow = _Flow()
    chains = [c for c in _find_chains(graph, flow) if _elementwise(c, flow)]
    if not chains:
        return 0
    order = {node: i for i, node in enumerate(graph.nodes)}
    with unset_fake_temporarily():  # the probes are real float64 tensors, even inside a compile
        chains = _prove(chains, graph, flow, order)
    if not chains:
        return 0
    insert_at = min((c.copies[x] for c in chains for x in (c.p, c.m, c.v) if x in c.copies),
                    key=order.__getitem__)
    chains = [c for c in chains if _isolated(c, flow, order, insert_at)]
    groups: dict[tuple, list[_Chain]] = {}
    for chain in chains:
        groups.setdefault((chain.coefficients, chain.lr, chain.step is None), []).append(chain)

    placeholders = [fake_value(n) for n in graph.nodes if n.op == "placeholder"]
    fake_mode = torch._guards.detect_fake_mode(placeholders)
    fused = []
    for group in groups.values():
        before = set(graph.nodes)
        try:
            with graph.inserting_before(insert_at):
                _fuse(graph, group, fake_mode)
        except ValueError as e:  # the op's checks, run on the fake values, refused the arguments
            for node in reversed([n for n in graph.nodes if n not in before]):
                graph.erase_node(node)
            note(NAME, f"left {len(group)} AdamW updates alone: the fused op refuses them ({e})")
            continue
        fused.append(group)
    output = graph.find_nodes(op="output")[0]
    for chain in (c for group in fused for c in group):
        for x in (chain.p, chain.m, chain.v):
            if _returned(chain, x):  # the graph returns the tensor the call updated
                output.replace_input_with(chain.new[x], chain.buffers[x])
            else:
                graph.erase_node(chain.copies[x])
    erase_dead(graph, set().union(*(c.nodes for group in fused for c in group)))
    return len(fused)
