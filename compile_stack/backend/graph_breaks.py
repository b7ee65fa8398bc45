"""Graph breaks in the user's or a library's code: fewer of them, and the rest named.

A graph break between an LM head and its loss leaves the logits made in full
(the fused loss needs both in one graph), so the breaks that cost nothing to
avoid are avoided: a ``logging.Logger`` call (transformers' ``warning_once``
in its ``loss_function``) is a no-op in traced code (Dynamo's
``ignore_logging_functions``); the message is a warning, not a result.
Every other break Dynamo takes outside our package and torch, other than the
step's own ``loss.backward()``, is noted in the pass report with its
``file:line`` and Dynamo's reason.
"""
import logging
from pathlib import Path

import torch

from passes.registry import note
from torch_internals import dynamo

# The Logger methods traced code calls (warning_once/info_once: transformers adds them to Logger).
_LOG_METHODS = ("debug", "info", "warning", "warn", "error", "critical", "log", "warning_once", "info_once")
_TORCH = str(Path(torch.__file__).parent)
# Where a break is the package's own business (its routing).
_OURS = tuple(str(Path(__import__(m).__file__).parent) for m in ("compile_stack", "passes"))


def logging_as_no_ops():
    """Dynamo's config, patched so that Logger calls in traced code are skipped, not graph breaks."""
    methods = {m for name in _LOG_METHODS if (m := getattr(logging.Logger, name, None)) is not None}
    return dynamo.functions_ignored(methods)


def note_break(gm: torch.fx.GraphModule) -> None:
    """Note the graph break that ended ``gm``'s capture, if it is in user or library code."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not reason.graph_break or not reason.user_stack:
        return
    # A break inside torch (an autograd.Function Dynamo cannot trace) is named by the line calling into it.
    frames = [f for f in reason.user_stack if not f.filename.startswith(_TORCH)]
    why = " ".join(reason.reason.split())
    if not frames or frames[-1].filename.startswith(_OURS) or "Tensor.backward()" in why:
        return
    frame = frames[-1]
    why = why.removeprefix("Graph break: ").removeprefix("Graph break in user code: ")
    note("step", f"graph break at {frame.filename}:{frame.lineno} ({why[:200]}): the code before and after it "
                 "compile as separate graphs")
