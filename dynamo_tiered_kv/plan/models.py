"""Model KV shapes for the planner: presets for common models and the bytes one token costs.

Two byte counts per token matter:

* **raw** KV bytes, what the engine's paged cache holds in HBM:
  ``planes * layers * kv_heads * head_size * itemsize`` with ``planes = 2`` (K and V) for
  MHA/GQA and ``planes = 1`` for MLA, whose single latent has ``head_size = kv_lora_rank + rope``.
* **stored** bytes, what one of our records costs in DRAM, on SSD and in S3: ``codec.record_bytes``
  of the canonical block (4 KiB header with one checksum per layer, payload padded to 4 KiB)
  divided by the block size in tokens.

Both are per *instance* (all TP ranks): each rank holds ``max(1, kv_heads // tp)`` KV heads (vLLM
replicates heads when ``tp > kv_heads``) and MLA's latent is replicated on every rank, so with
``tp > 1`` an MLA model stores ``tp`` copies, as every rank offloads its own blocks (our keys carry
the TP rank), unless ``mla_one_copy`` says the ranks store one shared copy (LMCache saves MLA
from the first rank only).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..blocks.codec import record_bytes
from ..blocks.layout import BlockShape, CanonicalFormat, DType
from ..errors import ConfigError

#: KV / weight dtype names accepted on the command line.
DTYPES: dict[str, DType] = {
    "bf16": DType.BFLOAT16,
    "fp16": DType.FLOAT16,
    "fp32": DType.FLOAT32,
    "fp8": DType.FP8_E4M3,
    "fp8_e4m3": DType.FP8_E4M3,
    "fp8_e5m2": DType.FP8_E5M2,
}


def dtype_of(name: str) -> DType:
    """The DType for a command-line name; raises ConfigError naming the accepted ones."""
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ConfigError(f"dtype: unknown {name!r}; use one of {', '.join(DTYPES)}") from None


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know about a model.

    Attributes:
        name: display name.
        layers: transformer layers that keep KV.
        kv_heads: KV heads (GQA); 1 for MLA.
        head_size: per-head dim; for MLA the latent dim (kv_lora_rank + qk_rope_head_dim).
        q_heads: query heads (attention FLOPs).
        active_params: parameters touched per token (= total for dense; active experts for MoE).
        total_params: parameters held in HBM (weights); defaults to ``active_params``.
        mla: multi-head latent attention (one latent per token per layer instead of K and V).
        qk_head_dim: per-head dim of Q.K^T for attention FLOPs; defaults to ``head_size``.
        v_head_dim: per-head dim of P.V for attention FLOPs; defaults to ``head_size``.
        kv_dtype: KV cache dtype name (see DTYPES).
        weight_dtype: weight dtype name, for the HBM the weights take.
    """

    name: str
    layers: int
    kv_heads: int
    head_size: int
    q_heads: int
    active_params: float
    total_params: float | None = None
    mla: bool = False
    qk_head_dim: int | None = None
    v_head_dim: int | None = None
    kv_dtype: str = "bf16"
    weight_dtype: str = "bf16"

    def __post_init__(self) -> None:
        for field in ("layers", "kv_heads", "head_size", "q_heads"):
            if getattr(self, field) <= 0:
                raise ConfigError(f"model.{field} must be a positive integer, got {getattr(self, field)}")
        if self.active_params < 0 or (self.total_params is not None and self.total_params < 0):
            raise ConfigError("model params must be >= 0")
        if self.mla and self.kv_heads != 1:
            raise ConfigError("an MLA model keeps one latent per token: kv_heads must be 1")
        dtype_of(self.kv_dtype)
        dtype_of(self.weight_dtype)

    @property
    def weight_bytes(self) -> float:
        params = self.total_params if self.total_params is not None else self.active_params
        return params * dtype_of(self.weight_dtype).itemsize

    @property
    def planes(self) -> int:
        return 1 if self.mla else 2

    def rank_kv_heads(self, tp: int) -> int:
        """KV heads one TP rank holds (heads are replicated once tp exceeds them; MLA: 1)."""
        return 1 if self.mla else max(1, self.kv_heads // tp)

    def kv_bytes_per_token(self, tp: int = 1) -> int:
        """Raw KV bytes of one token over all ``tp`` ranks (what the engine holds in HBM)."""
        itemsize = dtype_of(self.kv_dtype).itemsize
        return tp * self.planes * self.layers * self.rank_kv_heads(tp) * self.head_size * itemsize

    def block_shape(self, block_size: int, tp: int = 1) -> BlockShape:
        """The canonical block one rank stores (the codec's layout descriptor)."""
        canonical = CanonicalFormat.MLA if self.mla else CanonicalFormat.KV_SPLIT
        return BlockShape(
            canonical, dtype_of(self.kv_dtype), self.layers, block_size, self.rank_kv_heads(tp), self.head_size
        )

    def stored_copies(self, tp: int, mla_one_copy: bool = False) -> int:
        """Records stored per block: one per rank, or one in all for MLA when ranks dedupe."""
        return 1 if self.mla and mla_one_copy else tp

    def stored_bytes_per_block(self, block_size: int, tp: int = 1, mla_one_copy: bool = False) -> int:
        """Bytes one block of ``block_size`` tokens costs in our tiers, all ranks, headers included."""
        return self.stored_copies(tp, mla_one_copy) * record_bytes(self.block_shape(block_size, tp))

    def stored_bytes_per_token(self, block_size: int, tp: int = 1, mla_one_copy: bool = False) -> float:
        return self.stored_bytes_per_block(block_size, tp, mla_one_copy) / block_size

    def with_dtype(self, kv_dtype: str) -> ModelSpec:
        dtype_of(kv_dtype)
        return replace(self, kv_dtype=kv_dtype)


def _gqa(name: str, layers: int, q: int, kv: int, params: float, total: float | None = None) -> ModelSpec:
    return ModelSpec(name, layers, kv, 128, q, params, total)


#: Shapes from each model's Hugging Face config.json; params from the model cards.
PRESETS: dict[str, ModelSpec] = {
    m.name.lower(): m
    for m in (
        _gqa("Llama-3.1-8B", 32, 32, 8, 8.03e9),
        _gqa("Llama-3.1-70B", 80, 64, 8, 70.6e9),
        _gqa("Llama-3.1-405B", 126, 128, 8, 405.9e9),
        _gqa("Llama-3.3-70B", 80, 64, 8, 70.6e9),
        _gqa("Qwen2.5-7B", 28, 28, 4, 7.62e9),
        _gqa("Qwen2.5-72B", 80, 64, 8, 72.7e9),
        _gqa("Qwen3-8B", 36, 32, 8, 8.19e9),
        _gqa("Qwen3-32B", 64, 64, 8, 32.8e9),
        _gqa("Mistral-7B", 32, 32, 8, 7.25e9),
        _gqa("Mixtral-8x7B", 32, 32, 8, 12.9e9, 46.7e9),
        # MLA: latent = kv_lora_rank 512 + qk_rope_head_dim 64; attention FLOPs use the
        # non-absorbed prefill form (q/k head dim 192 = 128 nope + 64 rope, v head dim 128).
        ModelSpec(
            "DeepSeek-V3", 61, 1, 576, 128, 37e9, 671e9, mla=True, qk_head_dim=192, v_head_dim=128, weight_dtype="fp8"
        ),
    )
}


def preset(name: str) -> ModelSpec:
    """A preset by case-insensitive name; raises ConfigError listing the presets."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        names = ", ".join(m.name for m in PRESETS.values())
        raise ConfigError(f"--model: unknown preset {name!r}; presets: {names}") from None
