"""The profile breakdown's kernel categories."""
import pytest

from compile_stack.profiling import CATEGORIES, categorize
from custom_ops import adamw, attention, linear_cross_entropy


@pytest.mark.parametrize("kernel, category", [
    (attention._attn_fwd_kernel.fn.__name__, "attention"),
    (attention._attn_bwd_dkdv_kernel.fn.__name__, "attention"),
    (attention._attn_bwd_dq_kernel.fn.__name__, "attention"),
    (attention._attn_bwd_delta_kernel.fn.__name__, "attention"),
    (linear_cross_entropy._xent_rows_kernel.fn.__name__, "cross_entropy"),
    (adamw._adamw_kernel.fn.__name__, "optimizer"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "matmul"),
    ("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "matmul"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "elementwise_norm"),
    ("triton_poi_fused_mul_silu_1", "elementwise_norm"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "communication"),
    ("some_unknown_kernel", "other"),
])
def test_kernels_land_in_their_category(kernel, category):
    assert category in CATEGORIES
    assert categorize(kernel) == category
