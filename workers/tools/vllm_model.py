"""A tiny Llama for trying vLLM without a hub: built offline, in seconds, with random weights.

`LlamaConfig` vocab 1024, hidden 128, 4 heads, 2 KV heads, head_dim 32 (the CPU attention
backend does not take 16), 2 layers, bf16; a byte-level BPE tokenizer trained on a few lines
of text with `tokenizers`, wrapped in `PreTrainedTokenizerFast`. Deterministic for a seed, so
greedy outputs can be compared across instances. Needs `transformers` and `tokenizers`
(vLLM's environment has both).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

VOCAB = 1024
_MARK = "engine-registry-tiny-llama.json"

_CORPUS = [
    "The registry issues one engine id per launch of a tensor parallel group.",
    "Prefill computes the KV cache; decode pulls it over NIXL and generates tokens.",
    "Every rank fetches the engine id and cross-verifies it over the TP group.",
    "A decode instance resolves a remote engine id to its instance through the registry.",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,;:!?'\"()[]{}-_/",
]


def build_tiny_llama(path: Path, *, seed: int = 0) -> Path:
    """Write the model and tokenizer into `path` (once; a marker file says it is complete)."""
    path = Path(path)
    spec = {"vocab": VOCAB, "hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2, "seed": seed}
    marker = path / _MARK
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.model_max_length = 1024
    fast.save_pretrained(path)
    marker.write_text(json.dumps(spec))
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the tiny offline Llama for vLLM tries.")
    parser.add_argument("path", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build_tiny_llama(args.path, seed=args.seed))


if __name__ == "__main__":
    main()
