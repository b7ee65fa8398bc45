"""compile_stack's public API on a user's own code: compile_step, Backend, blocks compiled once."""
import copy
import importlib.util
import json
import os
import sys
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import compile_stack
import run_step
from compile_stack.backend import PassBackend
from compile_stack.capture import blocks
from passes import registry
from tests import user_models
from tests.user_corpus import VOCAB, batches, make_train_step, mean_cross_entropy


def gpt(layers: int, d_model: int = 32, heads: int = 2):
    return user_models.build_gpt(vocab_size=VOCAB, context_length=16, d_model=d_model, num_layers=layers,
                                 num_heads=heads, d_ff=48)


def compiled_gpt_step(layers: int, **options):
    torch._dynamo.reset()
    registry.current().clear()
    torch.manual_seed(0)
    model = gpt(layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = compile_stack.compile_step(make_train_step(model, mean_cross_entropy, optimizer), codegen=False, **options)
    for inputs, targets in batches(2):
        step(inputs, targets)
    return step, optimizer


def test_repeated_blocks_compile_once_whatever_the_depth():
    counts = {}
    for layers in (2, 8):
        step, _ = compiled_gpt_step(layers)
        (calls,) = step.block_calls
        assert len(calls.blocks) == layers
        counts[layers] = (step.backend.graphs, calls.backend.graphs)
        # Every layer's attention runs our op: the shared block graph counts once per layer.
        assert registry.current().replacements["attention"] == layers
        assert registry.current().replacements["cross_entropy"] == 1
    # The embedding and the head with the loss; one block graph every layer calls.
    assert counts[2] == counts[8] == (2, 1)


def test_a_second_models_blocks_compile_with_static_shapes(monkeypatch):
    """Two models of other sizes compiled in one process: Dynamo's automatic-dynamic history is
    keyed by code location, which every block compile shares, so the second model's blocks would
    compile with symbolic sizes (which our passes leave alone) unless asked for static ones."""
    symbolic = []
    compile_graph = PassBackend._compile

    def recording(self, gm, example_inputs, *args, **kwargs):
        if self.name == "block":
            symbolic.append(any(isinstance(x, torch.SymInt) or isinstance(x, torch.Tensor)
                                and any(isinstance(size, torch.SymInt) for size in x.shape) for x in example_inputs))
        return compile_graph(self, gm, example_inputs, *args, **kwargs)

    monkeypatch.setattr(PassBackend, "_compile", recording)
    torch._dynamo.reset()
    for d_model, seq in ((32, 16), (64, 8)):  # a sequence length the weights do not pin down
        registry.current().clear()
        torch.manual_seed(0)
        model = gpt(2, d_model=d_model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = compile_stack.compile_step(make_train_step(model, mean_cross_entropy, optimizer), codegen=False)
        for inputs, targets in batches(2, seq=seq):
            step(inputs, targets)
        assert registry.current().replacements["attention"] == 2
    assert symbolic == [False, False]


def test_blocks_of_a_model_passed_as_an_argument_are_cut_from_the_graph():
    """A model the step does not reach by name: Dynamo traces every block, the backend cuts the
    graph at them and compiles one block's segment for all."""
    counts = {}
    for layers in (2, 5):
        torch._dynamo.reset()
        registry.current().clear()
        torch.manual_seed(0)
        model = gpt(layers)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        def train_step(model, inputs, targets):
            optimizer.zero_grad(set_to_none=True)
            mean_cross_entropy(model(inputs), targets).backward()
            optimizer.step()

        step = compile_stack.compile_step(train_step, codegen=False)
        (inputs, targets), = batches(1)
        step(model, inputs, targets)
        assert step.block_calls == []
        counts[layers] = step.backend.graphs
        assert registry.current().replacements["attention"] == layers
        assert registry.current().replacements["cross_entropy"] == 1
    assert counts[2] == counts[5] == 3  # the embedding, the shared block segment, head + loss


def test_blocks_off_compiles_the_forward_as_one_graph():
    step, _ = compiled_gpt_step(3, blocks=False)
    assert step.backend.graphs == 1 and registry.current().replacements["attention"] == 3


def test_a_model_without_repeated_blocks_is_compiled_whole():
    torch._dynamo.reset()
    model = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, VOCAB))
    assert blocks.block_list(model) == []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = compile_stack.compile_step(make_train_step(model, mean_cross_entropy, optimizer), codegen=False)
    (inputs, targets), = batches(1)
    step(inputs, targets)
    assert step.backend.graphs == 1


def test_block_list_finds_the_largest_run_of_one_class():
    model = gpt(4)
    assert blocks.block_list(model) == list(model.layers)


def test_the_optimizers_step_is_routed_only_during_the_call():
    step, optimizer = compiled_gpt_step(2)
    assert "step" not in vars(optimizer)  # the class's own step again
    assert step.optimizer_steps[0].optimizer is optimizer
    assert registry.current().replacements["adamw"] == 1  # compiled once, fused


def test_a_models_zero_grad_runs_before_the_forward_graph():
    """``model.zero_grad()`` in the step runs eagerly, as the optimizer's does: traced, Dynamo would
    set the grads to None only after the forward graph ran, the last step's gradients alive
    through it. After the call the model's zero_grad is the class's again."""
    torch._dynamo.reset()
    registry.current().clear()
    counters.clear()
    torch.manual_seed(0)
    model = gpt(2)
    eager_model = copy.deepcopy(model)

    def make_step(model, optimizer):
        def train_step(inputs, targets):
            model.zero_grad(set_to_none=True)
            loss = mean_cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            return loss
        return train_step

    step = compile_stack.compile_step(make_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3)),
                                      codegen=False)
    eager = make_step(eager_model, torch.optim.AdamW(eager_model.parameters(), lr=1e-3))
    for inputs, targets in batches(2):
        torch.testing.assert_close(step(inputs, targets), eager(inputs, targets), rtol=1e-4, atol=1e-5)
    assert any("Module.zero_grad" in reason and "torch.compiler.disable" in reason
               for reason in counters["graph_break"]), dict(counters["graph_break"])
    assert "zero_grad" not in vars(model)
    assert registry.current().replacements["cross_entropy"] == 1


def test_backend_works_without_a_context_manager():
    """The lazily run backward uses our passes without the caller entering anything."""
    torch._dynamo.reset()
    registry.current().clear()
    torch.manual_seed(0)
    model = gpt(2)
    eager_model = gpt(2)
    eager_model.load_state_dict(model.state_dict())
    (inputs, targets), = batches(1)

    def loss_fn(m):
        return lambda x, y: mean_cross_entropy(m(x), y)

    loss = torch.compile(loss_fn(model), backend=compile_stack.Backend(codegen=False))(inputs, targets)
    loss.backward()
    eager_loss = loss_fn(eager_model)(inputs, targets)
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    assert registry.current().replacements["attention"] == 2 and registry.current().replacements["cross_entropy"] == 1


def test_compile_step_refuses_bad_arguments():
    with pytest.raises(TypeError, match="train_step"):
        compile_stack.compile_step("not a function")
    with pytest.raises(ValueError, match="memory_budget"):
        compile_stack.compile_step(lambda: None, memory_budget=1.5)
    for share in (1.0, 0.0, 1, "0.5", -0.2):
        with pytest.raises(ValueError, match=r"offload_activations: expected a share of the host's memory in \(0, 1\)"):
            compile_stack.compile_step(lambda: None, offload_activations=share)
    with pytest.raises(ValueError, match="offload_activations: expected False with a fixed memory_budget"):
        compile_stack.compile_step(lambda: None, memory_budget=0.5, offload_activations=True)


@pytest.mark.parametrize("step, options, error, message", [
    (42, {}, TypeError, r"^train_step: expected a callable \(the user's train-step function\), got 42 \(int\)$"),
    (nn.Linear(3, 3), {}, TypeError, r"^train_step: expected the train-step function .*, got the model Linear; "
                                     r"to compile a model's forward alone: torch.compile\(model, backend="),
    (None, {"passes": "attention"}, TypeError, r"^passes: expected None or a list of pass names, got 'attention'"),
    (None, {"passes": ["attention", 3]}, TypeError, r"^passes: expected None or a list of pass names"),
    (None, {"memory_budget": True}, TypeError, r"^memory_budget: expected None or a number in \[0, 1\], got True"),
    (None, {"memory_budget": "0.5"}, TypeError, r"^memory_budget: expected None or a number"),
    (None, {"codegen": "no"}, TypeError, r"^codegen: expected True or False, got 'no'"),
    (None, {"inspect_dir": 3}, TypeError, r"^inspect_dir: expected None or a path, got 3"),
    (None, {"inspect_dir": "FILE"}, ValueError, r"^inspect_dir: expected a writable directory .*File exists"),
    (None, {"inspect_dir": "FILE/below"}, ValueError, r"^inspect_dir: expected a writable directory .*FILE/below"),
])
def test_compile_step_names_the_bad_argument(step, options, error, message, tmp_path, monkeypatch):
    """Each misuse is refused in one line naming the argument, before anything is compiled."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("")
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("compiled before refusing"))
    with pytest.raises(error, match=message):
        compile_stack.compile_step(step if step is not None else (lambda: None), **options)


def test_a_callable_object_is_a_step():
    """A step written as a callable object: its attributes are searched like a closure's."""
    torch._dynamo.reset()

    class Trainer:
        def __init__(self):
            self.model = nn.Linear(3, 2)
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

        def __call__(self, x):
            self.optimizer.zero_grad()
            loss = self.model(x).square().sum()
            loss.backward()
            self.optimizer.step()
            return loss

    trainer = Trainer()
    step = compile_stack.compile_step(trainer, codegen=False)
    assert step.models == [trainer.model] and len(step.optimizer_steps) == 1
    x = torch.randn(4, 3)
    eager = copy.deepcopy(trainer)
    torch.testing.assert_close(step(x), eager(x))
    torch.testing.assert_close(trainer.model.weight, eager.model.weight)


def test_a_model_on_the_meta_device_is_refused():
    model = nn.Linear(3, 2, device="meta")
    with pytest.raises(ValueError, match=r"^train_step: expected models with data to compute on, got Linear with "
                                         r"weight on the meta device .*to_empty"):
        compile_stack.compile_step(lambda x: model(x).sum())


def test_concurrent_calls_are_refused():
    """The step routes its optimizers' and models' methods for a call: a second call at once is refused."""
    import threading

    torch._dynamo.reset()
    inside, release = threading.Event(), threading.Event()

    @torch._dynamo.disable
    def wait():
        inside.set()
        release.wait(60)

    model = nn.Linear(3, 2)

    def train_step(x):
        y = model(x).sum()
        wait()
        return y

    step = compile_stack.compile_step(train_step, codegen=False)
    x = torch.randn(2, 3)
    release.set()
    step(x)  # compiled, in this thread
    inside.clear()
    release.clear()
    errors = []
    other = threading.Thread(target=lambda: errors.append(step(x)))
    other.start()
    assert inside.wait(60)
    try:
        with pytest.raises(RuntimeError, match=r"^train_step: the compiled step is already running .*not thread-safe"):
            step(x)
    finally:
        release.set()
        other.join(60)
    assert len(errors) == 1 and not isinstance(errors[0], Exception)
    step(x)  # free again


@pytest.mark.parametrize("offload", [None, False, True, 0.9])
def test_offload_activations_reaches_the_step_options(offload):
    """The option is kept as given; what it buys in host bytes is memory_plan/host.py's (test_levers.py)."""
    assert compile_stack.compile_step(lambda: None, offload_activations=offload).options.offload_activations is offload


def test_user_step_without_an_optimizer_in_reach_still_compiles():
    """An optimizer reached only through an argument is traced inline with the step: slower to
    compile, same results."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB))

    def train_step(opt, inputs, targets):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
        opt.step()

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    step = compile_stack.compile_step(train_step, codegen=False)
    (inputs, targets), = batches(1)
    step(optimizer, inputs, targets)
    assert step.optimizer_steps == []
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("option, spec, message", [
    ("--model", "nocolon", "--model: expected MODULE:NAME"),
    ("--loss", "a:b:c", "--loss: expected MODULE:NAME"),
])
def test_run_step_refuses_malformed_user_code_specs(option, spec, message, capsys):
    with pytest.raises(SystemExit):
        run_step.parse_args([option, spec])
    assert message in capsys.readouterr().err


def test_run_step_names_a_missing_user_module(tmp_path):
    with pytest.raises(SystemExit, match="--model: cannot import 'no_such_module'"):
        run_step.main(["--model", "no_such_module:build", "--steps", "1", "--cache-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="--optimizer: module 'tests.user_models' has no 'Nope'"):
        run_step.main(["--optimizer", "tests.user_models:Nope", "--steps", "1", "--cache-dir", str(tmp_path)])


@pytest.mark.slow
def test_run_step_compiles_a_users_model_loss_and_optimizer(tmp_path):
    """Every pass fires on the user's own code, generated code and all (the tiny preset on the CPU)."""
    out = tmp_path / "out.json"
    code = run_step.main(["--compile", "--check", "--device", "cpu", "--dtype", "float32", "--steps", "1",
                          "--warmup", "0", "--model", "tests/user_models.py:build_gpt",
                          "--loss", "tests.user_models:token_loss", "--optimizer", "tests.user_models:MyAdamW",
                          "--json", str(out), "--cache-dir", str(tmp_path / "cache")])
    summary = json.loads(out.read_text())
    assert code == 0 and summary["check"]["ok"] is True
    assert summary["model"] == "tests/user_models.py:build_gpt"
    passes = summary["passes"]
    assert passes["attention"] == summary["config"]["layers"] and passes["cross_entropy"] == 1
    assert passes["adamw"] >= 1 and passes["param_data"] > 0


def test_freeing_the_compiled_step_frees_the_model():
    """Nothing of ours keeps the user's model (its parameters, gradients) alive: run_step frees its
    step before building the stock one, and the full preset has no 26 GiB to spare."""
    import gc
    import weakref

    torch._dynamo.reset()
    model = gpt(2)
    weight = weakref.ref(model.layers[0].attn.qkv.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = compile_stack.compile_step(make_train_step(model, mean_cross_entropy, optimizer), codegen=False)
    (inputs, targets), = batches(1)
    step(inputs, targets)
    assert step.block_calls  # the blocks were routed
    del step, model, optimizer
    torch._dynamo.reset()
    gc.collect()
    assert weight() is None


def test_a_trainers_bound_method_finds_its_model_and_optimizer():
    """The step as a method of the user's trainer: its model and optimizer are attributes."""
    torch._dynamo.reset()
    registry.current().clear()

    class Trainer:
        def __init__(self):
            self.model = gpt(2)
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

        def train_step(self, inputs, targets):
            self.optimizer.zero_grad(set_to_none=True)
            loss = mean_cross_entropy(self.model(inputs), targets)
            loss.backward()
            self.optimizer.step()
            return loss

    trainer = Trainer()
    step = compile_stack.compile_step(trainer.train_step, codegen=False)
    for inputs, targets in batches(2):
        step(inputs, targets)
    assert [s.optimizer for s in step.optimizer_steps] == [trainer.optimizer]
    assert [c.blocks for c in step.block_calls] == [list(trainer.model.layers)]
    assert registry.current().replacements["attention"] == 2 and registry.current().replacements["adamw"] == 1


def test_repeated_blocks_without_parameters():
    """Blocks with no tensors of their own (Dynamo's trace still gets their output from fakes)."""
    torch._dynamo.reset()
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB, bias=False)
            self.acts = nn.ModuleList([nn.Tanh(), nn.Tanh(), nn.Tanh()])

        def forward(self, ids):
            x = self.embed(ids)
            for act in self.acts:
                x = x + act(x)
            return self.head(x)

    model = Model()
    eager = Model()
    eager.load_state_dict(model.state_dict())
    (inputs, targets), = batches(1)
    step = compile_stack.compile_step(lambda x, y: mean_cross_entropy(model(x), y), codegen=False)
    assert [len(c.blocks) for c in step.block_calls] == [3]
    torch.testing.assert_close(step(inputs, targets), mean_cross_entropy(eager(inputs), targets))


def test_an_out_of_range_target_raises_at_the_next_call():
    """The fused loss only flags a bad target (a device flag: reading it would sync every step);
    the compiled step reads the flag at its next call and raises the loss's error, once."""
    torch._dynamo.reset()
    registry.current().clear()
    torch.manual_seed(0)
    model = gpt(2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # unfused: no update checks the flag itself
    step = compile_stack.compile_step(make_train_step(model, mean_cross_entropy, optimizer), codegen=False)
    (inputs, targets), = batches(1)
    step(inputs, targets)
    assert registry.current().replacements["cross_entropy"] == 1
    bad = targets.clone()
    bad[0, 3] = VOCAB
    assert torch.isnan(step(inputs, bad))
    with pytest.raises(ValueError, match=r"^targets: expected values in \[0, V\) or ignore_index"):
        step(inputs, targets)
    step(inputs, targets)  # reported once


@pytest.fixture
def users_script(monkeypatch, tmp_path):
    """Runs a user's script from a file as a module of its own, its names the module's globals,
    registered in ``sys.modules`` as ``python script.py`` registers ``__main__``: Dynamo reads a
    frame's globals through its module, and torch 2.11 compiles a function without a source file
    through a wrapper frame of its own. With fresh Dynamo state and an empty pass report."""
    def run(source: str) -> types.ModuleType:
        torch._dynamo.reset()
        registry.current().clear()
        path = tmp_path / "users_script.py"
        path.write_text(source)
        script = importlib.util.module_from_spec(importlib.util.spec_from_file_location(path.stem, path))
        monkeypatch.setitem(sys.modules, script.__name__, script)
        script.__spec__.loader.exec_module(script)
        return script
    return run


SCRIPT_STEP = '''
import torch
import torch.nn as nn
from tests.test_compile_step import gpt
from tests.user_corpus import VOCAB, batches

torch.manual_seed(0)
model = gpt(2)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
(inputs, targets), = batches(1)
{loss_definition}

def train_step():
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss
'''
LOSS_DEFINITIONS = {
    "hand-written": '''
def loss_fn(logits, targets):
    log_probs = logits.float().log_softmax(-1)
    return -log_probs.gather(-1, targets.unsqueeze(-1)).mean()
''',
    "nn.CrossEntropyLoss": '''
criterion = nn.CrossEntropyLoss()

def loss_fn(logits, targets):
    return criterion(logits.view(-1, VOCAB), targets.view(-1))
''',
}


@pytest.mark.parametrize("loss", sorted(LOSS_DEFINITIONS))
def test_a_step_written_at_module_level_is_compiled_whole(loss, users_script):
    """A script's step names only globals: after the zero-grad's break, the frame Dynamo resumes
    in holds no tensor of its own, and Dynamo would skip it (the head and the loss compiled apart,
    no fused cross-entropy). Its resume frames are compiled as the step is."""
    losses = []
    for compiled in (False, True):
        script = users_script(SCRIPT_STEP.format(loss_definition=LOSS_DEFINITIONS[loss]))
        step = compile_stack.compile_step(script.train_step, codegen=False) if compiled else script.train_step
        losses.append([step().detach() for _ in range(2)])
    assert registry.current().replacements["cross_entropy"] == 1
    assert registry.current().replacements["attention"] == 2 and registry.current().replacements["adamw"] == 1
    for eager, compiled in zip(*losses):
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)


def test_a_step_dynamo_runs_eagerly_says_so():
    """Gradient accumulation in a loop that may ``break``: Dynamo cannot resume after ``backward()``
    inside it and runs the step's frame eagerly, and the body cannot run as a function of its own
    (accumulation_loops.py). The model and optimizer still compile, the loss does not, and the
    report says why; the step still equals eager. A step Dynamo compiles has no such note."""
    def accumulating(model, optimizer, micro_batches):
        def train_step():
            for inputs, targets in micro_batches:
                loss = mean_cross_entropy(model(inputs), targets) / len(micro_batches)
                loss.backward()
                if not torch.isfinite(loss):
                    break
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss
        return train_step

    torch._dynamo.reset()
    registry.current().clear()
    steps = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = gpt(2)
        step = accumulating(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batches(2))
        steps.append(compile_stack.compile_step(step, codegen=False) if compiled else step)
    for _ in range(2):
        eager, compiled = (step().detach() for step in steps)
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
    assert registry.current().replacements["attention"] == 2 and registry.current().replacements["cross_entropy"] == 0
    assert any(n.startswith("step: Dynamo ran the step's own code eagerly") for n in registry.current().notes)
    compiled_gpt_step(2)
    assert not any(n.startswith("step:") for n in registry.current().notes)


FUNCTIONAL_ADAMW_SCRIPT = '''
import torch
from tests.test_compile_step import gpt
from tests.user_corpus import batches, mean_cross_entropy

torch.manual_seed(0)
model = gpt(2)
params = list(model.parameters())
exp_avgs = [torch.zeros_like(p) for p in params]
exp_avg_sqs = [torch.zeros_like(p) for p in params]
t = 0
(inputs, targets), = batches(1)

def adamw_update(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01):
    global t
    t += 1
    with torch.no_grad():
        for p, m, v in zip(params, exp_avgs, exp_avg_sqs):
            m.lerp_(p.grad, 1 - beta1)
            v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            p.mul_(1 - lr * weight_decay)
            p.addcdiv_(m / (1 - beta1 ** t), (v / (1 - beta2 ** t)).sqrt_().add_(eps), value=-lr)

def train_step():
    for p in params:
        p.grad = None
    loss = mean_cross_entropy(model(inputs), targets)
    loss.backward()
    adamw_update()
    return loss
'''


def test_a_global_step_counter_is_traced_as_a_symbol(users_script):
    """A hand-written update over module globals counts its steps in a global int: baked in as a
    constant, each step would recompile (the pass firing anew each time) until Dynamo's recompile
    limit left the update eager. Traced as a symbol, the step compiles once and equals eager."""
    losses = []
    for compiled in (False, True):
        script = users_script(FUNCTIONAL_ADAMW_SCRIPT)
        step = compile_stack.compile_step(script.train_step, codegen=False) if compiled else script.train_step
        losses.append([step().detach() for _ in range(4)])
        assert script.t == 4
    assert registry.current().replacements["adamw"] == 1 and registry.current().replacements["cross_entropy"] == 1
    for eager, compiled in zip(*losses):
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)


def test_two_steps_in_one_process_keep_their_own_reports_and_plans(monkeypatch):
    """Two models' train steps in one process (AdamW, SGD): each step's report holds its own
    graphs' replacements only, each its own memory plan (a ledger of a large fake device), the
    first's untouched by the second's compile; ``pass_report()`` without a step is the step
    called last."""
    from compile_stack.memory_plan import MemoryPlan
    from compile_stack.memory_plan.ledger import MemoryLedger

    def plan_of_a_large_device(cls, *args, **kwargs):
        return cls(MemoryLedger(1 << 40, allocated=lambda: 0, future_state=lambda: 0, device=torch.device("cpu")))

    monkeypatch.setattr(MemoryPlan, "for_step", classmethod(plan_of_a_large_device))
    torch._dynamo.reset()
    torch.manual_seed(0)
    first_model, second_model = gpt(2), gpt(3)
    first = compile_stack.compile_step(make_train_step(first_model, mean_cross_entropy,
                                                       torch.optim.AdamW(first_model.parameters())), codegen=False)
    second = compile_stack.compile_step(make_train_step(second_model, mean_cross_entropy,
                                                        torch.optim.SGD(second_model.parameters(), lr=0.1)),
                                        codegen=False)
    (inputs, targets), = batches(1)
    first(inputs, targets)
    first_ledger = dict(first.memory_plan.ledger.reserved)
    second(inputs, targets)
    one, two = compile_stack.pass_report(first), compile_stack.pass_report(second)
    assert (one["replacements"]["attention"], one["replacements"]["cross_entropy"], one["replacements"]["adamw"]) \
        == (2, 1, 1)
    assert (two["replacements"]["attention"], two["replacements"]["cross_entropy"], two["replacements"]["adamw"]) \
        == (3, 1, 0)
    assert compile_stack.pass_report() == two
    first(inputs, targets)  # compiles nothing new: its report unchanged, and now the latest
    assert compile_stack.pass_report() == compile_stack.pass_report(first) == one
    assert first.memory_plan is not second.memory_plan and first_ledger
    assert first.memory_plan.ledger.reserved == first_ledger and second.memory_plan.ledger.reserved
    with pytest.raises(TypeError, match="^step: expected a CompiledStep"):
        compile_stack.pass_report("train")


def test_a_steps_cache_dir_is_used_while_it_runs_and_the_environment_kept(tmp_path, monkeypatch):
    variables = ("COMPILE_STACK_CACHE", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    for name in variables:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "users_own"))
    before = {name: os.environ.get(name) for name in variables}
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = gpt(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = compile_stack.compile_step(make_train_step(model, mean_cross_entropy, optimizer),
                                      cache_dir=tmp_path / "ours")
    assert {name: os.environ.get(name) for name in variables} == before  # nothing set by compile_step
    (inputs, targets), = batches(1)
    step(inputs, targets)
    assert {name: os.environ.get(name) for name in variables} == before
    assert any((tmp_path / "ours" / "inductor").iterdir()), "the step's compiles were cached in its cache_dir"


def test_a_lambda_lr_scheduled_adamw_is_fused_and_the_scheduler_sees_its_step(recwarn):
    """LambdaLR wraps ``optimizer.step`` to note each call; Dynamo skips that wrapper's frame. The
    update beneath it is compiled (fused), the call is noted for the scheduler as the wrapper
    would (no 'optimizer.step() has been overridden' warning), and the losses equal eager's."""
    def run(compiled):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / 4)
        x, y = torch.randn(4, 16), torch.randint(0, 8, (4,))

        def train_step():
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            return loss.detach()

        if compiled:
            torch._dynamo.reset()
            train_step = compile_stack.compile_step(train_step, codegen=False)
        return torch.stack([train_step() for _ in range(4)]), getattr(train_step, "report", None)

    (eager, _), (compiled, report) = run(False), run(True)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    assert report.replacements["adamw"] >= 1, report.notes
    assert not [w for w in recwarn if "lr_scheduler" in str(w.message) or "optimizer.step()" in str(w.message)]


def test_a_graph_break_in_the_users_model_is_noted_with_its_line():
    """A break in the user's (or a library's) code splits the graphs: the report names its file:line
    and Dynamo's reason; the step's own loss.backward() is no such note."""
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = nn.Linear(8, 8), nn.Linear(8, 4, bias=False)

        def forward(self, x):
            h = self.body(x).relu()
            torch._dynamo.graph_break()
            return self.head(h)

    model = Head()
    optimizer = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))

    def train_step():
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()

    torch._dynamo.reset()
    step = compile_stack.compile_step(train_step, codegen=False)
    step()
    breaks = [n for n in step.report.notes if "graph break at" in n]
    line = Head.forward.__code__.co_firstlineno + 2
    assert len(breaks) == 1 and f"{__file__}:{line}" in breaks[0] and "graph_break()" in breaks[0], breaks
