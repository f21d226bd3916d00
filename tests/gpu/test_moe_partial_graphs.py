"""Partial MoE graphs (--cuda-graph-modules moe_router ...) on the GPU (skipped without CUDA).

* Replayed partial graphs (attention, router and postprocess graphs, eager experts) give the
  eager per-parameter gradients (local implementation, GPT and hybrid, drop-and-pad and
  dropless).
* A padded row routes its documents under a captured router graph exactly like the same
  documents without padding: the padding mask is a graph input.
* Training with partial graphs matches eager training over 30 steps: loss and aux loss within
  the tolerance of test_moe_graphs.py, for GPT-MoE and hybrid-MoE, drop-and-pad and dropless,
  local and (with Transformer Engine) TE graphs, EP = 2 and PP = 2.

The in-process tests share megatron-core's process-wide graph record and MoE metrics tracker
(`fresh_graph_state`): a capture that fails part-way leaves its runners in the record (the
next schedule's end captures them again, on stale buffer counts) and the tracker keeps the
first model's layer count (a model with more layers then indexes past it).
"""

import pytest
import torch

from megatron.packed_training.extra_args import is_importable
from tests.gpu.launch import (
    DROP_AND_PAD,
    LAYER_GRAPHS,
    TINY_GPT_MOE,
    TINY_HYBRID_MOE,
    TRAIN,
    assert_moe_follows_eager,
    losses,
    run_training,
)

MODELS = {"gpt": ("pretrain_gpt.py", TINY_GPT_MOE), "hybrid": ("pretrain_mamba.py",
                                                                 TINY_HYBRID_MOE)}
# Per model, the modules that graph every layer kind it has (MoE layers in part).
PARTIAL = {"gpt": ["--cuda-graph-modules", "attn", "moe_router"],
           "hybrid": ["--cuda-graph-modules", "mamba", "attn", "moe_router"]}
TE = ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-max-packed-seqs", "16",
      "--cuda-graph-warmup-steps", "2"]
STEPS = 30
needs_te = pytest.mark.skipif(not is_importable("transformer_engine"),
                              reason="needs Transformer Engine")
# Graphs on TE attention switch TE's RNG tracker on: the eager reference takes it too.
COMMON = TRAIN + (["--te-rng-tracker"] if is_importable("transformer_engine") else [])


def _reset_graph_state():
    """Forget every recorded or captured local graph, a capture left half done included
    (its capture flag and buffer counts)."""
    from megatron.core.transformer import cuda_graphs

    cuda_graphs.delete_cuda_graphs()
    cuda_graphs._set_capture_end()
    cuda_graphs.fwd_buffer_reuse_ref_count = cuda_graphs.bwd_buffer_reuse_ref_count = 0


@pytest.fixture
def fresh_graph_state(dist):
    """No graph of an earlier in-process test, and none left for a later one."""
    _reset_graph_state()
    yield
    _reset_graph_state()


# ------------------------------------------------------------------------ gradients

@pytest.mark.parametrize("kind, capacity", [("gpt", DROP_AND_PAD), ("hybrid", DROP_AND_PAD),
                                            ("gpt", [])])
def test_replayed_partial_graphs_give_the_eager_gradients(fresh_graph_state, kind, capacity):
    from tools.compare_graph_grads import compare_replay_with_eager

    aliasing, results = compare_replay_with_eager(
        kind, MODELS[kind][1] + capacity + PARTIAL[kind], capacity=32, micro_batches=2)
    assert aliasing == []
    floor = results["eager again vs eager (noise floor)"][0]
    for case, (total, rows) in results.items():
        print(f"{kind} partial {'drop-and-pad' if capacity else 'dropless'}: {case}: "
              f"{total:.3e}")
        # Bitwise where the kernels are deterministic; the unpermute's scatter-add may add
        # in another order in any two runs, which the noise floor measures.
        assert total < max(1e-6, 10 * floor), (case, rows[:3])


# ------------------------------------------------------------------------ padding mask

HIDDEN, EXPERTS, DOCS, PAD = 64, 8, 64, 64


def _moe_layer(graphs: bool, factor: float):
    """A hybrid 'E' layer (pre-MLP norm + MoE), drop-and-pad at ``factor``; with ``graphs``
    local partial graphs."""
    import torch.nn.functional as F

    from megatron.core.transformer.enums import CudaGraphModule
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.packed_graphs.specs import moe_layer_spec
    from megatron.packed_model.providers import backend_provider

    graph_settings = dict(cuda_graph_impl="local", cuda_graph_modules=[
        CudaGraphModule.moe_router, CudaGraphModule.moe_preprocess]) if graphs else {}
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        bias_dropout_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=32,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.01,
        moe_expert_capacity_factor=factor, moe_pad_expert_input_to_capacity=True,
        **graph_settings)
    torch.manual_seed(0)
    spec = moe_layer_spec(backend_provider("torch"), "RMSNorm", EXPERTS)
    return build_module(spec, config=config, layer_number=1).cuda()


def _params(mask):
    from megatron.packed_graphs.packed_seq import build_packed_batch_params

    tokens = mask.numel()
    cu = torch.tensor([0, DOCS, tokens], dtype=torch.int32, device="cuda")
    position_ids = torch.cat([torch.arange(DOCS), torch.arange(tokens - DOCS)]).cuda()
    params = build_packed_batch_params(cu, position_ids, tokens, with_seq_idx=False)
    params.padding_mask = mask
    return params


def test_padded_row_routes_like_unpadded_under_a_partial_graph(fresh_graph_state):
    """Capacities equal (128 tokens at factor 0.25, the 64 documents alone at 0.5): the
    replayed router graph routes the documents of a padded row as the documents alone, and
    the layer's output on them is the same; the router ran inside the graph (no Python call)."""
    from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord

    from megatron.packed_upstream.patches import apply_core_patches
    from megatron.packed_graphs.plan import Reason, run_eager

    apply_core_patches()
    layer, alone = _moe_layer(graphs=True, factor=0.25), _moe_layer(graphs=False, factor=0.5)
    alone.load_state_dict(layer.state_dict())
    for param in layer.parameters():  # 0.19.2's backward graphs add weight grads to main_grad,
        param.main_grad = torch.zeros_like(param, dtype=torch.float32)  # which DDP provides
    assert layer.use_partial_cudagraphs and hasattr(layer, "cudagraph_manager_router")
    mask = torch.arange(DOCS + PAD, device="cuda") >= DOCS
    params = _params(mask)

    def run(hidden):
        x = hidden.clone().requires_grad_()
        out, _ = layer(x, attention_mask=None, packed_seq_params=params)
        # Copied before the backward: the postprocess graph's output buffer is graph-owned,
        # and megatron-core 0.19.2 may hand it to the backward graphs once autograd is done.
        result = out.detach().clone()
        out.float().square().sum().backward()
        return result, x.grad.clone()

    generator = torch.Generator(device="cuda").manual_seed(3)
    run(torch.randn(DOCS + PAD, 1, HIDDEN, device="cuda", generator=generator))  # records
    _CudagraphGlobalRecord.create_cudagraphs()
    assert layer.cudagraph_manager_router.cudagraph_runners[0].fwd_graph is not None
    calls = []
    layer.mlp.router.register_forward_hook(lambda *args: calls.append(1))
    hidden = torch.randn(DOCS + PAD, 1, HIDDEN, device="cuda", generator=generator)
    hidden[DOCS:] *= 10
    replayed, grad = run(hidden)
    assert calls == []  # the router replayed inside its graph
    expected, _ = alone(hidden[:DOCS], attention_mask=None)
    torch.testing.assert_close(replayed[:DOCS], expected)
    with run_eager(Reason.FORCED):
        eager, eager_grad = run(hidden)
    assert calls == [1]  # planned eager: the router ran in Python
    torch.testing.assert_close(replayed, eager)
    torch.testing.assert_close(grad, eager_grad)


# ------------------------------------------------------------------------ training

def _train(tmp_path, kind, extra, name, nproc=1):
    script, model = MODELS[kind]
    return run_training(script, model + COMMON + ["--train-iters", str(STEPS),
                                                  "--global-batch-size", str(2 * nproc),
                                                  *extra], tmp_path, name=name, nproc=nproc)


@pytest.fixture(scope="module")
def eager_run(tmp_path_factory):
    """Eager training runs, one per (model, flags), shared by the tests of this module."""
    runs = {}

    def run(kind, flags):
        key = (kind, tuple(flags))
        if key not in runs:
            runs[key] = _train(tmp_path_factory.mktemp("eager"), kind, flags, "eager")
        return runs[key]

    return run


def _compare(eager, graphs, label):
    assert len(eager) == len(graphs)
    assert all(r["load_balancing_loss"] > 0 and r["z_loss"] > 0 for r in eager + graphs)
    assert [r["cuda graphs"] for r in graphs[:2]] == ["warmup", "warmup"]
    assert graphs[2]["graph capture (s)"] > 0
    assert_moe_follows_eager(eager, graphs, f"{label}, {graphs[2]['graphs captured']} graphs")


@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
@pytest.mark.parametrize("capacity", ["drop-and-pad", "dropless"])
def test_local_partial_graphs_train_like_eager(tmp_path, eager_run, kind, capacity):
    flags = DROP_AND_PAD if capacity == "drop-and-pad" else []
    eager = eager_run(kind, flags)
    graphs = _train(tmp_path, kind, flags + LAYER_GRAPHS + PARTIAL[kind], "partial")
    _compare(eager, graphs, f"{kind} {capacity} local partial")


@needs_te
@pytest.mark.parametrize("kind, modules", [
    ("gpt", ["attn", "moe_router"]),
    ("gpt", ["moe_router", "moe_preprocess"]),
    ("hybrid", ["moe_router", "moe_preprocess"]),
])
def test_te_partial_graphs_train_like_eager(tmp_path, eager_run, kind, modules):
    eager = eager_run(kind, DROP_AND_PAD)
    graphs = _train(tmp_path, kind, DROP_AND_PAD + TE + ["--cuda-graph-modules", *modules],
                    "te_partial")
    _compare(eager, graphs, f"{kind} TE partial {' '.join(modules)}")


@pytest.mark.gpus(2)
def test_dropless_partial_graphs_with_expert_parallelism(tmp_path):
    """EP = 2: the eager token all-to-all takes each micro-batch's split sizes."""
    ep = ["--expert-model-parallel-size", "2"]
    eager = _train(tmp_path, "gpt", ep, "eager_ep2", nproc=2)
    graphs = _train(tmp_path, "gpt", ep + LAYER_GRAPHS + PARTIAL["gpt"], "partial_ep2", nproc=2)
    _compare(eager, graphs, "gpt dropless local partial EP=2")


@pytest.mark.gpus(2)
def test_partial_graphs_with_pipeline_parallelism_and_fallbacks(tmp_path):
    """PP = 2 with capacity 9 (some micro-batches overflow and run eager): every partial
    graph manager of a bypassed layer takes its runner turn, so later replays stay aligned."""
    pp = ["--pipeline-model-parallel-size", "2"]
    graph_flags = ["--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", "9",
                   "--cuda-graph-warmup-steps", "2", *PARTIAL["gpt"]]
    script, model = MODELS["gpt"]
    common = model + DROP_AND_PAD + COMMON + ["--train-iters", str(STEPS),
                                             "--global-batch-size", "4", *pp]
    eager = run_training(script, common, tmp_path, nproc=2, name="eager_pp2")
    graphs = run_training(script, common + graph_flags, tmp_path, nproc=2, name="partial_pp2")
    captured = [i for i, r in enumerate(graphs) if r.get("graph capture (s)")]
    assert len(captured) == 1, captured
    assert any(0 < r["graph fallbacks"] < 4 for r in graphs[captured[0] + 1:]), \
        "no iteration mixed replays and fallbacks"
    dloss = max(abs(e["lm_loss"] - g["lm_loss"]) for e, g in zip(eager, graphs))
    print(f"gpt partial pp2: capture at iteration {captured[0] + 1}, max |dloss| {dloss:.2e}")
    assert dloss < 5e-3, (losses(eager), losses(graphs))
