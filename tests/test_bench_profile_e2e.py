"""bench/profile_e2e.py's breakdown of a profiled step: per phase, the GPU's busy time is the union of its kernels
clipped to the phase, its gaps are what lies between, and kernels are summed by kind and by name."""

from bench.profile_e2e import kind_of, phase_breakdown, union_us


def _x(name, ts, dur, cat="kernel"):
    return dict(ph="X", name=name, ts=ts, dur=dur, cat=cat)


def test_union_counts_overlaps_once_and_lists_the_gaps():
    covered, gaps = union_us([(0, 10), (5, 12), (20, 25), (21, 22), (100, 101)])
    assert covered == 12 + 5 + 1
    assert gaps == [8, 75]


def test_each_phase_gets_its_clipped_busy_time_gaps_and_kinds():
    trace = {"traceEvents": [
        _x("phase:gen", 0, 1000, cat="user_annotation"),
        _x("phase:update", 1000, 2000, cat="user_annotation"),
        _x("phase:gen", 0, 1000, cat="gpu_user_annotation"),  # the GPU's copy of a mark is not a phase
        _x("sm90_xmma_gemm_bf16", 100, 300),
        _x("sm90_xmma_gemm_bf16", 350, 50),
        _x("flash_fwd_kernel", 900, 200),  # straddles gen and update: 100 us in each
        _x("triton_poi_fused_add_0", 1500, 100),
        _x("Memcpy HtoD", 1700, 100, cat="gpu_memcpy"),
        _x("cpu side", 0, 3000, cat="cpu_op"),  # not GPU time
    ]}
    out = phase_breakdown(trace, top=10)
    gen, update = out["gen"], out["update"]
    assert list(out) == ["gen", "update"]
    assert gen["wall_ms"] == 1.0 and gen["gpu_busy_ms"] == 0.4 and gen["gpu_busy_frac"] == 0.4  # 100-400 and 900-1000
    assert gen["gaps_over_50us"] == 1 and gen["gaps_over_50us_ms"] == 0.5  # 400 -> 900
    assert gen["by_kind_ms"] == {"gemm": 0.35, "attention": 0.1}
    assert gen["top"][0] == {"name": "sm90_xmma_gemm_bf16", "ms": 0.35, "calls": 2}
    assert update["gpu_busy_ms"] == 0.3 and update["gpu_events"] == 3
    assert update["by_kind_ms"] == {"attention": 0.1, "triton": 0.1, "copy": 0.1}
    assert update["largest_gaps_ms"] == [0.4, 0.1]  # 1100 -> 1500, 1600 -> 1700


def test_kernel_kinds():
    assert kind_of("ampere_bf16_s16816gemm_bf16_128x128") == "gemm"
    assert kind_of("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNN") == "gemm"
    assert kind_of("void at::native::vectorized_elementwise_kernel<4, ...>") == "elementwise"
    assert kind_of("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<adam>") == "optimizer"
    assert kind_of("something_else") == "other"
    assert kind_of("void pytorch_flash::flash_bwd_dq_dk_dv_loop<Flash_bwd_kernel_traits<cutlass::bfloat16_t>>") == \
        "attention"


def test_the_host_work_inside_long_gaps_is_named():
    """Gaps over 1 ms are the host's: the host events inside them are summed by name (only their part inside)."""
    trace = [
        _x("phase:gen", 0, 10_000, cat="user_annotation"),
        _x("k", 0, 1000), _x("k", 4000, 1000), _x("k", 5200, 100), _x("k", 9000, 1000),  # gaps 3 ms, 0.2, 3.7 ms
        _x("rollout.sync", 500, 1500, cat="user_annotation"),  # 1 ms of it inside the first gap
        _x("rollout.end_rows", 6000, 2000, cat="user_annotation"),  # all inside the second long gap
        _x("aten::item", 5100, 150, cat="cpu_op"),  # inside the 0.2 ms gap only: not counted
    ]
    gen = phase_breakdown(trace, top=5)["gen"]
    assert gen["gaps_over_1ms"] == 2 and gen["gaps_over_1ms_ms"] == 6.7
    assert gen["host_in_gaps_over_1ms_ms"] == {"rollout.end_rows": 2.0, "rollout.sync": 1.0}
