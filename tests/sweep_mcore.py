"""tests/sweep.py's mcore mode: a GPTConfig drawn over the model options that megart's GPT and
Megatron-Core's GPTModel both have and megart.models.megatron_names maps (norms, 1p, rope's
base, pairing, part, llama3 scaling and position interpolation, SwiGLU, biases, the QKV bias,
untied output, grouped queries, head widths, --qk-layernorm, windows, the MLP width, a padded
vocabulary, epsilon, mixture of experts), compared with megatron_core_workers.compare (weights
drawn, float64, CPU) in a launched process: megart's weights in Megatron-Core's model and
Megatron-Core's in megart's must give the same logits, both ways within the mode's tolerance (a
model with experts: MOE_TOLERANCE, see there)."""

from __future__ import annotations

import dataclasses
import importlib.util
import random

from megart import ConfigError
from megart.models import GPTConfig
from megart.parallel.layout import divisors

# Below this largest logit the absolute bound says little (assert_same_both_ways' floor).
SCALE = 0.1
# A model with experts is judged against this bound where the mode's is tighter: Megatron-Core
# takes the router's softmax (or sigmoid) in fp32 even in a float64 model (its moe_utils
# casts the scores), so its routing weights are rounded to ~6e-8 relative and the logits move
# by ~1e-7 of their scale (the first slice's hand check: 1.5e-7 at scale 2).
MOE_TOLERANCE = 1e-6


def tolerance_for(kw: dict, tolerance: float) -> float:
    """The bound of model ``kw``: the mode's, or MOE_TOLERANCE for a model with experts."""
    return max(tolerance, MOE_TOLERANCE) if kw.get("num_experts") else tolerance


def _heads(rng: random.Random, rotary: bool) -> dict:
    """Heads, groups, hidden size and (a quarter of the time) a head width other than h /
    heads; rope mostly gets even heads (an odd one is megart's refusal, drawn now and then)."""
    heads = rng.randint(2, 8)
    kw: dict = dict(num_attention_heads=heads)
    widths = [d for d in range(1, 65) if 16 <= heads * d <= 64]
    if rotary and rng.random() < 0.9:
        widths = [d for d in widths if d % 2 == 0] or [8]
    if rng.random() < 0.25:
        kw["kv_channels"] = rng.choice([d for d in (2, 4, 6, 8, 12, 16) if d not in widths])
        kw["hidden_size"] = rng.randint(16, 64)  # need not split into the heads then
    else:
        kw["hidden_size"] = heads * rng.choice(widths)
    if rng.random() < 0.6:
        kw["num_query_groups"] = rng.choice(divisors(heads))
    return kw


def _rope(rng: random.Random, head: int) -> dict:
    """Rope's options for heads ``head`` wide."""
    # Megatron-Core's rotary_base is an int (Megatron-LM's --rotary-base type=int).
    kw: dict = dict(position_embedding="rotary", rotary_base=rng.choice([10000, 500, 10**6]))
    if rng.random() < 0.35:
        kw["rotary_interleaved"] = True
    if rng.random() < 0.3:
        # Mostly a part of an even count of channels (an odd one is megart's refusal).
        percents = [0.5, 0.25, 0.75, 0.6]
        even = [p for p in percents if int(head * p) >= 2 and int(head * p) % 2 == 0]
        kw["rotary_percent"] = rng.choice(even if even and rng.random() < 0.8 else percents)
    if rng.random() < 0.25:
        kw.update(rope_scaling=True, rope_scaling_factor=rng.choice([1.0, 4.0, 8.0, 32.0]))
    if rng.random() < 0.2:
        kw["rotary_seq_len_interpolation_factor"] = rng.choice([0.5, 2.0, 4.0])
    return kw


def _window(rng: random.Random, layers: int) -> dict:
    # Not -1 (megart's and Transformer Engine's unbounded window): Megatron-Core's local
    # attention (its get_sliding_window_causal_mask) allows triu(diagonal=-left) & tril(0),
    # nothing for left = -1, so it masks every score alike: a uniform average over past and
    # future tokens (the sweep's first draws: logits 0.94 apart).
    kw: dict = dict(window_size=(rng.choice([0, 1, 2, 3, 5, 20]), 0))
    if rng.random() < 0.5:
        if rng.random() < 0.5:
            kw["window_attn_skip_freq"] = rng.randint(1, 3)
        else:
            kw["window_attn_skip_freq"] = tuple(rng.choice([0, 1]) for _ in range(layers))
    return kw


def _moe(rng: random.Random, layers: int) -> dict:
    """Mixture-of-experts options for ``layers`` layers: experts, top-k (1 mostly with the
    softmax first, else megart's and Megatron's refusal), the layers (every N-th or a 0/1
    pattern), sigmoid scores, a scaling factor, the experts' width, the router's dtype, shared
    experts (gated or not), group-limited routing and the expert bias."""
    experts = rng.randint(1, 6)
    kw: dict = dict(num_experts=experts, moe_router_topk=rng.randint(1, experts))
    if rng.random() < 0.4 or (kw["moe_router_topk"] == 1 and rng.random() < 0.9):
        kw["moe_router_pre_softmax"] = True
    if rng.random() < 0.5:
        if rng.random() < 0.5:
            kw["moe_layer_freq"] = rng.randint(1, 3)
        else:
            kw["moe_layer_freq"] = tuple(rng.choice([0, 1]) for _ in range(layers))
    if rng.random() < 0.2:
        kw["moe_router_score_function"] = "sigmoid"
    if rng.random() < 0.3:
        kw["moe_router_topk_scaling_factor"] = rng.choice([0.5, 2.0, 2.5])
    if rng.random() < 0.4:
        kw["moe_ffn_hidden_size"] = rng.randint(4, 48)
    if rng.random() < 0.3:
        kw["moe_router_dtype"] = rng.choice(["fp32", "fp64"])
    if rng.random() < 0.3:  # shared experts, at times gated
        kw["moe_shared_expert_intermediate_size"] = rng.randint(4, 48)
        if rng.random() < 0.5:
            kw["moe_shared_expert_gate"] = True
    k = kw["moe_router_topk"]
    # Group-limited routing: G groups dividing the experts, g of them kept, g <= k <= g E / G.
    limits = [
        (big, g)
        for big in (2, 3)
        if experts % big == 0
        for g in range(1, big + 1)
        if k % g == 0 and g <= k <= g * experts // big
    ]
    if limits and rng.random() < 0.2:
        kw["moe_router_num_groups"], kw["moe_router_group_topk"] = rng.choice(limits)
    if kw.get("moe_router_score_function") == "sigmoid" and rng.random() < 0.4:
        kw["moe_router_enable_expert_bias"] = True
    return kw


def config(rng: random.Random) -> dict:
    """GPTConfig's keywords of one drawn model: small (s 8-16, h 16-64, 1-3 layers, 2-8 heads)
    so that a draw takes seconds."""
    layers, rotary = rng.randint(1, 3), rng.random() < 0.6
    kw: dict = dict(num_layers=layers, seq_length=rng.randint(8, 16), seed=rng.randrange(1000))
    kw.update(_heads(rng, rotary))
    # A vocabulary Megatron's padding rounds up (to 128, or another multiple), or a whole one.
    kw["vocab_size"] = rng.choice([rng.randint(40, 300), 128, 256])
    if rng.random() < 0.2:
        kw["make_vocab_size_divisible_by"] = rng.choice([1, 8, 64])
    if rotary:
        kw.update(
            _rope(rng, kw.get("kv_channels") or kw["hidden_size"] // kw["num_attention_heads"])
        )
    if rng.random() < 0.5:
        kw["normalization"] = "rmsnorm"
    # Zero-centred RMSNorm is Transformer Engine's alone: the local spec's norms assert
    # (WrappedTorchNorm refuses zero-centred gamma, FusedLayerNorm any RMSNorm).
    elif rng.random() < 0.3:
        kw["apply_layernorm_1p"] = True
    for flag, chance in (("qk_layernorm", 0.3),
                         ("untie_embeddings_and_output_weights", 0.5),
                         ("add_qkv_bias", 0.25)):  # fmt: skip
        if rng.random() < chance:
            kw[flag] = True
    if rng.random() < 0.5:
        kw["activation"] = "swiglu"
    elif rng.random() < 0.3:
        kw["activation"] = "squared_relu"
    if rng.random() < 0.4:
        kw["bias"] = False
    if rng.random() < 0.5:
        kw["ffn_hidden_size"] = rng.randint(8, 96)
    if rng.random() < 0.4:
        kw["layernorm_epsilon"] = rng.choice([1e-6, 1e-3, 0.1])  # 0.1 moves the logits
    if rng.random() < 0.25:
        kw.update(_window(rng, layers))
    if rng.random() < 0.3:
        kw.update(_moe(rng, layers))
        if rng.random() < 0.9:  # megart's experts have no biases (else its refusal)
            kw["bias"] = False
    # megart's own ways to the same math (Megatron-Core's side has one): the math kernel
    # instead of torch's attention, and the fused kernels' torch references.
    if rng.random() < 0.3:
        kw["attention_backend"] = "unfused"
    if kw.get("activation", "gelu") == "gelu" and kw.get("bias", True) and rng.random() < 0.3:
        kw["bias_gelu_fusion"] = True
    if kw.get("normalization") != "rmsnorm" and rng.random() < 0.3:
        kw["fused_layer_norm"] = True
    return kw


def run_compare(kw: dict, sabotage: str | None = None) -> dict:
    """In a launched process: megatron_core_workers.compare of ``kw``, weights drawn. A
    ``sabotage`` (for the test that the check catches a wrong mapping): "weight" moves one
    mapped weight by 1e-8 each way; "interleaved" builds Megatron-Core's model with the other
    rope pairing."""
    import megatron_core_workers as mcw

    if sabotage == "weight":
        for name in ("to_megatron", "from_megatron"):
            setattr(mcw, name, _nudged(getattr(mcw, name)))
    elif sabotage == "interleaved":
        build = mcw.megatron_model

        def flipped(cfg: GPTConfig, *args, **kwargs):  # noqa: ANN202 (a torch module)
            other = dataclasses.replace(cfg, rotary_interleaved=not cfg.rotary_interleaved)
            return build(other, *args, **kwargs)

        mcw.megatron_model = flipped
    elif sabotage is not None:
        raise ValueError(f"sabotage={sabotage!r}: 'weight' or 'interleaved'")
    return mcw.compare(kw, draw=True)


def _nudged(mapping):  # noqa: ANN001, ANN202 (to_megatron or from_megatron)
    def run(state: dict, cfg: GPTConfig) -> dict:
        out = dict(mapping(state, cfg))
        name = next(n for n in sorted(out) if n.endswith("weight") and out[n].dim() == 2)
        out[name] = out[name] + 1e-8
        return out

    return run


def check(kw: dict, launch, failed, tolerance: float, sabotage: str | None = None) -> str:
    """The verdict line of one model's keywords (tests/sweep.py's verdicts): REFUSED where
    GPTConfig refuses them, ERROR where Megatron-Core (or the launched process) fails, else OK
    or MISMATCH by both directions' largest logit difference against ``tolerance``."""
    try:
        GPTConfig(**kw)
    except ConfigError as e:
        return f"REFUSED {kw}: {e}"
    try:
        r = launch(run_compare, 1, kw, sabotage, timeout=300)[0]
    except Exception as e:  # noqa: BLE001 (every failure is a verdict, printed)
        return failed(e, str(kw))
    worst = max(r["forward"], r["reverse"])
    numbers = f"{worst:.1e} (forward {r['forward']:.1e}, reverse {r['reverse']:.1e}, "
    numbers += f"largest logit {r['scale']:.2g})"
    if r["scale"] < SCALE:
        return f"ERROR logits too small to judge: {numbers} {kw}"
    return f"{'OK' if worst < tolerance_for(kw, tolerance) else 'MISMATCH'} {numbers} {kw}"


def skipped() -> str | None:
    """The SKIP line where megatron-core is not installed, else None."""
    if importlib.util.find_spec("megatron") is None or not importlib.util.find_spec(
        "megatron.core"
    ):
        return "SKIP megatron-core is not installed"
    return None


def verdict(rng: random.Random, launch, failed, tolerance: float) -> str:
    """One drawn model's line; SKIP where megatron-core is not installed."""
    return skipped() or check(config(rng), launch, failed, tolerance)
