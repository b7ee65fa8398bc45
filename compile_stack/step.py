"""The train step, eager or compiled.

The harness semantics exactly (REFERENCE.md §1)::

    optimizer.zero_grad(set_to_none=True)
    loss = cross_entropy(model(inputs), targets).sum()
    loss.backward()
    optimizer.step()

Compiled, every tensor op of it runs in code Inductor generated: forward and
loss as one Dynamo graph whose backward AOTAutograd derives (so ``backward()``
runs compiled code) — or, with ``regional`` (run_step.py's default), as three graphs whose block graph
all blocks share (``regional.py``) — and ``optimizer.step`` compiled as its
own graph. We compile the optimizer's own ``step`` rather than rewrite it as a
functional update, so the user's optimizer code is what runs: our
``param_data`` pass makes its ``p.data -= …`` compilable, and parameters and
states are updated in place, so references the user holds see the new values.
"""
import contextlib
import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from compile_stack.capture import PassBackend
from compile_stack.inspection import InspectionWriter
from compile_stack.reference import cross_entropy
from compile_stack.regional import BlockwiseLoss


@dataclasses.dataclass
class StepOptions:
    compile: bool = False
    passes: list[str] | None = None  # None: the project's pass pipeline
    inspect_dir: Path | None = None
    memory_budget: float | None = None
    codegen: bool = True  # False: run our passes' aten graphs as they are (tests, debugging)
    regional: bool = False  # compile embedding / one block / head+loss apart (regional.py)


def compile_backends(options: StepOptions, inspect: bool = True) -> tuple[PassBackend, PassBackend]:
    """The model's and the optimizer's backends, writing to one inspection directory (if any)."""
    writer = InspectionWriter(options.inspect_dir) if options.inspect_dir and inspect else None
    return tuple(
        PassBackend(options.passes, writer, options.memory_budget, name=name, codegen=options.codegen)
        for name in ("model", "optimizer")
    )


class TrainStep:
    """Callable ``step(inputs, targets) -> loss`` (the loss tensor, not synced)."""

    def __init__(self, model: torch.nn.Module, optimizer, options: StepOptions):
        self.model = model
        self.optimizer = optimizer
        self.options = options
        self.loss_fn: Callable = self._loss
        self.optimizer_step: Callable = optimizer.step
        self.backend = None
        if options.compile:
            self.backend, optimizer_backend = compile_backends(options)
            if options.regional:
                self.loss_fn = BlockwiseLoss(model)
                self.loss_fn.compile_pieces(self.backend)
            else:
                self.loss_fn = torch.compile(self._loss, backend=self.backend, fullgraph=True)
            self.optimizer_step = torch.compile(optimizer.step, backend=optimizer_backend, fullgraph=True)

    def _loss(self, inputs, targets):
        return cross_entropy(self.model(inputs), targets).sum()

    def __call__(self, inputs, targets):
        with step_context(self.backend, self.optimizer):
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.loss_fn(inputs, targets)
            loss.backward()
            self.optimizer_step()
        return loss


@contextlib.contextmanager
def step_context(backend: PassBackend | None, optimizer):
    """What a step runs inside: our passes and settings (when compiled), and the
    optimizer's step counter traced as a symbol."""
    with (
        backend.active() if backend else contextlib.nullcontext(),
        torch.compiler.config.patch(dynamic_sources=_step_counter_sources(optimizer)),
    ):
        yield


def _step_counter_sources(optimizer) -> str:
    """Dynamo sources of the optimizer's int attributes (its step counter), to trace as symbols.

    A hand-written optimizer keeps its step count as a Python int, which Dynamo
    would first bake in as a constant and only make symbolic on the second
    step, compiling the whole update twice. Marking it dynamic up front
    compiles the update once.
    """
    names = [name for name, value in vars(optimizer).items() if type(value) is int]
    return ",".join(f"L['fn'].__self__.{name}" for name in names)
