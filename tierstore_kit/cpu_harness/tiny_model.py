"""A tiny random-weight Llama and byte-level BPE tokenizer, built locally with a fixed seed."""

from __future__ import annotations

import os

TEXT = """
The hierarchical cache keeps attention keys and values in device memory, in host memory and on
storage. When a conversation comes back after a few minutes, its prefix has usually left the
device and the host, and without a storage tier it must be computed again. Reading a page back
from a fast disk is much cheaper than recomputing it, so the storage tier turns misses into hits.
Agents reuse long contexts: a system prompt, a list of tools, documents and the history of a task.
Every turn repeats what came before and adds a little. The radix tree finds the longest prefix
that is cached, and the storage backend is asked for the pages that follow it.
A page is a fixed number of tokens. Its key is a hash chain over the tokens of every page before
it, so equal prefixes give equal keys on every machine that runs the same model.
""".strip()

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build(path: str, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
          head_dim: int | None = None) -> str:
    """Write a random Llama and its tokenizer to ``path`` (once); return ``path``.

    The defaults give the tiny CPU model; scripts/e2e_gpu.py asks for a larger one.
    ``head_dim`` (default ``hidden // heads``) sets the KV bytes per token apart from the
    hidden size: scripts/loadtest_tiers.py uses it for much KV from little compute.
    """
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(fast), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim or hidden // heads,
        max_position_embeddings=16384,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
        torch_dtype="bfloat16", tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


if __name__ == "__main__":
    import sys

    print(build(sys.argv[1]))
