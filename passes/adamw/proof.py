"""Proof: a matched chain, evaluated in float64 on probe values at several values of its scalar
inputs, must be the AdamW update; its coefficients, lr and step are read off on the way (step 2
of the package docstring)."""
import functools
import math
import operator

import torch
from torch.fx import Graph, Node
from torch.fx.node import map_arg

from passes.adamw.common import NAME, _accepted, _Chain, _constant, _Flow, _is_data, _is_fresh, _op_name
from passes.graph_edit import fake_value, reachable
from passes.registry import note
from passes.rejection import NoMatch

# Step values the chains are evaluated at (a step input's value; t is a function of it).
_STEP_PROBES = (0, 1, 6, 999)
# Factors a hyperparameter input's traced value is scaled by at those same probes; input j also
# by (1 + j/3), so that two such inputs never move together.
_HYPER_PROBES = (1.0, 0.5, 2.0, 0.3)
# Agreement required between a chain and the AdamW update in float64.
_RTOL = 1e-9


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


# The gradient of the fourth special probe: small enough that √v' there is far below any eps a user
# sets, so E is read where it dominates the denominator.
_SMALL_G = 1e-9


@functools.cache
def _probes() -> dict[str, torch.Tensor]:
    """Float64 values per role (p, g, m, v), one probe a column.

    Columns 0–4 read off the coefficients (see ``_read_off``), 5–12 are random
    and 13–16 tiny, where √v' is near eps and its placement shows.
    """
    gen = torch.Generator().manual_seed(0)
    special = torch.tensor([[1.0, 1, 0, 0], [0, 1, 0, 0], [0, _SMALL_G, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]],
                           dtype=torch.float64)
    rand = torch.randn(8, 4, generator=gen, dtype=torch.float64)
    rand[:, 3] = torch.rand(8, generator=gen, dtype=torch.float64)
    tiny = torch.randn(4, 4, generator=gen, dtype=torch.float64) * 1e-9
    tiny[:, 3] = torch.rand(4, generator=gen, dtype=torch.float64) * 1e-18
    return dict(zip("pgmv", torch.cat([special, rand, tiny]).T))


def _read_off(p_new, m_new, v_new):
    """(decay, β₁, β₂, A, E) for p' = decay·p − A·m'/(√v' + E), from probe columns 0–4; None if degenerate.

    Columns 1 and 2 have m = v = 0 and g = 1, then g = _SMALL_G: there m' = (1−β₁)g and √v' = √(1−β₂)·g,
    so every β in [0, 1) and every E >= 0 (eps = 0 too) leave both updates finite and distinct."""
    decay = _as_float(p_new[0]) - _as_float(p_new[1])  # p = 1, then 0: the same update
    beta1, beta2 = _as_float(m_new[3]), _as_float(v_new[4])
    if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
        return None
    s = math.sqrt(1 - beta2)
    # A / (√v' + E) per unit of m', at g = 1 and at g = _SMALL_G
    r1, r2 = (-_as_float(p_new[k]) / ((1 - beta1) * g) for k, g in ((1, 1.0), (2, _SMALL_G)))
    if not (math.isfinite(decay) and all(math.isfinite(x) and x > 0 for x in (r1, r2)) and 1 / r1 - 1 / r2 > 0):
        return None
    big_a = (1 - _SMALL_G) * s / (1 / r1 - 1 / r2)  # 1/r = (√v'/m' + E)/A
    big_e = big_a / r2 - _SMALL_G * s
    if abs(big_e) <= 1e-6 * _SMALL_G * s:  # eps = 0: what is left is rounding
        big_e = 0.0
    return decay, beta1, beta2, big_a, big_e


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
        if not all(torch.allclose(got, exp, rtol=_RTOL, atol=0.0, equal_nan=True)
                   for got, exp in zip(outputs, expected)):
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
    return _accepted(chains, _prove_chain, envs, steps, flow, order)


def _prove_chain(chain: _Chain, envs, steps: set[Node], flow: _Flow, order) -> None:
    """Set the chain's step, coefficients and lr from its values at the probes; NoMatch if they are not AdamW's."""
    outputs = [tuple(env[chain.new[x]] for x in (chain.p, chain.m, chain.v)) for env in envs]
    # β₁, β₂ from the first probe that reads off (at a step probe below 1 the bias correction is 0).
    first = next((read for read in (_read_off(*out) for out in outputs) if read is not None), None)
    if first is None:
        raise NoMatch("not of the form p' = decay·p − A·m'/(√v' + E) with 0 <= β < 1")
    if chain.scalars & steps:
        chain.step = _exponent(chain, envs[0], flow, order, first[1:3])
        if chain.step is None:
            raise NoMatch("it reads a step but raises no beta to its power")
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
        raise NoMatch("its update is not AdamW's (reference or torch.optim form) "
                      "with constant betas, eps and weight decay")
    chain.coefficients, lrs = proven_update
    chain.lr = (lrs[0],) if _close(lrs) else _lr_source(chain, [env for env, _, _ in valid], lrs, flow, order)
    if chain.lr is None:
        raise NoMatch("its lr changes with the scalar inputs but is no multiple of "
                      "one value the graph computes")
