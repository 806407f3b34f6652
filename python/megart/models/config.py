"""The shape of a GPT and the checks a parallel layout must pass."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megart.errors import ConfigError

# Re-exported: megart.models.config's names before config_flags was split out of it.
from megart.models.config_flags import MEGATRON_NORMS as MEGATRON_NORMS
from megart.models.config_flags import MEGATRON_POSITIONS as MEGATRON_POSITIONS
from megart.models.config_flags import architecture_flags as architecture_flags
from megart.models.config_flags import refuse_unlike as refuse_unlike
from megart.models.glu_checks import check_glu
from megart.models.mla_checks import check_mla, mla_layout_problems
from megart.models.moe_checks import check_moe, is_moe_layer, moe_layout_problems
from megart.models.mtp_checks import check_mtp, mtp_layout_problems
from megart.models.recompute import DEFAULT_MODULES, check_recompute
from megart.models.rope_checks import check_rope_scaling, check_rotary_percent
from megart.models.sink_checks import check_softmax_type
from megart.models.stages import check_stages, uneven
from megart.models.window import check_window, layer_window, refuse_window
from megart.models.yarn import YarnConfig
from megart.parallel.layout import divisors, either

NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rotary")
ACTIVATIONS = ("gelu", "swiglu", "squared_relu", "quick_geglu")
GATED = ("swiglu", "quick_geglu")  # fc1 of two halves, gate and linear (Megatron-Core GLU)
CP_COMM_TYPES = ("p2p", "all_gather", "a2a")  # of Megatron's; its a2a+p2p is not built


def activation_of(swiglu: bool, squared_relu: bool, quick_geglu: bool = False) -> str:
    """GPTConfig's activation for Megatron-LM's --swiglu, --squared-relu and --quick-geglu
    switches (GeLU where none is on)."""
    gated = "swiglu" if swiglu else "quick_geglu" if quick_geglu else None
    return gated or ("squared_relu" if squared_relu else "gelu")


# Megatron-LM's default --make-vocab-size-divisible-by (also what checkpoints without it used).
VOCAB_MULTIPLE = 128


@dataclass(frozen=True)
class GPTConfig(YarnConfig):
    """A pre-LayerNorm GPT (GPT-2/3 style by default). Field names follow Megatron's flags;
    rope's YaRN fields are YarnConfig's (megart.models.yarn), checked in rope_checks."""

    vocab_size: int = 50257
    seq_length: int = 1024
    hidden_size: int = 768
    num_layers: int = 12
    num_attention_heads: int = 12
    ffn_hidden_size: int | None = None  # 4 h by default
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    layernorm_epsilon: float = 1e-5
    normalization: str = "layernorm"
    # Megatron's --apply-layernorm-1p (its TransformerConfig's layernorm_zero_centered_gamma):
    # every norm's weight is stored zero-centred, initialised to 0 and applied as 1 + weight,
    # LayerNorm and RMSNorm alike; a LayerNorm's bias is as usual.
    apply_layernorm_1p: bool = False
    # Megatron's --qk-layernorm: each query and key head normalised over its channels (the
    # model's norm, one weight of head size for all query heads and one for all key heads)
    # before rope, as Megatron-Core's q_layernorm and k_layernorm.
    qk_layernorm: bool = False
    position_embedding: str = "learned"
    activation: str = "gelu"  # GeLU with the tanh approximation, as GPT-2
    # Megatron's --glu-linear-offset, --activation-func-clamp-value (models.mlp.MLP.act)
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: float | None = None
    bias: bool = True
    # Megatron's --add-qkv-bias (Megatron-Core's TransformerConfig.add_qkv_bias): the fused
    # q/k/v projection keeps a bias where bias=False (--disable-bias-linear) removes the other
    # linear layers' (Qwen2's attention). With bias=True it changes nothing and is stored False,
    # so that one model has one config (Megatron-LM's args record True then instead).
    add_qkv_bias: bool = False
    # Megatron's --untie-embeddings-and-output-weights: the output layer has its own weight
    # (Llama-style) instead of reusing the input embedding's (GPT-2's).
    untie_embeddings_and_output_weights: bool = False
    # Megatron's --group-query-attention --num-query-groups: the heads share keys and values in
    # this many groups (1 is multi-query attention), shrinking the k/v projections and the
    # inference cache. None is one group per head: plain multi-head attention.
    num_query_groups: int | None = None
    # Megatron's --kv-channels: each attention head's width d, where it is not hidden_size /
    # num_attention_heads (Qwen3's and Gemma's heads are wider): q/k/v project h to heads x d
    # (and groups x d) and the output projection heads x d back to h. None: h / heads.
    kv_channels: int | None = None
    # Rotary positions (position_embedding="rotary"), Megatron's --rotary-base and
    # --rotary-interleaved: pairs are the halves of a head (x[i], x[i + d/2]) as Megatron's
    # and Llama's default, or adjacent (x[2i], x[2i+1]) when interleaved. megart rotated
    # adjacent pairs before it recorded this field: checkpoints without it load as interleaved.
    rotary_base: float = 10000.0
    rotary_interleaved: bool = False
    # Megatron's --use-rope-scaling and --rope-scaling-factor (Megatron-Core's RotaryEmbedding
    # rope_scaling, rope_scaling_factor; Hugging Face's rope type "llama3"): Llama 3.x's rule
    # for a longer context, rope's slow frequencies divided by the factor, its fast ones kept,
    # a smooth blend between (megart.models.rope.llama3_inv_freq). The factor means nothing
    # without rope_scaling; 8.0 is Megatron's default (and Llama 3.1's).
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    # Megatron's --rotary-seq-len-interpolation-factor (Megatron-Core's RotaryEmbedding
    # seq_len_interpolation_factor; Hugging Face's rope type "linear"): position interpolation
    # (Chen et al. 2023), positions divided by the factor before rope turns them, so that a
    # context F times longer than training's spans the angles training saw (with rope_scaling
    # too: frequencies scaled, then positions divided, as Megatron-Core). None: as they are.
    rotary_seq_len_interpolation_factor: float | None = None
    # Megatron's --rotary-percent (Megatron-Core's RotaryEmbedding rotary_percent): partial
    # rotary, rope turning only the first rotary_dim = int(head_dim * rotary_percent) channels
    # of each query and key head (as GPT-NeoX and GPT-J do) and passing the rest unturned; its
    # frequencies are those of a head rotary_dim wide. rotary_interleaved pairs channels within
    # those first ones, as in Megatron-Core. 1.0 turns the whole head.
    rotary_percent: float = 1.0
    # Megatron's --attention-backend: "unfused" and "local" run the math kernel (explicit
    # scores); "auto", "flash" and "fused" let torch's scaled_dot_product_attention choose.
    attention_backend: str = "auto"
    # Megatron's --window-size LEFT,0 and --window-attn-skip-freq: sliding-window attention,
    # each token attending to itself and the LEFT tokens before it (-1: all of them), in every
    # layer or in those the pattern picks (megart.models.window).
    window_size: tuple[int, int] | None = None
    window_attn_skip_freq: int | tuple[int, ...] | None = None
    # Megatron's --cp-comm-type: how keys and values travel between context-parallel ranks,
    # "p2p" (a ring, megart.models.ring_attention; Megatron's default), "all_gather"
    # (megart.models.context_parallel) or "a2a" (heads scattered, the sequence gathered,
    # megart.models.all_to_all_attention). Nothing without context parallelism.
    cp_comm_type: str = "p2p"
    # Megatron's --softmax-type: "vanilla", or an attention sink per row (megart.models.sinks).
    softmax_type: str = "vanilla"
    # Megatron's --multi-latent-attention (DeepSeek-V2/V3's MLA, megart.models.mla; checks in
    # models.mla_checks): queries from h (or a q_lora_rank latent), keys and values from a
    # kv_lora_rank latent, heads of qk_head_dim + qk_pos_emb_head_dim channels (rope on the
    # latter, its key part shared by the heads) and values v_head_dim wide. Megatron's defaults.
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    init_std: float = 0.02
    # Megatron's --init-method-xavier-uniform: weights drawn from Glorot's uniform instead of
    # N(0, init_std^2) (megart.models.init says which and with which fans).
    init_method_xavier_uniform: bool = False
    seed: int = 1234  # initial weights depend on this alone, not on the parallel layout
    # megart's fused CUDA kernels (megart.kernels; their torch references on a CPU). Off here,
    # in the library's config, so that GPTConfig(activation="swiglu") or (bias=False) need no
    # more; megart train turns bias_gelu_fusion on as Megatron-LM does (bias and GeLU).
    bias_gelu_fusion: bool = False  # the MLP's bias add + GeLU
    fused_layer_norm: bool = False  # LayerNorm, with the residual add before the second one
    cross_entropy_loss_fusion: bool = False  # loss and gradient in the logits' own buffer
    # Under autocast (--bf16/--fp16) the residual stream (between layers and stages) is in its
    # 16-bit type from the embedding on, as Megatron-LM's 16-bit weights make it (norms compute
    # in fp32 inside); True (--fp32-residual-connection) keeps it fp32. Else: the weights' type.
    fp32_residual_connection: bool = False
    # Activation recomputation, Megatron's flags: "full" recomputes whole layers ("uniform":
    # groups of recompute_num_layers; "block": the first recompute_num_layers of each chunk),
    # "selective" the modules of recompute_modules (models.recompute.MODULES: the attention
    # core, the two norms' outputs, the MLP), Megatron's default the attention core only.
    recompute_granularity: str | None = None
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    recompute_modules: tuple[str, ...] = DEFAULT_MODULES
    # Megatron's --make-vocab-size-divisible-by: the vocabulary is padded to a multiple of this
    # times the tensor-parallel size (padded_vocab_size).
    make_vocab_size_divisible_by: int = VOCAB_MULTIPLE
    # Mixture of experts (megart.models.moe), Megatron's flags: num_experts MLPs of
    # moe_ffn_hidden_size (None: ffn_size) in the MoE layers (moe_layer_freq: every N-th from
    # the first, or a 0/1 per layer), each token sent to moe_router_topk of them by a linear
    # router: top-k of the logits then softmax, or softmax then top-k (pre_softmax), or sigmoid
    # scores, their weights times the scaling factor; logits in moe_router_dtype (None: the
    # input's). Training adds the load-balancing loss times moe_aux_loss_coeff and the z-loss
    # times moe_z_loss_coeff. moe_shared_expert_intermediate_size S: a shared MLP of width S
    # in each MoE layer that every token goes through, added to the experts' sum (None: none);
    # moe_shared_expert_gate: its output times sigmoid(x . w), w a [1, h] weight (Megatron-Core's
    # SharedExpertMLP gate, Qwen2-MoE's shared_expert_gate). Checked by models.moe_checks.
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_layer_freq: int | tuple[int, ...] = 1
    moe_router_topk: int = 2
    moe_router_pre_softmax: bool = False
    moe_router_score_function: str = "softmax"
    moe_router_topk_scaling_factor: float | None = None
    moe_router_dtype: str | None = None
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    # DeepSeek-V3's routing (models.moe_router; the load-balancing loss per sequence is
    # moe_router_load_balancing_type seq_aux_loss): aux-loss-free balancing by a per-expert
    # bias added to the sigmoid scores to choose the top k, moved by the update rate once per
    # iteration; group-limited routing, the top k within the group_topk best of num_groups
    # groups of experts.
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    # Token dropping (models.moe_router.drop_tokens): each expert takes at most
    # ceil(T k / E x capacity_factor) of the T tokens its router routes (None: every token), those
    # beyond dropped by their routing weights ("probs") or positions ("position"); pad: each
    # expert's input padded to that capacity with other tokens at weight 0.
    moe_expert_capacity_factor: float | None = None
    moe_token_drop_policy: str = "probs"
    moe_pad_expert_input_to_capacity: bool = False
    # The router's noise (models.router_noise, drawn by a key of the batch, the sample and the
    # layer, so alike under every layout): its input times uniform noise in [1 - eps, 1 + eps]
    # in training (the Switch Transformer's jitter); force_load_balancing, Megatron's benchmark
    # option, its logits replaced by standard normal ones (gradients passed straight through),
    # so that routing is balanced by chance: it changes the model's math.
    moe_input_jitter_eps: float | None = None
    moe_router_force_load_balancing: bool = False
    # Megatron's --mtp-num-layers and --mtp-loss-scaling-factor: multi-token prediction's
    # depths on the last stage, their losses' weight (models.mtp; checks in models.mtp_checks).
    mtp_num_layers: int | None = None
    mtp_loss_scaling_factor: float = 0.1

    def __post_init__(self) -> None:
        lists = ("window_size", "window_attn_skip_freq", "recompute_modules", "moe_layer_freq")
        for name in lists:  # lists, as JSON records give them
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.bias:  # every linear layer has its bias: the QKV one is no extra
            object.__setattr__(self, "add_qkv_bias", False)
        sizes = ("vocab_size", "seq_length", "hidden_size", "num_layers", "num_attention_heads")
        small = [f"{n}={getattr(self, n)}" for n in sizes if getattr(self, n) < 1]
        if small:  # before any of them divides or counts
            raise ConfigError(f"{', '.join(small)}: the model's sizes must be at least 1")
        check_window(self.window_size, self.window_attn_skip_freq, self.num_layers)
        check_glu(self.activation, self.glu_linear_offset, self.activation_func_clamp_value)
        for name, value, allowed in (
            ("normalization", self.normalization, NORMS),
            ("position_embedding", self.position_embedding, POSITIONS),
            ("activation", self.activation, ACTIVATIONS),
            ("cp_comm_type", self.cp_comm_type, CP_COMM_TYPES),
        ):
            if value not in allowed:
                raise ConfigError(f"{name}={value!r}; use one of {', '.join(allowed)}")
        if self.make_vocab_size_divisible_by < 1:
            raise ConfigError(
                f"make_vocab_size_divisible_by={self.make_vocab_size_divisible_by}: give 1 or "
                "more (Megatron-LM's default is 128)"
            )
        if self.kv_channels is not None and self.kv_channels < 1:
            raise ConfigError(f"kv_channels={self.kv_channels}: a head is at least 1 wide")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"hidden size {self.hidden_size} is not divisible by {self.num_attention_heads} "
                "attention heads"
            )
        groups = self.num_query_groups
        if groups is not None and (groups < 1 or self.num_attention_heads % groups):
            fits = divisors(self.num_attention_heads)
            raise ConfigError(
                f"num_query_groups={groups}: the {self.num_attention_heads} attention heads must "
                f"split into whole groups sharing one key and value head each; use one of {fits} "
                "(or None for one group per head)"
            )
        if self.bias_gelu_fusion and (self.activation != "gelu" or not self.bias):
            raise ConfigError(
                "bias_gelu_fusion fuses the MLP's bias and GeLU: it needs activation='gelu' and "
                "bias=True; turn it off for this model"
            )
        if self.fused_layer_norm and self.normalization != "layernorm":
            raise ConfigError(
                "fused_layer_norm is a LayerNorm kernel; turn it off with "
                f"normalization={self.normalization!r}"
            )
        check_recompute(self)
        check_rotary_percent(self)
        check_moe(self)
        check_mla(self)
        check_mtp(self)
        check_softmax_type(self)
        if self.position_embedding == "rotary" and self.rotary_dim % 2:
            raise ConfigError(f"rotary positions need an even head size, not {self.head_dim}")
        check_rope_scaling(self)

    def recomputes(self, module: str) -> bool:
        """Whether selective recomputation recomputes ``module`` (models.recompute.MODULES)."""
        return self.recompute_granularity == "selective" and module in self.recompute_modules

    @property
    def head_dim(self) -> int:
        """Each attention head's width: kv_channels, else hidden_size / num_attention_heads."""
        if self.kv_channels is not None:
            return self.kv_channels
        return self.hidden_size // self.num_attention_heads

    @property
    def query_size(self) -> int:
        """The width of all query heads together (the attention's output before its
        projection): hidden_size unless kv_channels says otherwise."""
        return self.num_attention_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """The channels of each head that rope turns (rotary_percent of them, rounded down
        as Megatron-Core's RotaryEmbedding rounds; all with rotary_percent 1); under
        multi-latent attention its qk_pos_emb_head_dim channels."""
        if self.multi_latent_attention:
            return self.qk_pos_emb_head_dim
        if self.rotary_percent < 1:
            return int(self.head_dim * self.rotary_percent)
        return self.head_dim

    def refuse_window(self, fmt: str) -> None:
        """Refuses this model for checkpoint format ``fmt`` if some layer has a window."""
        refuse_window(self.window_size, self.window_attn_skip_freq, self.num_layers, fmt)

    def layer_window(self, layer: int) -> int | None:
        """The earlier tokens layer ``layer`` (0-based) attends to, or None for all of them."""
        return layer_window(self.window_size, self.window_attn_skip_freq, layer)

    @property
    def qkv_bias(self) -> bool:
        """Whether the fused q/k/v projection has a bias: with every linear layer's
        (bias) or alone (add_qkv_bias), as Megatron-Core's add_bias_linear or add_qkv_bias."""
        return self.bias or self.add_qkv_bias

    @property
    def query_groups(self) -> int:
        """Key/value heads: num_query_groups, or one per attention head."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def moe_ffn_size(self) -> int:
        """Each expert's MLP width: moe_ffn_hidden_size, else ffn_size (as Megatron-LM)."""
        return self.moe_ffn_hidden_size or self.ffn_size

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) is a mixture of experts (models.moe_checks)."""
        return is_moe_layer(self, layer)

    def padded_vocab_size(self, tp: int) -> int:
        """The vocabulary rounded up to a multiple of make_vocab_size_divisible_by x t
        (Megatron's padding; 128 t by default), so every tensor-parallel rank holds an equal,
        aligned slice. Padded entries never win: their logits are masked out of the loss, so
        losses do not depend on t or the multiple."""
        multiple = self.make_vocab_size_divisible_by * tp
        return math.ceil(self.vocab_size / multiple) * multiple

    def check_layout(
        self,
        tp: int = 1,
        pp: int = 1,
        chunks: int = 1,
        first: int | None = None,
        last: int | None = None,
    ) -> None:
        """Refuses layouts this model cannot take, saying what would fit (``first``/``last``:
        uneven first/last pipeline stages' layers, see megart.models.stages)."""
        check_stages(self.num_layers, pp, chunks, first, last)
        problems = []
        # A rank holds whole query groups (with their key and value heads), as Megatron-LM
        # requires; groups divide the heads, so this also splits the heads.
        groups, heads = self.query_groups, self.num_attention_heads
        if groups % tp:
            what = (
                f"{heads} attention heads"
                if groups == heads
                else f"{groups} query group{'s' * (groups > 1)} (--num-query-groups) of {heads} "
                "attention heads"
            )
            problems.append(
                f"{what} do not split over tensor-parallel size {tp} (use tensor-parallel size "
                f"{either(divisors(groups))})"
            )
        problems += moe_layout_problems(self, tp)  # the experts' width
        problems += mla_layout_problems(self, tp)
        problems += mtp_layout_problems(self, pp, chunks)
        if self.ffn_size % tp:
            problems.append(
                f"the MLP size {self.ffn_size} does not split over tensor-parallel size {tp}"
            )
        if not uneven(first, last) and self.num_layers % (pp * chunks):
            # Interleaving needs two stages or more, as in Megatron-LM.
            fits = [
                p
                for p in divisors(self.num_layers)
                if self.num_layers % (p * chunks) == 0 and (chunks == 1 or p > 1)
            ]
            where = "pipeline stages" if chunks == 1 else f"pipeline stages x {chunks} chunks"
            use = "another --num-layers, or uneven first/last stages"
            if fits:
                use = f"pipeline size {either(fits)}, or uneven first/last stages"
            problems.append(f"{self.num_layers} layers do not split into {pp} {where} (use {use})")
        if problems:
            raise ConfigError("; ".join(problems))


def distinct_head_size(d: int | None, hidden: int, heads: int) -> int | None:
    """GPTConfig's kv_channels for a head size ``d`` given as --kv-channels or Hugging Face's
    head_dim: ``d`` where it is not hidden / heads, else None, so that models of the usual
    head size record what they always have."""
    return None if d is None or (hidden % heads == 0 and d == hidden // heads) else int(d)
