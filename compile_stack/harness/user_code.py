"""The code a run steps: the reference model, loss and AdamW, or the user's own from
``--model``/``--loss``/``--optimizer`` (``MODULE:NAME``, MODULE importable or a .py file)."""
import dataclasses
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from compile_stack.workloads.config import ModelConfig
from compile_stack.workloads.reference import AdamW, build_model, cross_entropy


def load_object(spec: str, option: str):
    """``MODULE:NAME`` -> the object; MODULE is an importable module or a path to a .py file."""
    module_name, name = spec.split(":")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise SystemExit(f"--{option}: no such file {module_name!r}")
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_spec.name] = module  # Dynamo looks a traced function's module up by name
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as e:
        raise SystemExit(f"--{option}: cannot import {module_name!r}: {e}") from None
    if not hasattr(module, name):
        raise SystemExit(f"--{option}: module {module_name!r} has no {name!r}")
    return getattr(module, name)


def build_user_model(factory, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The user's model from ``--model``'s factory, on ``device`` in ``dtype``."""
    with torch.device(device):
        model = factory(vocab_size=cfg.vocab, context_length=cfg.seq, d_model=cfg.d_model, num_layers=cfg.layers,
                        num_heads=cfg.heads, d_ff=cfg.d_ff)
    if not isinstance(model, torch.nn.Module):
        raise SystemExit(f"--model: expected a factory returning an nn.Module, got {type(model).__name__}")
    return model.to(device=device, dtype=dtype)


def make_train_step(model, loss_fn, optimizer):
    """The leaderboard's step (docs/reference.md §1) over the given model, loss and optimizer."""

    def train_step(inputs, targets):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets).sum()
        loss.backward()
        optimizer.step()
        return loss

    return train_step


@dataclasses.dataclass(frozen=True)
class StepCode:
    """The model factory (None: the reference model), loss and optimizer class a run's steps are made of."""

    factory: Callable | None = None
    loss_fn: Callable = cross_entropy
    optimizer_class: type = AdamW
    own: bool = False  # any of them the user's: the stock comparison compiles this code, not the stock parts

    @classmethod
    def from_args(cls, args) -> "StepCode":
        return cls(
            factory=load_object(args.model, "model") if args.model else None,
            loss_fn=load_object(args.loss, "loss") if args.loss else cross_entropy,
            optimizer_class=load_object(args.optimizer, "optimizer") if args.optimizer else AdamW,
            own=bool(args.model or args.loss or args.optimizer),
        )

    def build_model(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
        if self.factory is None:
            return build_model(cfg, device, dtype)
        return build_user_model(self.factory, cfg, device, dtype)

    def train_step(self, model: torch.nn.Module) -> Callable:
        """The step over ``model`` with a new optimizer of its parameters."""
        return make_train_step(model, self.loss_fn, self.optimizer_class(model.parameters()))
