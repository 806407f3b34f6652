"""Megatron-LM's --rotary-percent below 1 (partial rotary): rope turns the first
int(head size x p) channels of each query and key head and passes the rest unchanged. megart's
angles and rotation are Megatron-Core's RotaryEmbedding and apply_rotary_pos_emb to the bit; a
partial-rotary GPT computes Megatron-Core's GPTModel's logits; megart train takes the flag on
one rank and on two (tensor-parallel), records it in its and Megatron's checkpoints and refuses
--load under another value; what cannot work is refused naming the flags (an odd or empty
rotated part, a part outside (0, 1], no rope, export to Hugging Face's formats)."""

import argparse
import dataclasses
import types
from unittest import mock

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import megatron_workers as mw
import train_workers as tw
from megart.errors import ConfigError
from megart.launcher import launch
from megart.models import GPT, GPTConfig
from megart.models.rope import apply_rotary, rotary
from megart.training.checkpoint import FILE, iteration_dir
from megart.training.export_hf import export_checkpoint
from megart.training.megatron_args import config_from_args, megatron_args

CPU = torch.device("cpu")
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu"]
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "256", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "1e-3", "--lr-warmup-iters", "1",
        "--eval-iters", "0", "--log-interval", "1"]  # fmt: skip


def megatron_core_rope(
    seq: int, head: int, percent: float, interleaved: bool, base: float
) -> tuple[torch.Tensor, torch.Tensor, object]:
    """Megatron-Core's RotaryEmbedding for heads of ``head`` channels: its cos and sin
    [seq, rotated / 2] and its embedding [seq, 1, 1, rotated] (what its attention applies)."""
    embeddings = pytest.importorskip("megatron.core.models.common.embeddings.rotary_pos_embedding")
    rope = embeddings.RotaryEmbedding(
        kv_channels=head,
        rotary_percent=percent,
        rotary_interleaved=interleaved,
        rotary_base=base,
        use_cpu_initialization=True,
    )
    # get_emb moves the frequencies to "the current CUDA device": here the CPU.
    with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
        return *rope.get_cos_sin(seq), rope.get_emb(seq)


def megatron_core_apply(t: torch.Tensor, emb: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Megatron-Core's apply_rotary_pos_emb, unfused, on t [seq, batch, heads, head]."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    config = types.SimpleNamespace(
        apply_rope_fusion=False, rotary_interleaved=interleaved, multi_latent_attention=False
    )
    # A context-parallel group is only used for packed sequences; none here.
    return apply_rotary_pos_emb(t, emb, config, cp_group=object())


def megart_apply(t: torch.Tensor, cfg: GPTConfig, seq: int) -> torch.Tensor:
    """megart's rope of ``cfg`` on t [seq, batch, heads, head], as its attention applies it to
    [batch, heads, seq, head]."""
    cos, sin = rotary(seq, cfg.rotary_dim, CPU, cfg.rotary_base)
    x = t.permute(1, 2, 0, 3)
    return apply_rotary(x, cos, sin, cfg.rotary_interleaved).permute(2, 0, 1, 3)


def head_config(head: int, percent: float, interleaved: bool, base: float) -> GPTConfig:
    return GPTConfig(hidden_size=2 * head, num_attention_heads=2, position_embedding="rotary",
                     rotary_percent=percent, rotary_interleaved=interleaved,
                     rotary_base=base)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(
    head=st.integers(2, 160),
    percent=st.one_of(st.sampled_from([0.25, 0.5, 0.75, 1.0]), st.floats(0.01, 1.0)),
    interleaved=st.booleans(),
    base=st.sampled_from([10000.0, 500.0, 1e6]),
    seq=st.integers(1, 300),
    dtype=st.sampled_from([torch.float64, torch.float32]),
)
def test_angles_and_rotation_are_megatron_cores_to_the_bit(
    head, percent, interleaved, base, seq, dtype
):
    turned = int(head * percent) if percent < 1 else head
    assume(turned >= 2 and turned % 2 == 0)  # the rest is refused (see below)
    cfg = head_config(head, percent, interleaved, base)
    assert cfg.rotary_dim == turned
    want_cos, want_sin, emb = megatron_core_rope(seq, head, percent, interleaved, base)
    cos, sin = rotary(seq, cfg.rotary_dim, CPU, base)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    t = torch.randn(seq, 2, 3, head, generator=torch.Generator().manual_seed(seq), dtype=dtype)
    got, want = megart_apply(t, cfg, seq), megatron_core_apply(t, emb, interleaved)
    assert got.dtype == dtype and torch.equal(got, want)
    # The channels past the turned part pass as they are; the turned part moves (beyond
    # position 0, which turns by 0).
    assert torch.equal(got[..., turned:], t[..., turned:])
    if seq > 1:
        assert not torch.equal(got[1:, ..., :turned], t[1:, ..., :turned])


def test_the_first_channels_turn_not_the_last():
    """What the bitwise test rules out, shown directly: turning the last quarter of a head
    instead of the first gives other numbers (a mutation of apply_rotary that does this fails
    the test above)."""
    head, seq = 16, 8
    cfg = head_config(head, 0.25, False, 10000.0)
    t = torch.randn(seq, 1, 1, head, dtype=torch.float64)
    emb = megatron_core_rope(seq, head, 0.25, False, 10000.0)[2]
    want = megatron_core_apply(t, emb, False)
    got = megart_apply(t, cfg, seq)
    cos, sin = rotary(seq, 4, CPU)
    last = torch.cat((t[..., :12], apply_rotary(t[..., 12:].permute(1, 2, 0, 3), cos, sin)
                      .permute(2, 0, 1, 3)), dim=-1)  # fmt: skip
    assert torch.equal(got, want) and (last - want).abs().max() > 0.1


def _partial_against_megatron_core(configs: list[dict]) -> list[dict]:
    """In a launched process (Megatron-Core keeps its state in module globals): for each
    config, megart against Megatron-Core's GPTModel both ways (megatron_core_workers.compare),
    and megart's GPT turning whole heads, with the partial model's weights, against
    Megatron-Core's partial one."""
    import megatron_core_workers as mcw
    from megart.models.megatron_names import to_megatron

    results = []
    for kw in configs:
        r = mcw.compare(kw)
        cfg = GPTConfig(**kw)
        ours = GPT(cfg).double()
        theirs = mcw.megatron_model(cfg)
        extra = {k: v for k, v in theirs.state_dict().items() if k.endswith("_extra_state")}
        theirs.load_state_dict({**to_megatron(ours.state_dict(), cfg), **extra}, strict=True)
        whole = GPT(dataclasses.replace(cfg, rotary_percent=1.0)).double()
        whole.load_state_dict(ours.state_dict())
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length),
                               generator=torch.Generator().manual_seed(7))  # fmt: skip
        with torch.no_grad():
            got = whole(tokens)
        want = mcw.megatron_logits(theirs, tokens)[..., : got.shape[-1]]
        r["whole_heads"] = (got - want).abs().max().item()
        results.append(r)
    return results


PARTIAL = {
    # Llama-style, heads of 16 channels, the first 8 turning (halves of those 8 paired).
    "halves-0.5": dict(normalization="rmsnorm", activation="swiglu", ffn_hidden_size=64,
                       bias=False, untie_embeddings_and_output_weights=True,
                       num_query_groups=2, rotary_percent=0.5),
    # GPT-2-style with rope, adjacent pairs of the first 4 channels turning.
    "interleaved-0.25": dict(rotary_interleaved=True, rotary_percent=0.25, rotary_base=500.0),
}  # fmt: skip


@pytest.fixture(scope="module")
def partial_results():
    pytest.importorskip("megatron.core")
    base = dict(vocab_size=100, seq_length=16, hidden_size=64, num_layers=2,
                num_attention_heads=4, position_embedding="rotary")  # fmt: skip
    configs = [{**base, **kw} for kw in PARTIAL.values()]
    results = launch(_partial_against_megatron_core, 1, configs, timeout=300)[0]
    return dict(zip(PARTIAL, results, strict=True))


@pytest.mark.parametrize("name", list(PARTIAL))
def test_megatron_core_gptmodel_computes_partial_rotary_logits_as_megart(partial_results, name):
    """Both ways within 1e-8 in float64 (measured at most 4.4e-16), where megart turning the
    whole heads with the same weights is clearly off (measured 2.6e-3 and 3.3e-3)."""
    r = partial_results[name]
    assert r["scale"] > 0.1
    assert r["forward"] < 1e-8 and r["reverse"] < 1e-8
    assert r["whole_heads"] > 1e-4


def _train(argv: list[str], ranks: int = 1) -> tuple[int, str]:
    return launch(mw.run_cli, ranks, argv, timeout=300)[0]


def test_megart_train_takes_the_flag_on_tp2_and_megatrons_checkpoint_keeps_it(tmp_path):
    """megart train --rotary-percent 0.5: one rank trains; two tensor-parallel ranks train
    and save Megatron's legacy format recording it (args.rotary_percent); --load resumes it
    under the same value, one rank, and refuses another naming the flag; export to Hugging
    Face's Llama is refused."""
    status, out = _train([*TINY, *LLAMA, "--rotary-percent", "0.5", "--train-iters", "2"])
    assert status == 0 and "iteration     2/2 |" in out and "loss nan" not in out, out

    ckpt = str(tmp_path / "ckpt")
    argv = [*TINY, *LLAMA, "--rotary-percent", "0.5", "--ckpt-format", "torch"]
    status, out = _train([*argv, "--save", ckpt, "--train-iters", "3", "--exit-interval", "2",
                          "--tensor-model-parallel-size", "2"], ranks=2)  # fmt: skip
    assert status == 0 and "iteration     2/3 |" in out and "loss nan" not in out, out
    for rank in (0, 1):
        state = torch.load(iteration_dir(ckpt, 2) / f"mp_rank_0{rank}" / FILE,
                           weights_only=False)  # fmt: skip
        assert isinstance(state["args"], argparse.Namespace)
        assert state["args"].rotary_percent == 0.5
        assert config_from_args(vars(state["args"])).rotary_percent == 0.5
        assert state["megart"]["model_config"]["rotary_percent"] == 0.5
    status, out = _train([*argv, "--load", ckpt, "--train-iters", "3"])
    assert status == 0 and "iteration     3/3 |" in out and "iteration     2/" not in out, out
    for other in (["--rotary-percent", "0.25"], []):
        status, out = _train([*TINY, *LLAMA, *other, "--load", ckpt, "--train-iters", "3"])
        now = other[1] if other else "1"
        assert status == 2 and "iteration" not in out, out
        assert f"saved with --rotary-percent 0.5 (now --rotary-percent {now})" in out, out
    with pytest.raises(ConfigError, match="a Llama checkpoint cannot represent --rotary-perce"):
        export_checkpoint(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf" / "config.json").exists()


def test_megatron_args_record_the_part_as_megatron_does():
    cfg = GPTConfig(vocab_size=100, seq_length=16, hidden_size=32, num_attention_heads=4,
                    ffn_hidden_size=128, position_embedding="rotary",
                    rotary_percent=0.5)  # fmt: skip
    args = vars(megatron_args(cfg, 5))
    assert args["rotary_percent"] == 0.5 and args["kv_channels"] == 8
    assert config_from_args(args) == cfg
    # Args from before the flag: whole heads; without rope Megatron ignores the flag.
    older = {k: v for k, v in args.items() if k != "rotary_percent"}
    assert config_from_args(older).rotary_percent == 1.0
    learned = {**args, "position_embedding_type": "learned_absolute"}
    assert config_from_args(learned).rotary_percent == 1.0


ROPE = dict(position_embedding_type="rope")


@pytest.mark.parametrize(
    "flags, match",
    [
        (
            dict(**ROPE, hidden_size=256, rotary_percent=0.3),
            r"--rotary-percent 0.3 of head size 64 \(--hidden-size 256 / "
            r"--num-attention-heads 4\) turns int\(64 x 0.3\) = 19 channels, but rope turns "
            r"channels in pairs.*give --rotary-percent 0.29 \(18 channels\) or 0.32 \(20 "
            r"channels\), or a head size",
        ),
        (
            dict(**ROPE, rotary_percent=0.1),
            r"--rotary-percent 0.1 of head size 8 .* = 0 channels.*give --rotary-percent 0.3 "
            r"\(2 channels\), or",
        ),
        # A head size given by --kv-channels is named so, and so is the flag to change; one
        # channel is one.
        (
            dict(**ROPE, kv_channels=6, rotary_percent=0.25),
            r"of head size 6 \(--kv-channels 6\) turns int\(6 x 0.25\) = 1 channel, but .*"
            r"or a head size \(--kv-channels\) whose",
        ),
        (dict(**ROPE, rotary_percent=1.5), "--rotary-percent 1.5 .*above 0 and at most 1"),
        (dict(**ROPE, rotary_percent=0.0), "--rotary-percent 0 .*above 0 and at most 1"),
        (dict(rotary_percent=0.5), "--rotary-percent 0.5 .*add --position-embedding-type rope"),
    ],
)
def test_what_cannot_work_is_refused_naming_the_flags(flags, match):
    with pytest.raises(ConfigError, match=match):
        tw.tiny(**flags).check(1)


def test_an_odd_head_trains_where_its_turned_part_is_even():
    """Megatron-Core turns int(9 x 0.5) = 4 of 9 channels (the hypothesis test covers odd
    heads); whole odd heads are refused as before."""
    config = tw.tiny(**ROPE, hidden_size=36, rotary_percent=0.5)
    assert config.check(1) == 1 and config.gpt_config().rotary_dim == 4
    odd = dict(ROPE, hidden_size=36, rotary_percent=0.5, train_iters=1)
    assert launch(tw.train_kw, 1, odd, timeout=300)[0][0]["loss"] > 0  # its own process
    with pytest.raises(ConfigError, match="= 9 is odd; use an even head size"):
        tw.tiny(**ROPE, hidden_size=36).check(1)


def test_the_cli_refuses_an_odd_part_before_training():
    status, out = mw.run_cli([*TINY, *LLAMA, "--hidden-size", "40", "--rotary-percent", "0.3",
                              "--train-iters", "1"])  # fmt: skip
    assert status == 2 and "iteration" not in out, out
    assert "--rotary-percent 0.3 of head size 10" in out and "= 3 channels" in out, out


def test_hugging_face_exports_refuse_partial_rotary_naming_the_flag(tmp_path):
    llama = GPTConfig(vocab_size=100, seq_length=16, hidden_size=32, num_attention_heads=4,
                      num_layers=1, normalization="rmsnorm", position_embedding="rotary",
                      activation="swiglu", rotary_percent=0.5)  # fmt: skip
    with pytest.raises(ConfigError) as e:
        GPT(llama).save_hf(str(tmp_path / "llama"))
    assert (
        "a Llama checkpoint cannot represent --rotary-percent 0.5 (rope turning 4 of each "
        "head's 8 channels): its rope turns the whole head" in str(e.value)
    )
    gpt2 = dataclasses.replace(llama, normalization="layernorm", activation="gelu")
    with pytest.raises(ConfigError) as e:
        GPT(gpt2).save_hf(str(tmp_path / "gpt2"), expect="gpt2")
    assert "--rotary-percent 0.5 (rotary_percent=0.5; GPT-2 has 1.0)" in str(e.value)
    assert not any(tmp_path.rglob("config.json"))
