"""Tiny random Hugging Face models, built offline, and the fork's model built from a
converted checkpoint's launch flags: shared by tests/unit/test_hf_convert.py and
tests/gpu/test_hf_checkpoints.py.

Every tensor of a tiny model is random (norm weights too: transformers initialises them to
ones, and a norm mapped to the wrong place would go unnoticed), so a misplaced tensor changes
the logits.
"""

import os

import torch

VOCAB = 96
# Flags a launch line adds to the converted model's (tests/unit/test_config_api.py's MODEL).
TRAINING = ["--seq-length=64", "--micro-batch-size=1", "--global-batch-size=1",
            "--train-iters=1", "--lr=1e-3", "--mock-data", "--use-cpu-initialization"]


ROLES = ("system", "user", "assistant")
# Role words then the message, each turn closed by the end-of-sequence word.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}assistant {% endif %}")


def make_tokenizer(folder, size: int = VOCAB) -> None:
    """A word-level fast tokenizer of ``size`` ids: specials 0-2, the role words, then
    ``w6`` ... ``w{size-1}``; its chat template is `CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{role: 3 + i for i, role in enumerate(ROLES)}}
    vocab.update({f"w{i}": i for i in range(len(vocab), size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


def write_chat_data(path, conversations: int = 64, seed: int = 0, vocab: int = VOCAB) -> str:
    """Chat JSONL of the tiny tokenizer's words: a user turn then an assistant turn that
    repeats it backwards (a pattern a model can learn)."""
    import json
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(conversations):
            words = [f"w{rng.randrange(len(ROLES) + 3, vocab)}" for _ in range(rng.randint(4, 20))]
            f.write(json.dumps({"messages": [
                {"role": "user", "content": " ".join(words)},
                {"role": "assistant", "content": " ".join(reversed(words))}]}) + "\n")
    return str(path)


def _randomize(model, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1:  # norms (ones) and biases (zeros) at initialisation
                parameter.copy_(1 + 0.1 * torch.randn(parameter.shape, generator=generator))


def save_tiny(model, folder, tokenizer_size: int = VOCAB, seed: int = 0) -> str:
    _randomize(model, seed)
    model.save_pretrained(folder)
    make_tokenizer(folder, tokenizer_size)
    return os.fspath(folder)


LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rms_norm_eps=1e-5, tie_word_embeddings=False)
# Llama 3.1's RoPE scaling, with a small base so the scaled frequencies matter at short range.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
               "rope_theta": 10000.0}
QWEN3 = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True)
QWEN3_MOE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                 moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_local_experts=4,
                 num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
                 tie_word_embeddings=False)


def tiny_llama(folder, seed: int = 0, **overrides) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**LLAMA, "rope_parameters": LLAMA3_ROPE, **overrides})
    return save_tiny(LlamaForCausalLM(config), folder, seed=seed)


def tiny_qwen3(folder, seed: int = 0, **overrides) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    return save_tiny(Qwen3ForCausalLM(Qwen3Config(**{**QWEN3, **overrides})), folder, seed=seed)


def tiny_qwen3_moe(folder, seed: int = 0, **overrides) -> str:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**QWEN3_MOE, **overrides}))
    return save_tiny(model, folder, seed=seed)


def flags_of(checkpoint) -> list[str]:
    """The launch flags `import_hf` wrote, without the checkpoint to load (the tests load it
    themselves)."""
    with open(os.path.join(checkpoint, "megatron_flags.txt")) as f:
        return [line for line in f.read().split("\n")
                if line and not line.startswith("--pretrained-checkpoint")]


def parse_fork_args(flags: list[str], model: str = "gpt", extra=(), training=TRAINING):
    """Megatron-LM's and the fork's parse of a launch line (``training`` flags first), with
    the padded vocabulary Megatron-LM sets when it builds the tokenizer at start-up."""
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    from megatron.packed_training.arguments import parse_args

    args = parse_args([*training, *extra, *flags], model, raise_on_error=True)
    args.padded_vocab_size = vocab_size_with_padding(args.vocab_size, args,
                                                     logging_enabled=False)
    return args


def build_fork_model(args, model: str = "gpt"):
    """The fork's model as ``pretrain_gpt.py`` / ``pretrain_mamba.py`` build it."""
    from megatron.packed_training.config import transformer_config_from_args

    if model == "gpt":
        from pretrain_gpt import model_provider
    else:
        from pretrain_mamba import model_provider
    return model_provider(args, transformer_config_from_args(args))


def load_release(model, checkpoint) -> None:
    """Load a converted checkpoint into ``model`` through megatron-core's dist_checkpointing,
    every parameter and buffer of the model required (Transformer Engine's attention keeps an
    ``_extra_state`` outside its sharded state dict, as Megatron-LM's loader allows)."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(model.sharded_state_dict(),
                                    os.path.join(checkpoint, "release"))
    for key in ("args", "checkpoint_version", "iteration", "content_metadata"):
        state.pop(key, None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(key.endswith("_extra_state") for key in missing), (
        missing, unexpected)


def packed_documents(lengths, vocab: int = VOCAB, seed: int = 0, device="cpu"):
    """(documents, tokens ``[1, T]``, position ids ``[1, T]``, packed params) for one packed
    row of documents of ``lengths``."""
    from megatron.packed_graphs.packed_seq import build_packed_batch_params

    generator = torch.Generator().manual_seed(seed)
    documents = [torch.randint(3, vocab, (n,), generator=generator) for n in lengths]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])
    params = build_packed_batch_params(cu.to(device), positions.to(device), max(lengths),
                                       with_seq_idx=True)
    return ([d.to(device) for d in documents], torch.cat(documents)[None].to(device),
            positions[None].to(device), params)


def packed_logits(model, tokens, positions, params):
    with torch.no_grad():
        return model(tokens, positions, None, packed_seq_params=params)[0]


def hf_document_logits(hf_model, documents):
    """Each document alone through the Hugging Face model: ``[len, V]`` each."""
    with torch.no_grad():
        return [hf_model(document[None]).logits[0] for document in documents]


def agreement(fork_logits, documents, reference: list, vocab: int):
    """Per document: (last-position argmax equal, cosine of the last position's logits,
    max |dlogit| over the document), the fork's logits cut to the Hugging Face vocabulary."""
    results, start = [], 0
    for document, ref in zip(documents, reference):
        mine = fork_logits[start:start + len(document), :vocab].float()
        ref = ref.float()
        start += len(document)
        cosine = torch.nn.functional.cosine_similarity(mine[-1], ref[-1], dim=0).item()
        results.append((bool(mine[-1].argmax() == ref[-1].argmax()), cosine,
                        (mine - ref).abs().max().item()))
    return results


DEEPSEEK_V3 = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                   moe_intermediate_size=32, num_hidden_layers=4, first_k_dense_replace=1,
                   num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                   n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
                   routed_scaling_factor=2.5, q_lora_rank=32, kv_lora_rank=16,
                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                   max_position_embeddings=256, rms_norm_eps=1e-6,
                   rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                    "original_max_position_embeddings": 4096,
                                    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                    "mscale_all_dim": 1.0})


def tiny_deepseek_v3(folder, seed: int = 0, **overrides) -> str:
    """DeepSeek-V3 in small: q-LoRA MLA with YaRN, one dense layer then MoE layers with
    shared experts, group-limited sigmoid routing and a (random) expert bias."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**DEEPSEEK_V3, **overrides}))
    with torch.no_grad():  # a trained bias moves the routing; zeros would hide a lost one
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(
                layer.mlp.gate.e_score_correction_bias.shape))
    return save_tiny(model, folder, seed=seed)


# Moonlight-16B-A3B's kind of DeepSeek-V3 in small: no q-LoRA (a plain q_proj), plain RoPE
# (rope_theta 50000, no scaling), one expert group.
MOONLIGHT = dict(q_lora_rank=None, n_group=1, topk_group=1, routed_scaling_factor=2.446,
                 rms_norm_eps=1e-5,
                 rope_parameters={"rope_type": "default", "rope_theta": 50000.0})


def tiny_moonlight(folder, seed: int = 0, **overrides) -> str:
    """DeepSeek-V3 without q-LoRA, shaped like Moonlight (`MOONLIGHT`)."""
    return tiny_deepseek_v3(folder, seed=seed, **{**MOONLIGHT, **overrides})


def _mla_core_attention():
    from megatron.packed_model.attention import VarlenAttention

    class MLACoreAttention(VarlenAttention):
        """The TE-free core attention with MLA's head sizes (its softmax scale comes from MLA,
        the per-document reference attention takes unequal query and value heads)."""

        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    return MLACoreAttention


def cpu_mla_model(args):
    """The converted DeepSeek-V3 model on CPU, as close to the fork's as CPU allows.

    The fork's packed MLA needs Transformer Engine (fused YaRN RoPE, TE attention); here the
    attention is megatron-core's MLASelfAttention (as the fork's `mla.DeepSeekMLASelfAttention`,
    the packed MLA's base: without q-LoRA the query projection is a plain linear, as on GPU)
    over local linears with its unfused RoPE and the fork's TE-free core attention, the
    latent norms separate modules saved under TE's names (as TE's fused LayerNormLinear saves
    them); the MLPs and MoE layers are the fork's (specs.py). tests/gpu/test_hf_checkpoints.py
    runs the fork's own TE model.
    """
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        LayerNormImpl,
        TransformerBlockSubmodules,
    )
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    from megatron.packed_upstream import model_layers
    from megatron.packed_graphs.layers import GraphSafeMoELayer, GraphSafeTransformerLayer
    from megatron.packed_model.mla import DeepSeekMLASelfAttention
    from megatron.packed_graphs.specs import _mlp_spec, _moe_spec
    from megatron.packed_model.providers import VarlenSpecProvider, own_norm
    from megatron.packed_graphs.specs import moe_layer_pattern
    from megatron.packed_training.config import transformer_config_from_args

    model_layers.megatron_core_linears_unfused_without_apex()  # as the fork's builders
    config = transformer_config_from_args(args)
    config.apply_rope_fusion = False  # megatron-core's unfused MLA RoPE (reads cu_seqlens)
    config.persist_layer_norm = False  # the TE parse's default; torch norms refuse it
    provider = VarlenSpecProvider("torch")
    _MLACoreAttention = _mla_core_attention()
    # the latent norms are fused into TE's up projections: plain norms under TE's names
    latent_norm = provider.layer_norm(rms_norm=True)
    attention = ModuleSpec(
        module=DeepSeekMLASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=ColumnParallelLinear, linear_q_down_proj=ColumnParallelLinear,
            linear_q_up_proj=ColumnParallelLinear, linear_kv_down_proj=ColumnParallelLinear,
            linear_kv_up_proj=ColumnParallelLinear,
            core_attention=ModuleSpec(module=_MLACoreAttention, params={"backend": "torch"}),
            linear_proj=RowParallelLinear,
            # without q-LoRA there is no query latent to normalise (megatron-core refuses a
            # q_layernorm then)
            q_layernorm=latent_norm if args.q_lora_rank is not None else IdentityOp,
            kv_layernorm=latent_norm))
    te_names = {"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
                "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_"}

    def layer(is_moe):
        if is_moe:
            pre_mlp, mlp = _moe_spec(provider, "RMSNorm", args.num_experts, False)
            keys = te_names
        else:
            pre_mlp, mlp = _mlp_spec(provider, "RMSNorm")
            keys = {**te_names, "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
        return ModuleSpec(
            module=GraphSafeMoELayer if is_moe else GraphSafeTransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=own_norm(provider, "RMSNorm"), self_attention=attention,
                self_attn_bda=get_bias_dropout_add, pre_mlp_layernorm=pre_mlp, mlp=mlp,
                mlp_bda=get_bias_dropout_add, sharded_state_dict_keys_map=keys))

    pattern = moe_layer_pattern(config.moe_layer_freq, config.num_layers)
    spec = TransformerBlockSubmodules(layer_specs=[layer(bool(p)) for p in pattern],
                                      layer_norm=LayerNormImpl)
    return GPTModel(config=config, transformer_layer_spec=spec,
                    vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings,
                    share_embeddings_and_output_weights=(
                        not args.untie_embeddings_and_output_weights),
                    position_embedding_type=args.position_embedding_type,
                    rotary_base=args.rotary_base)


NEMOTRON_H = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, intermediate_size=96, ssm_state_size=16, mamba_num_heads=8,
                  mamba_head_dim=16, n_groups=2, conv_kernel=4, n_routed_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=32,
                  moe_shared_expert_intermediate_size=48, routed_scaling_factor=1.5,
                  max_position_embeddings=256, layer_norm_epsilon=1e-5,
                  tie_word_embeddings=False)
# Every layer kind; the CPU tests build the fork's model of the layers that run without
# mamba-ssm (no 'M'), tests/gpu the whole pattern.
NEMOTRON_H_LAYERS = ["linear_attention", "full_attention", "mlp", "moe", "linear_attention",
                     "full_attention"]
NEMOTRON_H_CPU_LAYERS = ["full_attention", "mlp", "moe", "full_attention", "moe"]


def tiny_nemotron_h(folder, seed: int = 0, layers=NEMOTRON_H_LAYERS, **overrides) -> str:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(seed)
    model = NemotronHForCausalLM(NemotronHConfig(**{**NEMOTRON_H, "layers_block_type": list(layers),
                                                    **overrides}))
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn(buffer.shape))
    return save_tiny(model, folder, seed=seed)


def first_micro_batches(args, count: int) -> list:
    """The first ``count`` micro-batch dicts a one-rank run of ``args`` trains on (the fork's
    own data pipeline: read, pack, sample)."""
    from megatron.packed_training.datasets.builder import build_datasets, build_rank_iterators

    args.consumed_train_samples = 0
    train, _, _ = build_datasets(args)
    iterator, _ = build_rank_iterators(train, None, args, 0, 1)
    return [next(iterator) for _ in range(count)]


def documents_of(batch) -> list:
    """(tokens, labels, loss mask) of each document of a one-row micro-batch dict."""
    cu = batch["cu_seqlens"].tolist()
    return [tuple(batch[key][0, cu[i]:cu[i + 1]] for key in ("tokens", "labels", "loss_mask"))
            for i in range(batch["num_documents"])]


def hf_loss_sum(hf_model, batch, device="cpu") -> tuple[float, float]:
    """(sum of the Hugging Face model's masked token losses, masked token count) over a
    micro-batch, each document run alone."""
    total, count = 0.0, 0.0
    with torch.no_grad():
        for tokens, labels, mask in documents_of(batch):
            logits = hf_model(tokens[None].to(device)).logits[0].float()
            losses = torch.nn.functional.cross_entropy(logits, labels.to(device),
                                                       reduction="none")
            total += float((losses * mask.to(device)).sum())
            count += float(mask.sum())
    return total, count


def fork_loss_sum(model, batch, device="cpu", with_seq_idx=False) -> tuple[float, float]:
    """The same for the fork's model on the packed micro-batch (the training step's loss)."""
    from megatron.packed_training.packed_step import to_device_micro_batch

    micro = to_device_micro_batch(batch, with_seq_idx=with_seq_idx, static_max_seqlen=False,
                                  device=torch.device(device))
    with torch.no_grad():
        losses = model(micro.tokens, micro.position_ids, None, labels=micro.labels,
                       packed_seq_params=micro.params)
    mask = micro.loss_mask.float()
    return float((losses.float() * mask).sum()), float(mask.sum())


def greedy(next_logits, prompt: list, steps: int) -> tuple[list, list]:
    """Greedy continuation of ``prompt``: (token ids, the top-2 logit gap at each step);
    ``next_logits(ids)`` gives the last position's logits."""
    ids, gaps = list(prompt), []
    for _ in range(steps):
        top = next_logits(ids).float().topk(2)
        gaps.append(float(top.values[0] - top.values[1]))
        ids.append(int(top.indices[0]))
    return ids[len(prompt):], gaps
