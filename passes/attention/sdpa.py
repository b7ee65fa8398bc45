"""``F.scaled_dot_product_attention``'s aten kernels: which calls the op can replace, their
arguments read by name from the schema."""
import math
import operator

from torch.fx.operator_schemas import normalize_function

from custom_ops.attention import HEAD_DIMS
from passes.attention.common import _shape, aten
from passes.attention.masks import Piecewise, _causal_bias, _is_causal_keep, _mask_value
from passes.rejection import NoMatch

# SDPA's aten kernels -> their backward; arguments are read by name from the schema.
SDPA_OPS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default:
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_flash_attention.default: aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_efficient_attention.default:
        aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_cudnn_attention.default: aten._scaled_dot_product_cudnn_attention_backward.default,
}


def _sdpa_plan(node):
    kw = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs
    q, k, v = kw["query"], kw["key"], kw["value"]
    if kw.get("dropout_p", 0.0) != 0.0:
        raise NoMatch(f"SDPA {node} has dropout {kw['dropout_p']}")
    sq, sk = _shape(q), _shape(k)
    if len(sq) != 4 or len(sk) != 4 or _shape(v)[:-1] != sk[:-1] or sk[0] != sq[0] or sq[1] % sk[1] \
            or _shape(v)[-1] != sq[-1] or sk[-1] != sq[-1] or sq[-1] not in HEAD_DIMS:
        raise NoMatch(f"SDPA {node} shapes q{sq} k{sk} v{_shape(v)} (head dim or heads) not supported")
    causal = bool(kw.get("is_causal", False))
    mask = kw.get("attn_mask", kw.get("attn_bias"))
    if mask is not None:  # a causal mask: bool (True keeps) or additive (0 / -inf)
        if causal or sq[-2] != sk[-2]:
            raise NoMatch(f"SDPA {node} has a mask and is_causal, or Sq != Sk")
        value = _mask_value(mask)
        if isinstance(value, Piecewise) and isinstance(value.a, bool):
            _is_causal_keep(value, True, mask, sq[-2], sk[-2])
        else:
            _causal_bias(mask, sq[-2], sk[-2])
        causal = True
    if causal and sq[-2] != sk[-2]:
        raise NoMatch(f"SDPA {node} is causal with Sq != Sk")
    scale = kw.get("scale") or 1.0 / math.sqrt(sq[-1])
    outs = {u.args[1]: u for u in node.users if u.target is operator.getitem}
    out = outs.get(0)
    bwds = [u for u in node.users if u.target is not operator.getitem]
    bwds += [b for g in outs.values() for b in g.users if b.target is SDPA_OPS[node.target]]
    bwds = list(dict.fromkeys(bwds))
    if any(b.target is not SDPA_OPS[node.target] or tuple(b.args[1:4]) != (q, k, v) for b in bwds) or len(bwds) > 1:
        raise NoMatch(f"SDPA {node} has outputs used by something other than its backward")
    for i, g in outs.items():
        if i != 0 and any(u not in bwds for u in g.users):
            raise NoMatch(f"SDPA {node} output {i} (logsumexp/rng state) is used outside its backward")
    bwd = bwds[0] if bwds else None
    grads = {u.args[1]: u for u in bwd.users} if bwd is not None else {}
    if any(i > 2 and g.users for i, g in grads.items()):
        raise NoMatch(f"SDPA backward {bwd} has a used bias grad")
    return dict(q=q, k=k, v=v, causal=causal, scale=float(scale), out=out, bwd=bwd, grads=grads)
