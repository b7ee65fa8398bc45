"""Hugging Face transformers models, unedited, compiled by ``compile_step`` as a new user would.

Tiny configs from each library's config class, random weights, ``torch.optim.AdamW``, the step
``model(ids, labels=labels).loss`` (transformers' own ``ForCausalLMLoss``: shift, ignore_index
-100) or the user's ``F.cross_entropy`` over ``.logits``. Each case checks the pass counts, one
block graph per distinct kind of layer, and the compiled step against eager over 3 steps. The
cases are chosen to cover each family, both attention implementations, GQA, tied and untied
heads, fp32 and bf16 autocast once each, not every product of them (whole-model compiles).
litgpt is not among them: litgpt 0.5.13 needs huggingface_hub < 1.4, transformers 5 needs >= 2.4.
"""
import copy
import json

import pytest
import torch
import torch.nn.functional as F

import compile_stack
from tests.helpers import rel_err

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

VOCAB, SEQ, LAYERS = 96, 16, 3
_SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
              num_attention_heads=4, max_position_embeddings=64)


def _model(family: str, attn: str, **config) -> torch.nn.Module:
    if family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=LAYERS, n_head=4, n_positions=64,
                                      attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, **config)
    else:
        cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig,
               "gemma": transformers.GemmaConfig, "gemma2": transformers.Gemma2Config}[family]
        cfg = cls(**{**_SIZES, "head_dim": 16, **config})
    cfg._attn_implementation = attn
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    return model.train()


def _labels_step(model, optimizer, ids, labels, dtype):
    def train_step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not torch.float32):
            loss = model(ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        return loss.detach()
    return train_step


def _logits_step(model, optimizer, ids, labels, dtype):
    def train_step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not torch.float32):
            logits = model(ids).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        return loss.detach()
    return train_step


def _run(model, make_step, dtype=torch.float32, steps=3):
    """Eager and compiled losses and final weights of ``steps`` steps from the same start."""
    ids = torch.randint(0, VOCAB, (2, SEQ))
    labels = ids.clone()
    labels[0, :3] = -100  # padding, as a collator marks it
    results = []
    for compiled in (False, True):
        m = copy.deepcopy(model)
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-3)
        step = make_step(m, optimizer, ids, labels, dtype)
        if compiled:
            torch._dynamo.reset()
            step = compile_stack.compile_step(step, codegen=False)
        losses = torch.stack([step() for _ in range(steps)])
        results.append((losses, [p.detach().clone() for p in m.parameters()], step))
    (eager_losses, eager_params, _), (losses, params, compiled_step) = results
    tol = 2e-5 if dtype is torch.float32 else 2e-2
    assert rel_err(losses, eager_losses) < tol, (losses, eager_losses)
    # All weights as one vector: under AdamW turns a zero-initialised bias's rounding-level
    # gradient differences into whole-lr steps, which no per-tensor tolerance would survive.
    assert rel_err(torch.cat([p.flatten() for p in params]), torch.cat([e.flatten() for e in eager_params])) < tol
    return compiled_step


CASES = [
    # family, attention, config, step, dtype
    pytest.param("llama", "sdpa", dict(num_key_value_heads=2, tie_word_embeddings=False), _labels_step,
                 torch.float32, id="llama-sdpa-gqa-untied-labels"),
    pytest.param("qwen3", "eager", dict(num_key_value_heads=2, tie_word_embeddings=True), _logits_step,
                 torch.float32, id="qwen3-eager-gqa-tied-own-loss"),
    pytest.param("qwen2", "sdpa", dict(num_key_value_heads=4, use_cache=False), _labels_step,
                 torch.bfloat16, id="qwen2-sdpa-bf16-no-cache"),
    pytest.param("gemma", "eager", dict(num_key_value_heads=1), _labels_step, torch.float32,
                 id="gemma-eager-mqa-tied-labels"),
    pytest.param("gpt2", "sdpa", dict(), _labels_step, torch.float32, id="gpt2-sdpa-tied-labels"),
    pytest.param("mistral", "sdpa", dict(num_key_value_heads=2, sliding_window=None), _logits_step,
                 torch.bfloat16, id="mistral-sdpa-gqa-bf16-own-loss"),
]


@pytest.mark.parametrize("family, attn, config, make_step, dtype", CASES)
def test_every_pass_and_one_block_graph(family, attn, config, make_step, dtype):
    step = _run(_model(family, attn, **config), make_step, dtype)
    counts = step.report.as_dict(["attention", "rope", "cross_entropy", "adamw"])
    rotary = family != "gpt2"
    assert counts == {"attention": LAYERS, "rope": 2 * LAYERS if rotary else 0, "cross_entropy": 1, "adamw": 1}, \
        (counts, step.report.notes)
    assert step.block_graphs == 1, step.report.notes
    assert not [n for n in step.report.notes if "graph break" in n], step.report.notes


def test_sliding_window_layers_are_left_alone_and_compile_as_their_own_kind():
    """Qwen2 with its first layer full and the others sliding (window 4 < 16): full attention is
    replaced, sliding is not (a note says why), and the layers compile as two kinds, not three."""
    model = _model("qwen2", "eager", num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
                   max_window_layers=1)
    assert model.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    step = _run(model, _labels_step)
    assert step.report.replacements["attention"] == 1, step.report.notes
    assert step.report.replacements["cross_entropy"] == 1 and step.report.replacements["adamw"] == 1, step.report.notes
    assert any(n.startswith("attention:") for n in step.report.notes), step.report.notes
    assert step.block_graphs == 2, step.report.notes


def test_soft_capped_attention_logits_are_left_alone():
    """Gemma 2 caps its attention scores with tanh (and its final logits): no fused op computes
    that, so attention stays as written, with a note, and the result equals eager."""
    model = _model("gemma2", "eager", num_key_value_heads=2, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0, sliding_window=64)
    step = _run(model, _labels_step)
    assert step.report.replacements["attention"] == 0
    assert step.report.replacements["adamw"] == 1
    assert any(n.startswith("attention:") for n in step.report.notes), step.report.notes


def test_run_step_takes_a_transformers_model_factory(tmp_path):
    """``--model examples/transformers_llama.py:build_llama``: the step's loss reads the output's
    ``.logits``; every pass fires and the compiled step checks against eager."""
    import run_step

    out = tmp_path / "out.json"
    code = run_step.main(["--compile", "--check", "--device", "cpu", "--dtype", "float32", "--steps", "1",
                          "--warmup", "0", "--model", "examples/transformers_llama.py:build_llama",
                          "--json", str(out), "--cache-dir", str(tmp_path / "cache")])
    summary = json.loads(out.read_text())
    assert code == 0 and summary["check"]["ok"] is True
    layers = summary["config"]["layers"]
    passes = summary["passes"]
    assert passes["attention"] == layers and passes["rope"] == 2 * layers, passes
    assert passes["cross_entropy"] == 1 and passes["adamw"] >= 1, passes


def test_alibi_attention_is_left_alone():
    """MPT adds ALiBi's per-head linear biases to the scores: left as written, with a note."""
    cfg = transformers.MptConfig(vocab_size=VOCAB, d_model=64, n_layers=LAYERS, n_heads=4, max_seq_len=64,
                                 attn_config={"alibi": True}, resid_pdrop=0.0, emb_pdrop=0.0)
    step = _run(transformers.AutoModelForCausalLM.from_config(cfg).train(), _labels_step)
    assert step.report.replacements["attention"] == 0
    assert step.report.replacements["cross_entropy"] == 1 and step.report.replacements["adamw"] == 1, step.report.notes
    assert any(n.startswith("attention:") and "add" in n for n in step.report.notes), step.report.notes
    assert step.block_graphs == 1
