"""The code a run steps: the reference model, loss and AdamW, or the user's own from
``--model``/``--loss``/``--optimizer`` (``MODULE:NAME``, MODULE importable or a .py file).

The user's code is checked before anything is compiled, each mistake refused in one line naming
the option: a name that is not callable or takes other arguments (at load), a loss that fails on
or returns the wrong shape for a small batch of logits (once the config is known), a model whose
output is not ``[B, S, V]`` logits on a few tokens, an optimizer its class cannot build or that
has no ``step``/``zero_grad`` (once the model is built). A Dynamo traceback of the first step
would say the same thing in a hundred lines.
"""
import dataclasses
import importlib
import importlib.util
import inspect
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


FACTORY_KEYWORDS = ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff")
# What each option's NAME must be, as its refusals say it.
EXPECTED = {
    "model": f"a factory FACTORY({', '.join(k + '=' for k in FACTORY_KEYWORDS)}) returning an nn.Module",
    "loss": "a function FN(logits, targets)",
    "optimizer": "an optimizer class CLASS(params)",
}


def first_line(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    message = str(e).strip()
    return f"{type(e).__name__}: {message.splitlines()[0]}" if message else type(e).__name__


def require_signature(obj, option: str, spec: str, *args, **kwargs) -> None:
    """Refuse ``obj`` unless it is callable with these arguments (as its option's contract calls it)."""
    if not callable(obj):
        raise SystemExit(f"--{option}: expected {EXPECTED[option]}, got {spec!r}, which is not callable "
                         f"({type(obj).__name__})")
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without a signature: its call will tell
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        name = spec.split(":")[1]
        raise SystemExit(f"--{option}: expected {EXPECTED[option]}, got {name}{signature} ({e})") from None


# How each option's NAME is called: (positional, keyword) arguments of that shape.
CALLS = {"model": ((), dict.fromkeys(FACTORY_KEYWORDS)), "loss": ((None, None), {}), "optimizer": ((None,), {})}


def load_user_code(spec: str, option: str):
    """``--model``/``--loss``/``--optimizer``'s ``MODULE:NAME``, refused unless callable as the option calls it."""
    obj = load_object(spec, option)
    call_args, call_kwargs = CALLS[option]
    require_signature(obj, option, spec, *call_args, **call_kwargs)
    return obj


def probe_shape(cfg: ModelConfig) -> tuple[int, int]:
    """A few tokens of the run's shape: ``[B, S]`` at most 2 × 8."""
    return min(cfg.batch, 2), min(cfg.seq, 8)


def check_loss(loss_fn, cfg: ModelConfig, dtype: torch.dtype) -> None:
    """``--loss`` on random logits ``[b, s, V]`` (on the CPU) returns a scalar or one loss per token."""
    b, s = probe_shape(cfg)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(b, s, cfg.vocab, generator=generator).to(dtype)
    targets = torch.randint(cfg.vocab, (b, s), generator=generator)
    on = f"on logits [{b}, {s}, {cfg.vocab}] and targets [{b}, {s}]"
    try:
        loss = loss_fn(logits, targets)
    except Exception as e:
        raise SystemExit(f"--loss: FN(logits, targets) failed {on}: {first_line(e)}") from None
    if not (isinstance(loss, torch.Tensor) and loss.is_floating_point() and loss.numel() in (1, b * s)):
        got = f"shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}"
        raise SystemExit(f"--loss: expected a floating-point scalar or one loss per token ([], [B, S] or [B·S]) "
                         f"{on}, got {got}")


def logits_of(output):
    """A model's logits: its output, or the ``.logits`` of a transformers ``ModelOutput``."""
    return output if isinstance(output, torch.Tensor) else getattr(output, "logits", output)


def check_model(model: torch.nn.Module, cfg: ModelConfig, device: torch.device) -> None:
    """``--model``'s module maps a few token ids ``[b, s]`` to logits ``[b, s, V]`` (or an output holding them)."""
    b, s = probe_shape(cfg)
    ids = torch.randint(cfg.vocab, (b, s), generator=torch.Generator().manual_seed(0)).to(device)
    try:
        with torch.no_grad():
            logits = logits_of(model(ids))
    except Exception as e:
        raise SystemExit(f"--model: the model failed on token ids [{b}, {s}]: {first_line(e)}") from None
    if not (isinstance(logits, torch.Tensor) and tuple(logits.shape) == (b, s, cfg.vocab)):
        got = f"shape {list(logits.shape)}" if isinstance(logits, torch.Tensor) else f"a {type(logits).__name__}"
        raise SystemExit(f"--model: expected logits [B, S, V] = [{b}, {s}, {cfg.vocab}] from token ids [{b}, {s}], "
                         f"got {got}")


def build_user_model(factory, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The user's model from ``--model``'s factory, on ``device`` in ``dtype``, checked on a few tokens."""
    try:
        with torch.device(device):
            model = factory(vocab_size=cfg.vocab, context_length=cfg.seq, d_model=cfg.d_model,
                            num_layers=cfg.layers, num_heads=cfg.heads, d_ff=cfg.d_ff)
    except Exception as e:
        raise SystemExit(f"--model: FACTORY(...) failed: {first_line(e)}") from None
    if not isinstance(model, torch.nn.Module):
        raise SystemExit(f"--model: expected a factory returning an nn.Module, got {type(model).__name__}")
    model = model.to(device=device, dtype=dtype)
    check_model(model, cfg, device)
    return model


def build_optimizer(optimizer_class, model: torch.nn.Module):
    """``CLASS(model.parameters())``, refused in one line if it fails or has no ``step``/``zero_grad``."""
    try:
        optimizer = optimizer_class(model.parameters())
    except Exception as e:
        raise SystemExit(f"--optimizer: CLASS(model.parameters()) failed: {first_line(e)}") from None
    missing = [m for m in ("step", "zero_grad") if not callable(getattr(optimizer, m, None))]
    if missing:
        raise SystemExit(f"--optimizer: expected an optimizer with step() and zero_grad(), got a "
                         f"{type(optimizer).__name__} without {' or '.join(m + '()' for m in missing)}")
    return optimizer


def make_train_step(model, loss_fn, optimizer):
    """The leaderboard's step (docs/reference.md §1) over the given model, loss and optimizer."""

    def train_step(inputs, targets):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(logits_of(model(inputs)), targets).sum()
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
        """The code of ``--model``/``--loss``/``--optimizer``, each callable as its option says."""
        code = {option: load_user_code(getattr(args, option), option) for option in CALLS if getattr(args, option)}
        return cls(
            factory=code.get("model"),
            loss_fn=code.get("loss", cross_entropy),
            optimizer_class=code.get("optimizer", AdamW),
            own=bool(code),
        )

    def check_loss(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        """The user's loss on a few random logits of the run's config (the reference's is ours)."""
        if self.loss_fn is not cross_entropy:
            check_loss(self.loss_fn, cfg, dtype)

    def build_model(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
        if self.factory is None:
            return build_model(cfg, device, dtype)
        return build_user_model(self.factory, cfg, device, dtype)

    def train_step(self, model: torch.nn.Module) -> Callable:
        """The step over ``model`` with a new optimizer of its parameters."""
        return make_train_step(model, self.loss_fn, build_optimizer(self.optimizer_class, model))
