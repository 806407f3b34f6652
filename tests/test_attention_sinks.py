"""Attention sinks, Megatron-LM's --softmax-type off-by-one and learnable (megart.models.sinks):
against Megatron-Core 0.16.1's GPTModel (local spec, float64, CPU) both ways, its logits and
one step's gradients, the sink's too, at tensor-parallel sizes 1 and 2; context parallelism
(p2p ring, all_gather, a2a) and sliding windows equal to one process in float64; megart
train's layouts follow the one-process curve; the sink in megart's checkpoints (resharded);
planted mistakes show; and what is refused, by name."""

import pytest
import torch

import document_workers as dw
import megatron_core_workers as mcw
import sink_workers as sw
from megart.errors import ConfigError
from megart.launcher import launch
from megart.models import GPT, GPTConfig
from megart.models.megatron_names import to_megatron
from megart.models.sinks import explicit_attention, sink_attention

BASE = dict(vocab_size=100, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4,
            position_embedding="rotary")  # fmt: skip
MODELS = {
    f"{kind}{name}": dict(softmax_type=kind, **extra)
    for kind in ("off-by-one", "learnable")
    for name, extra in {
        "": {},
        "-window": dict(window_size=(5, 0), window_attn_skip_freq=2),
        "-gqa-llama": dict(num_query_groups=2, normalization="rmsnorm", activation="swiglu",
                           bias=False, untie_embeddings_and_output_weights=True),
        "-unfused": dict(attention_backend="unfused"),
    }.items()
}  # fmt: skip
F64_REL = 1e-12


@pytest.fixture(scope="module")
def against_megatron_core():
    return mcw.compare_named(BASE, MODELS)


@pytest.mark.parametrize("name", list(MODELS))
def test_megatron_core_computes_the_same_logits_both_ways(against_megatron_core, name):
    mcw.assert_same_both_ways(against_megatron_core[name])


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", ["off-by-one", "learnable"])
def test_logits_and_gradients_are_megatron_cores(tp, kind):
    """Every parameter's gradient (the sinks' included, each rank's heads at tp2) and the
    logits, megart one process against Megatron-Core at ``tp`` from megart's weights."""
    kw = dict(BASE, softmax_type=kind, num_query_groups=2)
    for worst in launch(sw.against_megatron_core, tp, kw, timeout=300):
        sinks = [n for n in worst if "softmax_offset" in n]
        assert len(sinks) == (2 if kind == "learnable" else 0)
        assert max(worst.values()) < 1e-10, worst


def test_the_comparison_catches_a_missing_sink():
    """megart's attention without its sink against Megatron-Core's with: far off."""
    for kind in ("off-by-one", "learnable"):
        worst = launch(sw.against_megatron_core, 1, dict(BASE, softmax_type=kind), "vanilla")[0]
        assert worst["logits"] > 1e-3, worst


def test_the_kernels_path_is_the_explicit_one():
    """torch's log-sum-exp kernels with the sink folded in (causal, and under a bias), and
    under sdpa_kernel(MATH) the explicit scores: equal in float64, the sink's gradient too."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megart.models.window_masks import sliding_causal_bias

    g = torch.Generator().manual_seed(2)
    q, k, v, dy = (torch.randn(2, 4, 12, 8, generator=g, dtype=torch.float64) for _ in range(4))
    sink = torch.randn(4, generator=g, dtype=torch.float64)
    for bias in (None, sliding_causal_bias(12, 3, torch.float64, torch.device("cpu"))):
        want = sw.reference(q, k, v, sink, dy, None if bias is None else 3)
        for math_only in (False, True):
            leaves = [t.clone().requires_grad_() for t in (q, k, v, sink)]
            with sdpa_kernel(SDPBackend.MATH) if math_only else torch.enable_grad():
                y = sink_attention(*leaves[:3], leaves[3], 0.0, bias)
            (y * dy).sum().backward()
            for a, w in zip([y, *(t.grad for t in leaves)], want, strict=True):
                assert (a - w).abs().max() < 1e-12 * w.abs().max()
    y = explicit_attention(q, k, v, sink, None, 0.0)
    assert (y - want[0]).abs().max() > 1e-3  # (the windowed reference is another attention)


@pytest.mark.parametrize("window", [None, 3])
def test_the_ring_counts_the_sink_once(window):
    """Ring attention at cp2 (flash and explicit blocks; with a window, its pieces): output
    and the gradients of q, k, v and the sink (summed over the ranks' rows) equal one
    process's written-out reference in float64; the sink counted twice in the log-sum-exp
    merge is far off."""
    assert max(launch(sw.ring_against_reference, 2, window, timeout=120)) < F64_REL
    assert min(launch(sw.ring_against_reference, 2, window, "twice", timeout=120)) > 1e-3


CP_MODELS = [
    dict(BASE, softmax_type="learnable", bias=False),
    dict(BASE, softmax_type="off-by-one", window_size=(5, 0), window_attn_skip_freq=2),
]


@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a"])
def test_context_parallel_models_are_the_one_process_ones(comm):
    """float64 at cp2 and cp4: one layer's attention (learnable sink, rope) and whole models
    (learnable; off-by-one with a window on every other layer); outputs, input gradients and
    every weight gradient, the sinks' (summed over the ranks' rows) included."""
    layer = dict(BASE, softmax_type="learnable", cp_comm_type=comm)
    models = [dict(m, cp_comm_type=comm) for m in CP_MODELS]
    per_rank = launch(sw.cp_against_one_process, 4, layer, models, timeout=300)
    worst = {k: max(r[k] for r in per_rank if k in r) for k in per_rank[0] | per_rank[-1]}
    assert any("softmax_offset" in k for k in worst)
    assert max(worst.values()) < F64_REL, worst


def test_a_sink_counted_twice_in_the_ring_is_caught_by_the_model_comparison():
    models = [dict(CP_MODELS[0], cp_comm_type="p2p")]
    layer = dict(BASE, softmax_type="learnable")
    per_rank = launch(sw.cp_against_one_process, 4, layer, models, "twice", timeout=300)
    assert max(max(r.values()) for r in per_rank) > 1e-3


@pytest.mark.parametrize("mistake", [None, "unsharded"])
def test_tp2_with_sequence_parallelism_is_the_one_process_model(mistake):
    """float64, learnable sinks: the loss and every gradient gathered whole equal one
    process's; every rank holding the first heads' sinks instead of its own is off."""
    kw = dict(BASE, softmax_type="learnable")
    worst = launch(sw.tp2_against_one_process, 2, kw, mistake, timeout=300)[0]
    assert "dblocks.0.attn.softmax_offset" in worst
    if mistake is None:
        assert max(worst.values()) < F64_REL, worst
    else:
        # (the sinks start near 0, N(0, 0.02): the loss moves 1.8e-6, the sinks' gradient 5e-3,
        # both a million times float64's tolerance)
        assert worst["loss"] > 1e-7 and worst["dblocks.0.attn.softmax_offset"] > 1e-3, worst


def test_the_sink_is_a_per_head_parameter_without_weight_decay():
    from megart.training.optimizer import group_index

    cfg = GPTConfig(**BASE, softmax_type="learnable")
    params = dict(GPT(cfg).chunk.named_parameters())
    sink = params["blocks.1.attn.softmax_offset"]
    assert sink.shape == (4,) and sink.partition_dim == 0 and sink.dtype == torch.float32
    assert group_index("blocks.1.attn.softmax_offset", sink, False) == 1  # the no-decay group
    assert 0 < sink.std().item() < 0.1  # N(0, init_std = 0.02)
    names = to_megatron(GPT(cfg).chunk.state_dict(), cfg)
    assert "decoder.layers.1.self_attention.core_attention.softmax_offset" in names
    off = GPTConfig(**BASE, softmax_type="off-by-one")
    assert not [n for n in GPT(off).state_dict() if "softmax_offset" in n]


@pytest.mark.parametrize(
    "kw,says",
    [
        (dict(softmax_type="sigmoid"), "--softmax-type sigmoid: use one of vanilla"),
        (dict(softmax_type="learnable", init_method_xavier_uniform=True), "two fans"),
        (dict(softmax_type="off-by-one", multi_latent_attention=True), "MLA core has no"),
    ],
)
def test_what_megart_cannot_take_is_refused_by_name(kw, says):
    with pytest.raises(ConfigError, match=says):
        GPTConfig(**BASE, **kw)


@pytest.mark.parametrize("kind", ["off-by-one", "learnable"])
def test_a_sample_of_documents_is_each_document_on_its_own(kind):
    """Under --reset-attention-mask (the documents' mask as the sink path's bias, with a
    window's on every other layer) the logits of a packed sample are each document's alone,
    in float64; without the mask they differ."""
    cfg = GPTConfig(**BASE, softmax_type=kind, window_size=(6, 0), window_attn_skip_freq=2)
    dw.assert_each_document_on_its_own(mcw.drawn(GPT(cfg).double()))
