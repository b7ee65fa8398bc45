"""A transformers Llama as ``run_step.py --model``'s factory: the library's model, unedited.

    python run_step.py --compile --check --model examples/transformers_llama.py:build_llama
"""
import transformers


def build_llama(vocab_size, context_length, d_model, num_layers, num_heads, d_ff):
    """``LlamaForCausalLM`` of the run's sizes (a quarter as many KV heads as heads, where that
    divides), random weights; its output's ``.logits`` feed the run's loss."""
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, max_position_embeddings=context_length, hidden_size=d_model,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, intermediate_size=d_ff,
        num_key_value_heads=num_heads // 4 if num_heads % 4 == 0 else num_heads, use_cache=False)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
