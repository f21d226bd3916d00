"""tools/kernel_time_diff.py: kernel names matched across runs, families, times per profiled
step, graph-launched kernels told apart (graph ids, or cudaGraphLaunch correlations), the
tables and the command line, on synthetic Chrome traces (CPU)."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import kernel_time_diff as ktd  # noqa: E402

# Demangled names as CUPTI reports them (torch 2.11 traces).
FLASH_FWD_EAGER = ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 64, 4, "
                   "false, false, cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 64, 4, "
                   "cutlass::bfloat16_t> >, false, true, false, false, true, true, false, false>"
                   "(pytorch_flash::Flash_fwd_params)")
FLASH_FWD_GRAPH = FLASH_FWD_EAGER.replace("true, true, false, false>", "true, false, false, false>")
GEMM = "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT"
FILL = ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
        "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)")
ADD = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
       "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, "
       "std::array<char*, 3ul>)")
COPY = ("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::"
        "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::"
        "{lambda()#14}::operator()() const::{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >"
        "(int, at::native::(anonymous namespace)::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
        "::{lambda()#3}::operator()() const::{lambda()#14}::operator()() const::"
        "{lambda(c10::BFloat16)#1}, std::array<char*, 2ul>)")
MUL = ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::"
       "BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> > >"
       "(at::TensorIteratorBase&, at::native::BinaryFunctor<float, float, float, at::native::"
       "binary_internal::MulFunctor<float> > const&)::{lambda(int)#1}>(int, at::native::"
       "gpu_kernel_impl_nocast<at::native::BinaryFunctor<float, float, float, at::native::"
       "binary_internal::MulFunctor<float> > >(at::TensorIteratorBase&, at::native::BinaryFunctor"
       "<float, float, float, at::native::binary_internal::MulFunctor<float> > const&)::"
       "{lambda(int)#1})")
SUM = ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::"
       "func_wrapper_t<float, at::native::sum_functor<float, float, float>::operator()"
       "(at::TensorIterator&)::{lambda(float, float)#1}>, unsigned int, float, 4, 4> >"
       "(at::native::ReduceOp<float, at::native::func_wrapper_t<float, at::native::sum_functor"
       "<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, "
       "unsigned int, float, 4, 4>)")
CUTLASS = ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_"
           "align8>(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8::Params)")


@pytest.mark.parametrize("name, key", [
    (FLASH_FWD_EAGER, "pytorch_flash::flash_fwd_kernel"),
    (FLASH_FWD_GRAPH, "pytorch_flash::flash_fwd_kernel"),
    (GEMM, GEMM),
    (FILL, "at::native::vectorized_elementwise_kernel[FillFunctor]"),
    (ADD, "at::native::vectorized_elementwise_kernel[CUDAFunctor_add]"),
    (COPY, "at::native::vectorized_elementwise_kernel[direct_copy_kernel_cuda]"),
    (MUL, "at::native::elementwise_kernel[MulFunctor]"),
    (SUM, "at::native::reduce_kernel[sum_functor]"),
    (CUTLASS, "cutlass::Kernel2[cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8]"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
     "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"),
    ("void transformer_engine::fused_rope_forward_kernel<__nv_bfloat16>(__nv_bfloat16 const*, "
     "int const*, float const*, __nv_bfloat16*, bool, int, int, int, int, int, int, int, int, "
     "int, int, int, int)", "transformer_engine::fused_rope_forward_kernel"),
])
def test_kernels_match_without_template_arguments_or_parameters(name, key):
    assert ktd.kernel_key(name) == key


@pytest.mark.parametrize("name, family", [
    (FLASH_FWD_EAGER, "attention fwd"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits"
     "<64, 128, 128, 8, 2, 4, 2, false, false, cutlass::bfloat16_t> >(Flash_bwd_params)",
     "attention bwd"),
    ("void pytorch_flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<64> >"
     "(pytorch_flash::Flash_bwd_params)", "attention bwd"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128_4x1x1_kernel0_0",
     "attention fwd"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3_64x128x128_4x1x1_kernel0_0",
     "attention bwd"),
    (GEMM, "GEMM"), (CUTLASS, "GEMM"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_"
     "segment_k_off_kernel__5x_cublas", "GEMM"),
    ("void transformer_engine::fused_rope_backward_kernel<__nv_bfloat16>(int)", "RoPE"),
    ("_chunk_scan_fwd_kernel", "Mamba scan"), ("_state_passing_bwd_kernel", "Mamba scan"),
    ("void causal_conv1d_fwd_kernel<Causal_conv1d_fwd_kernel_traits<128, 4, true, true, "
     "c10::BFloat16, c10::BFloat16> >(ConvParamsBase)", "Mamba conv"),
    ("_layer_norm_fwd_1pass_kernel", "norm"),
    ("void at::native::multi_tensor_apply_kernel<at::native::TensorListMetadata<4>, "
     "at::native::AdamFunctor<float, float>, float>(int)", "optimizer"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
     "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)",
     "loss / softmax"),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long>(int)",
     "index / gather / scatter"),
    (COPY, "copy / cat"), (FILL, "elementwise"), (MUL, "elementwise"), (SUM, "reduction"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "NCCL"),
    ("void at::native::foo_kernel<c10::PropertyFoo>(int)", "other"),  # "property" is no RoPE
])
def test_kernel_families(name, family):
    assert ktd.kernel_family(name) == family


def test_copies_and_memsets_are_their_own_families():
    assert ktd.kernel_family("Memcpy DtoD (Device -> Device)", "gpu_memcpy") == "memcpy"
    assert ktd.kernel_family("Memset (Device)", "gpu_memset") == "memset"


# --- synthetic traces -----------------------------------------------------------------------

def _kernel(name, ts, dur, correlation=0, graph_id=None, cat="kernel"):
    args = {"device": 0, "stream": 7, "correlation": correlation, "grid": [1, 1, 1]}
    if graph_id is not None:
        args |= {"graph id": graph_id, "graph node id": 1000 + correlation}
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur,
            "args": args}


def _runtime(name, ts, correlation):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "pid": 1, "tid": 1, "ts": ts,
            "dur": 1, "args": {"cbid": 211, "correlation": correlation}}


def _step(name, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 1, "tid": 1, "ts": ts,
            "dur": dur}


def _write(path, events):
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


def _eager_dir(tmp_path):
    """Two eager iterations (one file each, as --profile-trace-dir writes them) plus rank 1's
    trace, which --rank 0 leaves out. Per step: flash 100 us, GEMM 500 us, fill 20 us, a
    30 us copy, all launched one by one."""
    folder = tmp_path / "eager"
    folder.mkdir()
    for it in (19, 20):
        _write(folder / f"trace_iter{it}_rank0.json", [
            _runtime("cudaLaunchKernel", 0, 1), _kernel(FLASH_FWD_EAGER, 10, 100, 1),
            _runtime("cudaLaunchKernel", 1, 2), _kernel(GEMM, 200, 500, 2),
            _kernel(FILL, 800, 20, 3), _kernel("Memcpy DtoD (Device -> Device)", 900, 30, 4,
                                               cat="gpu_memcpy")])
    _write(folder / "trace_iter19_rank1.json", [_kernel(GEMM, 0, 99999)])
    return str(folder)


def _graph_trace(tmp_path):
    """One trace of four profiled steps (ProfilerStep#N annotations) replaying one graph each:
    per step the same GEMM (500 us), a flash kernel of other template arguments that takes
    130 us, the fill twice (2 x 10 us) and no copy; every kernel carries a graph id."""
    events = []
    for step in range(4):
        t = step * 10_000
        events += [_step(f"ProfilerStep#{step + 5}", t, 9_000),
                   _kernel(FLASH_FWD_GRAPH, t + 10, 130, step, graph_id=3),
                   _kernel(GEMM, t + 200, 500, step, graph_id=3),
                   _kernel(FILL, t + 800, 10, step, graph_id=3),
                   _kernel(FILL, t + 820, 10, step, graph_id=3)]
    return _write(tmp_path / "graph.json", events)


def test_times_are_per_profiled_step_and_matched_across_template_arguments(tmp_path):
    """Eager: two files of one step each; graph: one file of four steps. Divided by the wrong
    step count the GEMM, the same in both, would show a delta; matched by raw name the flash
    kernel would be two rows (100 us only eager, 130 us only graph)."""
    eager, graph = ktd.load(_eager_dir(tmp_path)), ktd.load(_graph_trace(tmp_path))
    assert (eager.steps, graph.steps) == (2, 4)
    out = ktd.report(eager, graph)
    # Total delta: flash +30 us, fill +0, copy -30 us -> 0: shares cannot be computed.
    assert "| attention fwd | 0.100 | 0.130 | +0.030 | - |" in out
    assert "| GEMM | 0.500 | 0.500 | +0.000 | - |" in out
    assert "| memcpy | 0.030 | 0.000 | -0.030 | - |" in out
    assert ("| attention fwd / `pytorch_flash::flash_fwd_kernel` | 0.100 | 0.130 | +0.030 | - "
            "| 1, 1 |") in out
    assert ("| elementwise / `at::native::vectorized_elementwise_kernel[FillFunctor]` | 0.020 | "
            "0.020 | +0.000 | - | 1, 2 |") in out
    assert out.count("flash_fwd_kernel") == 1
    assert "| profiled steps | 2 | 4 | |" in out


def test_shares_of_the_delta_and_rows_by_growth(tmp_path):
    eager = ktd.load(_write(tmp_path / "e.json", [_kernel(GEMM, 0, 500), _kernel(FILL, 600, 50),
                                                  _kernel(FLASH_FWD_EAGER, 700, 100)]))
    graph = ktd.load(_write(tmp_path / "g.json", [_kernel(GEMM, 0, 500), _kernel(FILL, 600, 30),
                                                  _kernel(FLASH_FWD_GRAPH, 700, 220)]))
    out = ktd.report(eager, graph)
    # Delta +100 us: attention +120 (120%), elementwise -20 (-20%); largest growth first.
    lines = out.splitlines()
    header = lines.index("| family | eager (ms/step) | graph (ms/step) | delta (ms/step) | "
                         "share of delta |")
    assert lines[header + 2:header + 5] == ["| attention fwd | 0.100 | 0.220 | +0.120 | 120% |",
                        "| GEMM | 0.500 | 0.500 | +0.000 | 0% |",
                        "| elementwise | 0.050 | 0.030 | -0.020 | -20% |"]
    assert "| GPU busy (ms, union of kernels) | 0.65 | 0.75 | +0.10 (+15.4%) |" in out


def test_top_keeps_the_kernels_that_changed_most(tmp_path):
    eager = ktd.load(_write(tmp_path / "e.json", [_kernel(GEMM, 0, 500), _kernel(FILL, 600, 50),
                                                  _kernel(SUM, 700, 100)]))
    graph = ktd.load(_write(tmp_path / "g.json", [_kernel(GEMM, 0, 501), _kernel(FILL, 600, 10),
                                                  _kernel(SUM, 700, 120)]))
    out = ktd.report(eager, graph, top=2)
    kernels = [ln for ln in out.splitlines() if " / `" in ln]
    assert [ln.split("`")[1] for ln in kernels] == [
        "at::native::reduce_kernel[sum_functor]",
        "at::native::vectorized_elementwise_kernel[FillFunctor]"]
    assert "1 more kernels changed less (--top)." in out


def test_gpu_busy_counts_overlapping_kernels_once(tmp_path):
    times = ktd.load(_write(tmp_path / "t.json", [
        _kernel(GEMM, 0, 100), _kernel(FILL, 50, 100), _kernel(SUM, 300, 10),
        _kernel("Memset (Device)", 400, 50, cat="gpu_memset")]))
    assert times.busy_us == 160  # union of kernels [0, 150) and [300, 310); memset excluded
    assert times.kernel_us == 210 and sum(times.time_us.values()) == 260


def test_graph_launched_kernels_by_graph_id_or_by_cuda_graph_launch(tmp_path):
    with_ids = ktd.load(_write(tmp_path / "ids.json", [
        _kernel(GEMM, 0, 300, 1, graph_id=5), _kernel(FILL, 400, 100, 2)]))
    assert with_ids.graphed_us == 300
    # torch 2.11 kernels carry no graph id: a replayed kernel shares the correlation id of
    # the cudaGraphLaunch that launched it.
    by_launch = ktd.load(_write(tmp_path / "launch.json", [
        _runtime("cudaGraphLaunch", 0, 41), _runtime("cudaLaunchKernel", 0, 42),
        _kernel(GEMM, 10, 300, 41), _kernel(SUM, 400, 50, 41), _kernel(FILL, 500, 100, 42)]))
    assert by_launch.graphed_us == 350
    unknown = ktd.load(_write(tmp_path / "bare.json", [_kernel(GEMM, 0, 300, 41)]))
    assert unknown.graphed_us is None
    out = ktd.report(unknown, by_launch)
    assert "| kernel time launched from CUDA graphs | - | 78% | |" in out


# --- command line ---------------------------------------------------------------------------

def test_main_compares_two_trace_directories(tmp_path, capsys):
    graph = tmp_path / "graph"
    graph.mkdir()
    for it in (19, 20):
        _write(graph / f"trace_iter{it}_rank0.json", [
            _runtime("cudaGraphLaunch", 0, 1), _kernel(FLASH_FWD_GRAPH, 10, 130, 1),
            _kernel(GEMM, 200, 500, 1), _kernel(FILL, 800, 20, 1)])
    assert ktd.main([_eager_dir(tmp_path), str(graph)]) == 0
    out = capsys.readouterr().out
    assert "| kernel time launched from CUDA graphs | 0% | 100% | |" in out
    assert "| attention fwd | 0.100 | 0.130 | +0.030 | -" in out


def test_a_directory_without_the_ranks_traces_is_named_in_one_line(tmp_path, capsys):
    eager = _eager_dir(tmp_path)
    assert ktd.main([eager, eager, "--rank", "3"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kernel_time_diff: trace directory is wrong: {tmp_path / 'eager'} holds no "
                   "trace_iter<N>_rank3.json. Pass a --profile-trace-dir (or --keep-traces) "
                   "directory, or another --rank."]


def test_a_missing_or_kernel_free_trace_is_named_in_one_line(tmp_path, capsys):
    missing = tmp_path / "trace_iter9_rank0.json"
    assert ktd.main([str(missing), str(missing)]) == 1
    assert capsys.readouterr().err.startswith(f"kernel_time_diff: trace is wrong: {missing} does "
                                              f"not exist.")
    empty = _write(tmp_path / "empty.json", [_step("ProfilerStep#1", 0, 10)])
    assert ktd.main([empty, empty]) == 1
    assert "holds no GPU kernels" in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [(["--top", "0"], "argument --top: 0 is wrong"),
                                         (["--rank", "-1"], "argument --rank: -1 is wrong")])
def test_bad_numbers_are_refused(argv, match, capsys):
    with pytest.raises(SystemExit):
        ktd.main(["a", "b", *argv])
    assert match in capsys.readouterr().err


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        ktd.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 25)" in text and "(default: 0)" in text
