"""Model configurations: the leaderboard's `full` config and smaller presets.

Also the work and memory accounting of docs/reference.md §3, used for MFU and to
decide before allocating whether a config can fit on a device.
"""
import dataclasses
from dataclasses import dataclass

H200_PEAK_BF16_FLOPS = 989e12  # dense bf16 datasheet peak, docs/reference.md §3


@dataclass(frozen=True)
class ModelConfig:
    layers: int
    seq: int
    batch: int
    d_model: int
    heads: int
    d_ff: int
    vocab: int

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{field.name}: expected a positive integer, got {value!r}")
        if self.d_model % self.heads:
            raise ValueError(f"heads: expected a divisor of d_model={self.d_model}, got {self.heads}")
        if (self.d_model // self.heads) % 2:
            raise ValueError(f"heads: head dim d_model/heads must be even for RoPE, got {self.d_model // self.heads}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def params(self) -> int:
        """All parameters: embedding, blocks (7 matrices, 2 norms), final norm, lm_head."""
        d = self.d_model
        block = 4 * d * d + 3 * d * self.d_ff + 2 * d
        return self.layers * block + 2 * self.vocab * d + d

    @property
    def matmul_params(self) -> int:
        """N of docs/reference.md §3: the parameters that take part in matmuls."""
        d = self.d_model
        return self.layers * (4 * d * d + 3 * d * self.d_ff) + d * self.vocab

    @property
    def matmul_flops(self) -> float:
        """Every matmul of one train step, the LM head's included: 6·N·T."""
        return 6 * self.matmul_params * self.tokens

    @property
    def attention_flops(self) -> float:
        """Causal attention of one train step: fwd 4·B·H·S²·D/2 per layer, fwd+bwd = 3× fwd."""
        return 3 * self.layers * 4 * self.batch * self.heads * self.seq**2 * self.head_dim / 2

    @property
    def flops_per_step(self) -> float:
        """Model FLOPs of one train step (docs/reference.md §3)."""
        return self.matmul_flops + self.attention_flops

    def with_overrides(self, **overrides) -> "ModelConfig":
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})


PRESETS = {
    # The leaderboard's 8B step (docs/reference.md §1).
    "full": ModelConfig(layers=34, seq=32768, batch=2, d_model=4096, heads=32, d_ff=11008, vocab=151936),
    # Full width and vocabulary, few layers and a short sequence: about a second per step on one GPU.
    "small": ModelConfig(layers=4, seq=8192, batch=2, d_model=4096, heads=32, d_ff=11008, vocab=151936),
    # CPU tests: every code path, seconds per compile.
    "tiny": ModelConfig(layers=2, seq=64, batch=2, d_model=64, heads=4, d_ff=160, vocab=512),
}

# Largest first: the order in which a default preset is tried on a GPU.
PRESET_ORDER = ("full", "small", "tiny")
