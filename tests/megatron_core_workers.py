"""megatron-core's GPTModel (local spec, CPU, a one-rank gloo world) next to megart's GPT: run in
a launched process, since Megatron-Core keeps its parallel state in module globals."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F

from megart.models import GPT, GPTConfig
from megart.models.megatron_names import from_megatron, to_megatron
from megart.models.vocab import fit_vocab
from megart.models.yarn import YarnConfig
from megatron_core_configs import mla_config, moe_config


def tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")  # GPT-2's, megart's


def megatron_model(
    cfg: GPTConfig,
    tp: int = 1,
    pp: int = 1,
    vp_stage: int | None = None,
    first: int | None = None,
    last: int | None = None,
    sequence_parallel: bool = False,
    ep: int = 1,
) -> torch.nn.Module:
    """Megatron-Core's GPTModel of ``cfg`` (``sequence_parallel``: with its
    --sequence-parallel, which its MoE layers need to train at ``tp`` > 1; one rank of ``tp`` x
    ``pp`` when model
    parallelism is already initialised: this rank's pipeline stage; under interleaving, with
    the virtual pipeline size initialised, its model chunk ``vp_stage``, as Megatron-LM's
    get_model builds each; ``first``/``last``: the uneven first/last stages' layers, as
    Megatron-LM's --decoder-first/last-pipeline-num-layers set them; ``ep``: its experts
    spread over that many expert-parallel ranks, as initialised)."""
    from megatron.core import parallel_state
    from megatron.core.activations import squared_relu
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    one_rank_world()
    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    # Megatron-LM's --squared-relu and --quick-geglu are Megatron-Core's own functions.
    acts = {"gelu": tanh_gelu, "squared_relu": squared_relu, "swiglu": F.silu,
            "quick_geglu": quick_gelu}  # fmt: skip
    skip = cfg.window_attn_skip_freq
    config = (MLATransformerConfig if cfg.multi_latent_attention else TransformerConfig)(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.query_groups,
        # MLA's heads have their own widths; its core attention's output is v_head_dim wide.
        kv_channels=cfg.v_head_dim if cfg.multi_latent_attention else cfg.head_dim,
        ffn_hidden_size=cfg.ffn_size,
        layernorm_epsilon=cfg.layernorm_epsilon,
        layernorm_zero_centered_gamma=cfg.apply_layernorm_1p,
        qk_layernorm=cfg.qk_layernorm,
        normalization="RMSNorm" if cfg.normalization == "rmsnorm" else "LayerNorm",
        add_bias_linear=cfg.bias,
        add_qkv_bias=cfg.add_qkv_bias,
        gated_linear_unit=cfg.activation in ("swiglu", "quick_geglu"),
        activation_func=acts[cfg.activation],
        glu_linear_offset=cfg.glu_linear_offset,
        activation_func_clamp_value=cfg.activation_func_clamp_value,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        rotary_interleaved=cfg.rotary_interleaved,
        window_size=cfg.window_size,
        softmax_type=cfg.softmax_type,
        # Megatron-Core tells a pattern by isinstance(list).
        window_attn_skip_freq=list(skip) if isinstance(skip, tuple) else skip,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        pipeline_dtype=torch.float32 if pp > 1 else None,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
        **moe_config(cfg),
        **mla_config(cfg),
        mtp_num_layers=cfg.mtp_num_layers,
        mtp_loss_scaling_factor=cfg.mtp_loss_scaling_factor,
        **(dict(expert_model_parallel_size=ep) if ep > 1 else {}),
        # Its config checks sequence parallelism against its own tensor-parallel size.
        **(
            dict(sequence_parallel=True, tensor_model_parallel_size=tp) if sequence_parallel else {}
        ),
    )
    rope = cfg.position_embedding == "rotary"
    # Its GPTModel reads YaRN's settings as attributes its config class lacks (Megatron-LM's
    # arguments set them so): GPTConfig's names are those attributes'.
    # (Its MLA takes YaRN from mla_config instead, on position_embedding_type "rope".)
    yarn = cfg.rope_type == "yarn" and not cfg.multi_latent_attention
    for name in (f.name for f in dataclasses.fields(YarnConfig)) if yarn else ():
        setattr(config, name, getattr(cfg, name))
    # Its torch norms refuse sequence parallelism; its fused one (torch's function inside) not.
    fused = cfg.apply_layernorm_1p or sequence_parallel
    norms = zero_centred_layer_norm() if fused else contextlib.nullcontext()
    # The stages' tied embedding copies are made equal by an all-reduce of CUDA tensors.
    cuda = cuda_stays_on_cpu() if pp > 1 else contextlib.nullcontext()
    with norms, cuda:
        spec = layer_spec(cfg, config, vp_stage)
        return GPTModel(
            config,
            spec,
            vocab_size=cfg.padded_vocab_size(tp),
            max_sequence_length=cfg.seq_length,
            position_embedding_type=("yarn" if yarn else "rope") if rope else "learned_absolute",
            rotary_base=int(cfg.rotary_base),
            rope_scaling=cfg.rope_scaling,
            rope_scaling_factor=cfg.rope_scaling_factor,
            seq_len_interpolation_factor=cfg.rotary_seq_len_interpolation_factor,
            rotary_percent=cfg.rotary_percent,
            share_embeddings_and_output_weights=not cfg.untie_embeddings_and_output_weights,
            pre_process=parallel_state.is_pipeline_first_stage(False, vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(False, vp_stage),
            vp_stage=vp_stage,
            mtp_block_spec=mtp_spec(config, spec, vp_stage) if cfg.mtp_num_layers else None,
        ).double()


def mtp_spec(config, spec, vp_stage: int | None):
    """Megatron-Core's local (not Transformer Engine) multi-token prediction block spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    return get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp_stage)


def one_rank_world() -> None:
    """Megatron-Core's parallel state over a one-rank gloo world on the CPU (once)."""
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        store = torch.distributed.HashStore()  # one rank: no rendezvous
        torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        on_cpu_only()


def layer_spec(cfg: GPTConfig, config, vp_stage: int | None):
    """Megatron-Core's local layer spec for ``cfg``: one spec for every layer, or with experts
    its decoder block spec, which takes each layer's MoE or dense spec from moe_layer_freq;
    with multi-latent attention, each layer's spec with the shims it needs on CPU
    (_with_mla_shims)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )

    if cfg.num_experts is None:
        spec = get_gpt_layer_local_spec(
            normalization=config.normalization,
            qk_layernorm=cfg.qk_layernorm,
            multi_latent_attention=cfg.multi_latent_attention,
        )
        return _with_mla_shims(spec) if cfg.multi_latent_attention else spec
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization=config.normalization,
        vp_stage=vp_stage,
    )  # fmt: skip
    for layer in block.layer_specs if cfg.multi_latent_attention else ():
        _with_mla_shims(layer)
    return block


def _with_mla_shims(spec):
    """An MLA layer's local ``spec``, its core attention _widths_dropped' (in place)."""
    from megatron.core.transformer import multi_latent_attention as mla

    spec.submodules.self_attention.submodules.core_attention = _widths_dropped()
    # Its module believes Transformer Engine installed where only its names import (as None);
    # its isinstance test of TELinear then fails. It is not installed.
    mla.HAVE_TE = False
    return spec


def _widths_dropped():
    """Megatron-Core 0.16.1's DotProductAttention (its local spec's core attention), taking
    the k_channels and v_channels its MLASelfAttention passes and dropping them: in 0.16.1 it
    has no such arguments (the local MLA spec fails to build: a TypeError). Its scores are
    scaled by the softmax_scale MLA passes, and its output is kv_channels (set to v_head_dim)
    wide per head, so it computes MLA's attention as given."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class WidthsDropped(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kw):
            super().__init__(*args, **kw)

    return WidthsDropped


class _TorchLayerNormAffine:
    """A stand-in for apex's FusedLayerNormAffineFunction (same arguments), computed by torch:
    Megatron-Core's FusedLayerNorm, the one norm of its local spec with zero-centred gamma,
    calls it with the scale it made from its weight."""

    @staticmethod
    def forward(input, weight, bias, normalized_shape, eps):
        return F.layer_norm(input, normalized_shape, weight, bias, eps)

    apply = forward


@contextlib.contextmanager
def zero_centred_layer_norm():
    """Megatron-Core's local spec with its FusedLayerNorm (what it takes with apex installed)
    in place of torch's norm, which refuses zero-centred gamma, for the layers' norms and the
    final one; apex's kernel replaced by torch's function."""
    from unittest import mock

    from megatron.core.fusions import fused_layer_norm as fused
    from megatron.core.models import backends
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import transformer_block

    # Looked up at each forward: installed for good (only FusedLayerNorm calls it).
    fused.FusedLayerNormAffineFunction = _TorchLayerNormAffine
    with (
        mock.patch.object(fused, "HAVE_FUSED_LAYER_NORM", True),
        mock.patch.object(backends, "LNImpl", fused.FusedLayerNorm),
        mock.patch.object(transformer_block, "LayerNormImpl", fused.FusedLayerNorm),
        # The MoE decoder block spec's final norm (get_gpt_decoder_block_spec's LNImpl).
        mock.patch.object(gpt_layer_specs, "LNImpl", fused.FusedLayerNorm),
    ):
        yield


def on_cpu_only() -> None:
    """What Megatron-Core puts on CUDA, kept on this CPU-only process (once per process, after
    its parallel state is initialised)."""
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer.moe import moe_utils

    # The tensor-parallel RNG tracker's fork would switch CUDA generators.
    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    # It puts the attention scores' scratch buffer and rope's frequencies on "the current
    # CUDA device": here the CPU.
    torch.cuda.current_device = lambda: "cpu"
    # Megatron-Core 0.16.1's router gate names Transformer Engine's GEMM, which it only
    # defines where Transformer Engine is installed; None takes its torch path.
    moe_utils.te_general_gemm = None
    fused_softmax.get_sliding_window_causal_mask = on_cpu(
        fused_softmax.get_sliding_window_causal_mask
    )


def on_cpu(make_mask):
    """Megatron-Core's ``make_mask`` (its sliding-window mask, which it builds on "cuda") run
    on the CPU: its own code, with torch.ones' device left out."""

    def run(*args):
        real = torch.ones
        torch.ones = lambda *a, device=None, **kw: real(*a, **kw)
        try:
            return make_mask(*args)
        finally:
            torch.ones = real

    return run


@contextlib.contextmanager
def cuda_stays_on_cpu():
    """``Tensor.cuda()`` as the tensor itself: where Megatron-Core moves a tensor to "the
    current CUDA device", on this CPU-only process the CPU."""
    real = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **kw: self
    try:
        yield
    finally:
        torch.Tensor.cuda = real


def megatron_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    s = tokens.shape[1]
    positions = torch.arange(s).unsqueeze(0).expand_as(tokens)
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)  # True: masked (the future)
    with torch.no_grad():
        return model(tokens, positions, mask)


def drawn(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with noise added to every parameter: biases (zero from both initialisations)
    and norm scales away from their starting values, so that one misplaced shows."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
    return model


def compare(kw: dict, draw: bool = False) -> dict:
    """Both directions: megart's weights in Megatron-Core's model (loaded strictly), and a
    Megatron-Core model's weights in megart's; the largest logit difference of each. With
    ``draw`` both sides' initial weights get noise first (see drawn)."""
    cfg = GPTConfig(**kw)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length),
                           generator=torch.Generator().manual_seed(3))  # fmt: skip
    ours = GPT(cfg).double()
    if draw:
        drawn(ours)
    theirs = megatron_model(cfg)
    mapped = to_megatron(ours.state_dict(), cfg)
    # Megatron-Core's own: its layers' extra state, and the routers' expert biases (zero at
    # the start on both sides; megart keeps them out of its state dict, in a record of their own).
    own = ("_extra_state", "router.expert_bias")
    extra = {k: v for k, v in theirs.state_dict().items() if k.endswith(own)}
    theirs.load_state_dict({**mapped, **extra}, strict=True)
    with torch.no_grad():
        want = ours(tokens)
    got = megatron_logits(theirs, tokens)[..., : want.shape[-1]]
    forward = (got - want).abs().max().item()

    fresh = megatron_model(cfg)  # Megatron-Core's own initial weights
    if draw:
        drawn(fresh)
    back = GPT(cfg).double()
    weights = {k: v for k, v in fresh.state_dict().items() if not k.endswith(own[1])}
    back.chunk.load_state_dict(from_megatron(weights, cfg), strict=True)
    with torch.no_grad():
        mine = back(tokens)
    reverse = (megatron_logits(fresh, tokens)[..., : mine.shape[-1]] - mine).abs().max().item()
    return dict(forward=forward, reverse=reverse, scale=want.abs().max().item())


def compare_all(configs: list[dict], draw: bool = False) -> list[dict]:
    return [compare(kw, draw) for kw in configs]


def compare_named(base: dict, models: dict[str, dict]) -> dict[str, dict]:
    """compare (weights drawn) of ``base`` updated by each of ``models``, all in one launched
    process, by the models' names. Called from the test process."""
    from megart.launcher import launch

    configs = [{**base, **kw} for kw in models.values()]
    return dict(zip(models, launch(compare_all, 1, configs, True, timeout=300)[0], strict=True))


def assert_same_both_ways(result: dict) -> None:
    """compare's result: megart's and Megatron-Core's logits agree (float64 both sides),
    weights converted either way, on logits that are not near zero."""
    assert result["scale"] > 0.1
    assert result["forward"] < 1e-10
    assert result["reverse"] < 1e-10


def tp_rank_logits(megatron_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """On each of the launched ranks: Megatron-Core's GPTModel built with tensor parallelism
    (the world's size), strictly loading its own rank's file of the Megatron legacy checkpoint
    in ``megatron_dir``; the logits of ``tokens``, gathered over the vocabulary shards."""
    import os

    from megatron.core import parallel_state

    from megart.training import checkpoint
    from megart.training.megatron_args import config_from_args
    from megart.training.megatron_checkpoint import read_rank

    tp, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tp, 1)
    root = checkpoint.iteration_dir(megatron_dir, checkpoint.latest_iteration(megatron_dir))
    state = read_rank(root / f"mp_rank_{rank:02d}" / checkpoint.FILE)
    assert state["args"].tensor_model_parallel_size == tp
    cfg = config_from_args(vars(state["args"]))
    on_cpu_only()  # a windowed model's mask too
    model = megatron_model(cfg, tp)
    model.load_state_dict(state["model"], strict=True)
    # Evaluation mode: its MoE layers refuse to train at tp > 1 without sequence parallelism.
    local = megatron_logits(model.eval(), tokens).contiguous()
    parts = [torch.empty_like(local) for _ in range(tp)]
    torch.distributed.all_gather(parts, local)
    torch.distributed.destroy_process_group()
    return torch.cat(parts, -1)


def pad_vocab(whole: dict, cfg: GPTConfig, tp: int) -> None:
    """The word embedding and output layer of ``whole`` (Megatron's names) padded in place for
    ``tp`` ranks' vocabulary, as Megatron-LM's files hold them."""
    for n in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if n in whole:
            whole[n] = fit_vocab(whole[n], cfg.padded_vocab_size(tp))
