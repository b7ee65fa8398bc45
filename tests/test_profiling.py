"""The profile breakdown's kernel categories."""
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from compile_stack.workloads.config import PRESETS
from compile_stack.harness.profiling import CATEGORIES, breakdown, categorize, format_breakdown
from custom_ops import adamw, attention, linear_cross_entropy, rope


@pytest.mark.parametrize("kernel, category", [
    (attention._attn_fwd_kernel.fn.__name__, "attention"),
    (attention._attn_bwd_dkdv_kernel.fn.__name__, "attention"),
    (attention._attn_bwd_dq_kernel.fn.__name__, "attention"),
    (attention._attn_bwd_delta_kernel.fn.__name__, "attention"),
    (attention._attn_fwd_hopper_kernel.fn.__name__, "attention"),
    (attention._attn_bwd_hopper_kernel.fn.__name__, "attention"),
    (attention._attn_dq_from_fragments_kernel.fn.__name__, "attention"),
    (linear_cross_entropy._xent_rows_kernel.fn.__name__, "cross_entropy"),
    (adamw._adamw_kernel.fn.__name__, "optimizer"),
    (rope._rope_kernel.fn.__name__, "elementwise_norm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "matmul"),
    ("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "matmul"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "elementwise_norm"),
    ("triton_poi_fused_mul_silu_1", "elementwise_norm"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "communication"),
    ("Memcpy DtoH (Device -> Pinned)", "host_copies"),
    ("Memcpy HtoD (Pinned -> Device)", "host_copies"),
    ("Memcpy DtoD (Device -> Device)", "other"),
    ("some_unknown_kernel", "other"),
])
def test_kernels_land_in_their_category(kernel, category):
    assert category in CATEGORIES
    assert categorize(kernel) == category


def test_gpu_breakdown_counts_kernels_once():
    """A CPU op's self device time repeats its kernel's, and so does the GPU-side span of a
    ``record_function`` range (``nccl:*``, ``FSDP::*``): only the kernel counts."""
    def event(key, device_type, device_us=0.0, cpu_us=0.0, count=1, annotation=False):
        return SimpleNamespace(key=key, device_type=device_type, self_device_time_total=device_us,
                               self_cpu_time_total=cpu_us, count=count, is_user_annotation=annotation)

    events = [
        event("aten::mm", DeviceType.CPU, device_us=3000.0, cpu_us=20.0),
        event("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NNT", DeviceType.CUDA, device_us=3000.0),
        event("cstack::flash_attention_fwd", DeviceType.CPU, device_us=1000.0, cpu_us=30.0),
        event("_attn_fwd_kernel", DeviceType.CUDA, device_us=1000.0, count=2),
        event("nccl:_all_gather_base", DeviceType.CUDA, device_us=500.0, annotation=True),
        event("FSDP::all_gather", DeviceType.CUDA, device_us=700.0, annotation=True),
    ]
    result = breakdown(events, PRESETS["tiny"], on_device=True)
    assert result["matmul"]["ms"] == 3.0 and result["attention"]["ms"] == 1.0
    assert result["communication"]["ms"] == 0 and result["other"]["ms"] == 0
    assert result["matmul"]["share"] == 0.75
    assert result["attention"]["calls"] == 2 and result["matmul"]["calls"] == 1
    assert [(k["name"], k["category"], k["calls"]) for k in result["largest"]] == [
        ("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "matmul", 1), ("_attn_fwd_kernel", "attention", 2)]
    assert "_attn_fwd_kernel" in format_breakdown(result)
    cpu = breakdown(events, PRESETS["tiny"], on_device=False)
    assert cpu["matmul"]["ms"] == 0.02 and cpu["attention"]["ms"] == 0.03


def test_host_copies_run_beside_compute_and_stay_out_of_its_shares():
    """With activation offload on, the copies to and from host memory take about as long as the
    kernels, on the copy engines beside them: the compute categories' shares are of the compute
    alone (they add up to 1), the copies' share is against the same total."""
    def kernel(key, us):
        return SimpleNamespace(key=key, device_type=DeviceType.CUDA, self_device_time_total=us,
                               self_cpu_time_total=0.0, count=1, is_user_annotation=False)

    events = [kernel("_attn_bwd_hopper_kernel", 3000.0), kernel("nvjet_tst_192x192_64x3_2x1_v_bz_coopB_NNN", 1000.0),
              kernel("Memcpy DtoH (Device -> Pinned)", 1500.0), kernel("Memcpy HtoD (Pinned -> Device)", 500.0)]
    result = breakdown(events, PRESETS["tiny"], on_device=True)
    assert (result["attention"]["share"], result["matmul"]["share"]) == (0.75, 0.25)
    assert result["host_copies"] == {"ms": 2.0, "share": 0.5, "calls": 2}
    assert result["other"]["ms"] == 0
    assert "beside compute" in format_breakdown(result)
