"""Sleep and wake on CPU (rl/offload.py): the process checks an offloadable policy's build
makes before any GPU work, refusals with their fix, and which calls run inside the policy's
memory (the torch_memory_saver region, entered once per call, backward on the calling
thread). The memory itself leaving and coming back, with graphs replaying, runs on the GPU:
tests/gpu/test_rl_offload.py.
"""

import argparse
import os
from contextlib import contextmanager

import pytest
import torch

from megatron.packed_training.rl import PackedPolicy, PolicyConfig
from megatron.packed_training.rl.offload import (
    HOOK_LIBRARY,
    PRELOAD_LINE,
    PolicyMemory,
    preload_problem,
)
from tests.unit.scripts import load_script
from tests.unit.test_rl_library import (  # noqa: F401 (no_rng_tracker: an autouse fixture)
    grpo_loss,
    make_policy,
    no_rng_tracker,
    rollouts,
)

HOOK = f"/site-packages/{HOOK_LIBRARY}_cu13.abi3.so"
MAPS = f"7f00-7f10 r-xp 00000000 08:01 42 {HOOK}\n"


class RegionRecorder:
    """torch_memory_saver's saver as `PolicyMemory` calls it (``region``), recording each
    region entered and whether one is open now. Pausing and resuming need CUDA: the GPU
    test runs the real saver."""

    def __init__(self):
        self.entered, self.open = [], 0

    @contextmanager
    def region(self, tag, enable_cpu_backup):
        self.entered.append((tag, enable_cpu_backup))
        self.open += 1
        try:
            yield
        finally:
            self.open -= 1


def test_a_process_that_can_offload_has_no_problem():
    assert preload_problem(installed=True, ld_preload=HOOK, mapped=MAPS, alloc_conf="") is None
    assert preload_problem(installed=True, ld_preload=f"/lib/other.so:{HOOK}", mapped=None,
                           alloc_conf="max_split_size_mb:512") is None


@pytest.mark.parametrize("case, match", [
    (dict(installed=False, ld_preload="", mapped=""),
     r"needs the torch_memory_saver package, which is not installed: pip install -e "
     r"\"\.\[offload\]\""),
    (dict(ld_preload="", mapped=""),
     r"LD_PRELOAD is wrong for PolicyConfig\(offloadable=True\): '' names 0 torch_memory_saver "
     r"libraries, 1 expected. Start the process with LD_PRELOAD=\$\(python -c"),
    (dict(ld_preload=f"{HOOK}:/x/torch_memory_saver_hook_mode_torch.so", mapped=MAPS),
     r"names 2 torch_memory_saver libraries, 1 expected.*under torchrun: on torchrun's command "
     r"line"),
    (dict(ld_preload=HOOK, mapped="7f00-7f10 r-xp 00000000 08:01 42 /lib/libc.so.6\n"),
     r"LD_PRELOAD names .*, but this process did not start with it loaded \(the dynamic loader "
     r"reads LD_PRELOAD once"),
    (dict(alloc_conf="expandable_segments:True"),
     r"PYTORCH_CUDA_ALLOC_CONF is wrong for PolicyConfig\(offloadable=True\): "
     r"'expandable_segments:True'.*leave expandable_segments out"),
])
def test_what_keeps_a_process_from_offloading_is_named_with_the_fix(case, match):
    import re

    given = dict(installed=True, ld_preload=HOOK, mapped=MAPS, alloc_conf="") | case
    problem = preload_problem(**given)
    assert problem is not None and re.search(match, problem), problem


def test_the_preload_line_prints_the_hook_librarys_path():
    assert PRELOAD_LINE.startswith("LD_PRELOAD=$(python -c ")
    assert f"print(p('{HOOK_LIBRARY}'))" in PRELOAD_LINE


def _environment_problem():
    from megatron.packed_training.extra_args import is_importable

    try:
        with open("/proc/self/maps") as f:
            mapped = f.read()
    except OSError:
        mapped = None
    return preload_problem(installed=is_importable("torch_memory_saver"),
                           ld_preload=os.environ.get("LD_PRELOAD", ""), mapped=mapped,
                           alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))


def test_build_refuses_an_offloadable_policy_before_any_gpu_work():
    problem = _environment_problem()
    if problem is None:
        pytest.skip("this process can offload (torch_memory_saver preloaded)")
    args = argparse.Namespace(pipeline_model_parallel_size=1, context_parallel_size=1,
                              pretrained_checkpoint=None, load=None)
    # On a machine without a GPU the CUDA check right after would raise: this one is first.
    with pytest.raises(RuntimeError) as raised:
        PackedPolicy.build(PolicyConfig(args, offloadable=True))
    assert str(raised.value) == problem


def test_offload_and_onload_of_a_policy_built_without_it_are_refused(cpu_dist):
    policy = make_policy()
    for call in (policy.offload, policy.onload):
        with pytest.raises(RuntimeError, match=r"needs a policy built with PolicyConfig\("
                                               r"offloadable=True\) in a process started "
                                               r"with torch_memory_saver's preload library"):
            call()


def test_calls_run_inside_the_policys_memory_with_backward_on_the_calling_thread(cpu_dist):
    policy = make_policy()
    recorder = RegionRecorder()
    policy.memory = PolicyMemory(recorder)
    seen = []
    loss = grpo_loss()

    def watched(inputs):
        seen.append((recorder.open, torch._C._is_multithreading_enabled()))
        return loss(inputs)

    mbs = rollouts(2, advantages=lambda n: torch.linspace(-1, 1, n))
    old = policy.logprobs(mbs)
    ref = policy.logprobs(mbs, temperature=1.5)
    for mb, o, r in zip(mbs, old, ref):
        mb.tensors |= {"old_logprobs": o, "ref_logprobs": r}
    policy.train_step(mbs, watched)
    store = policy.snapshot_weights()
    policy.load_weights(store)
    assert recorder.entered == [("packed_policy", True)] * 5  # one region per call
    assert seen == [(1, False)] * len(mbs)  # the loss ran in it, backward on this thread
    assert recorder.open == 0 and torch._C._is_multithreading_enabled()  # restored after


def test_an_iterator_makes_each_item_inside_the_memory_and_hands_it_over_outside():
    recorder = RegionRecorder()
    memory = PolicyMemory(recorder)

    def items():
        for k in range(3):
            yield k, recorder.open

    handed = [(item, recorder.open) for item in memory.iterate(items(), "export_weights")]
    assert handed == [((k, 1), 0) for k in range(3)]
    assert len(recorder.entered) == 4  # three items and the end


def test_nested_calls_enter_the_region_once():
    recorder = RegionRecorder()
    memory = PolicyMemory(recorder)
    with memory.resident("outer"):
        with memory.resident("inner"):
            assert recorder.open == 1
    assert recorder.entered == [("packed_policy", True)]


def test_calls_while_offloaded_are_refused_before_anything_runs(cpu_dist):
    policy = make_policy()
    policy.memory = PolicyMemory(RegionRecorder())
    policy.memory.offloaded = True  # what offload() leaves (it needs CUDA)
    mbs = rollouts(1)
    calls = {"train_step": lambda: policy.train_step(mbs, grpo_loss()),
             "logprobs": lambda: policy.logprobs(mbs),
             "snapshot_weights": policy.snapshot_weights,
             "swapped_weights": lambda: policy.swapped_weights(None).__enter__(),
             "load_weights": lambda: policy.load_weights({}),
             "export_weights": policy.export_weights}
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=rf"PackedPolicy.{name} is refused: the policy is "
                                               rf"offloaded .* Call policy.onload\(\) first"):
            call()
    assert policy.runtime.iterations == 0 and policy.memory.saver.entered == []
    with pytest.raises(RuntimeError, match="offload is refused: the policy is offloaded "
                                           "already"):
        policy.offload()


def test_a_weight_swap_exchanges_in_the_region_and_its_body_runs_outside(cpu_dist):
    """The swap's entry and exit copy the policy's weights: each in the region; the body of
    the caller's `with` is the caller's code."""
    policy = make_policy()
    recorder = RegionRecorder()
    policy.memory = PolicyMemory(recorder)
    store = policy.snapshot_weights()
    before = len(recorder.entered)
    with policy.swapped_weights(store):
        assert recorder.open == 0 and len(recorder.entered) == before + 1
    assert recorder.open == 0 and len(recorder.entered) == before + 2


@pytest.mark.parametrize("graphs", ["layer", "full"])
def test_the_gpu_tests_and_the_benchmarks_configs_pass_the_training_configs_checks(graphs):
    from tests.gpu.rl_offload_worker import config

    benchmark = load_script("tools", "offload_benchmark.py")
    options = benchmark.parse(["--graphs", graphs])
    args = PolicyConfig(benchmark.training_config(options), offloadable=True).args()
    assert (args.hidden_size, args.ffn_hidden_size, args.num_layers) == (4096, 14336, 4)
    assert args.padded_vocab_size >= 128256 and args.untie_embeddings_and_output_weights
    for model in ("gpt", "hybrid"):
        args = PolicyConfig(config(model, graphs), model=model).args()
        assert args.packed_graph_impl == {"layer": "local", "full": "full_iteration"}[graphs]
    with pytest.raises(SystemExit):
        benchmark.parse(["--cycles", "0"])
