"""Build a small random-weight Llama (or Qwen2) and a byte-level BPE tokenizer, offline and deterministically.

Used by the e2e tests and ``dtkv demo``: no download, same bytes on every machine (fixed seeds),
so greedy outputs are comparable across processes. Head size must be one the vLLM CPU attention
backend supports (32, 64, 80, 96, 112, 128, ...).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

_WORDS_TEXT = (
    "agent tool call search result file read write plan step user assistant system answer question "
    "code python function return value error retry cache block token memory disk object store "
    "tier host ssd bucket prefix restore offload onboard latency throughput model layer head "
    "the a of to and in is it that for on with as be this are by at from or an was have"
)
_WORDS = _WORDS_TEXT.split(" ")


@dataclass(frozen=True)
class TinyModelSpec:
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 8192
    seed: int = 0
    #: ``"llama"`` (no attention biases) or ``"qwen2"`` (q/k/v projections with bias, like Qwen2/2.5)
    architecture: str = "llama"


#: Small enough for tests (sub-second prefill), shaped like a real model.
TEST_SPEC = TinyModelSpec()
#: Big enough that prefill of a few thousand tokens is clearly measurable on 2 cores.
DEMO_SPEC = TinyModelSpec(vocab_size=2048, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                          num_attention_heads=8, num_key_value_heads=4, head_dim=64)


#: Qwen2-shaped (q/k/v bias), 8 layers, 2 query / 2 KV heads of 128 (hidden 256, MLP 768), bf16:
#: 8 KiB of KV per token (an 8k context is 64 MiB) on 8M parameters, so that an 8k prefill stays
#: measurable on CPUs without native bf16 (``dtkv bench restore``). No test uses this shape.
QWEN2_BENCH_SPEC = TinyModelSpec(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                                 num_attention_heads=2, num_key_value_heads=2, head_dim=128,
                                 max_position_embeddings=16384, architecture="qwen2")


def _stamp(spec: TinyModelSpec) -> dict[str, object]:
    d = asdict(spec)
    if d["architecture"] == "llama":
        del d["architecture"]  # stamps written before the field existed stay valid
    return d


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec = TEST_SPEC) -> Path:
    """Write a HF-format Llama or Qwen2 (bf16 safetensors) and tokenizer into ``out_dir``; reuse if present."""
    out = Path(out_dir)
    stamp = out / "dtkv-tiny-model.json"
    if stamp.exists() and json.loads(stamp.read_text()) == _stamp(spec):
        return out
    out.mkdir(parents=True, exist_ok=True)
    import torch

    _build_tokenizer(out, spec.vocab_size)
    common = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                  num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
                  num_key_value_heads=spec.num_key_value_heads, max_position_embeddings=spec.max_position_embeddings,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(spec.seed)
    if spec.architecture == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        if spec.head_dim * spec.num_attention_heads != spec.hidden_size:
            raise ValueError("qwen2: head_dim * num_attention_heads must equal hidden_size")
        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False))
    elif spec.architecture == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**common, head_dim=spec.head_dim))
    else:
        raise ValueError(f"unknown architecture {spec.architecture!r} (llama, qwen2)")
    with torch.no_grad():  # wider-than-default init so random logits are not all ties
        for p in model.parameters():
            p.normal_(0.0, 0.08)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps(_stamp(spec)))
    return out


def _build_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = [" ".join(_WORDS[(i * 7 + j * 3) % len(_WORDS)] for j in range(40)) for i in range(400)]
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.save_pretrained(out)


def synthetic_tokens(n: int, seed: int, vocab_size: int = TEST_SPEC.vocab_size) -> list[int]:
    """``n`` deterministic token ids (no special tokens) for prompts built from ids."""
    import numpy as np

    return np.random.default_rng(seed).integers(4, vocab_size, n).tolist()
