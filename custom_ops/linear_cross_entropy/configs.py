"""How the fused cross-entropy splits its work: tokens per chunk of logits, and the row kernel's
vocabulary tile and warps."""
import contextlib

import triton

from custom_ops.checks import require

CHUNK_BYTES = 5 * 2**28  # 1.25 GiB: the most one chunk of logits may take
MAX_BLOCK_V = 4096  # the row kernel's widest vocabulary tile; a longer row loops over tiles

_chunk_tokens_override: int | None = None


def chunk_tokens_for(tokens: int, vocab: int, itemsize: int) -> int:
    """Tokens per chunk: the largest power of two whose logits fit CHUNK_BYTES (capped at T)."""
    if _chunk_tokens_override is not None:
        return max(1, min(_chunk_tokens_override, tokens))
    fit = max(1, CHUNK_BYTES // (vocab * itemsize))
    return max(1, min(1 << (fit.bit_length() - 1), tokens))


@contextlib.contextmanager
def chunk_tokens(n: int):
    """Force n tokens per chunk inside the block (tests: several chunks on tiny T; benchmark sweeps)."""
    global _chunk_tokens_override
    require(isinstance(n, int) and n >= 1, "n", "a positive int", n)
    saved, _chunk_tokens_override = _chunk_tokens_override, n
    try:
        yield
    finally:
        _chunk_tokens_override = saved


def block_v_for(vocab: int) -> int:
    """The row kernel's vocabulary tile: the row rounded up to a power of two, at most MAX_BLOCK_V."""
    return min(MAX_BLOCK_V, triton.next_power_of_2(vocab))


def num_warps_for(block_v: int) -> int:
    """Warps of one row program: 8 for tiles of 2048 columns or more, else 4."""
    return 8 if block_v >= 2048 else 4
