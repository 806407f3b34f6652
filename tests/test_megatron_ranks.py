"""Megatron-LM legacy checkpoints of several tensor- and pipeline-parallel ranks: written by
convert-checkpoint --to megatron, read by --from megatron and megart train --load. Each rank's
shards are checked against Megatron-Core's sharding rules applied here by hand (column-parallel
rows, row-parallel columns, SwiGLU's [gate_r; up_r], vocab rows, stage-local layer numbers)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import train_workers as tw
from megart.cli.main import main
from megart.launcher import launch
from megart.models import GPT, GPTConfig
from megart.models.megatron_names import to_megatron
from megart.models.vocab import fit_vocab
from megart.training import megatron_layout
from megart.training.checkpoint import FILE, iteration_dir, latest_iteration, model_config
from megart.training.megatron_checkpoint import read_megatron, read_rank
from megart.training.shards import read_shards, whole_tensors

LLAMA = dict(normalization="rmsnorm", position_embedding="rotary", activation="swiglu",
             ffn_hidden_size=64, bias=False, untie_embeddings_and_output_weights=True,
             num_query_groups=2)  # fmt: skip
TRAIN_LLAMA = {  # the same model in megart train's (Megatron's) flags
    "normalization": "RMSNorm", "position_embedding_type": "rope", "swiglu": True,
    "disable_bias_linear": True, "untie_embeddings_and_output_weights": True,
    "group_query_attention": True, "num_query_groups": 2, "ffn_hidden_size": 64,
}  # fmt: skip


def by_hand(name: str, whole: torch.Tensor, cfg: GPTConfig, tp: int, t: int) -> torch.Tensor:
    """Rank t's piece per Megatron-Core's layers, written out case by case."""
    if name.endswith("linear_fc1.weight") or name.endswith("linear_fc1.bias"):
        if cfg.activation == "swiglu":
            half = whole.shape[0] // 2
            n = half // tp
            gate, up = whole[t * n : (t + 1) * n], whole[half + t * n : half + (t + 1) * n]
            return torch.cat([gate, up])
        n = whole.shape[0] // tp
        return whole[t * n : (t + 1) * n]
    rows = ("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")
    if name.endswith(rows):
        n = whole.shape[0] // tp
        return whole[t * n : (t + 1) * n]
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        n = whole.shape[1] // tp
        return whole[:, t * n : (t + 1) * n]
    return whole  # norms, biases of row-parallel layers, position embeddings


def whole_model(cfg: GPTConfig, tp: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    state = to_megatron(GPT(cfg).state_dict(), cfg)
    for name in megatron_layout.WORD, megatron_layout.OUTPUT:
        if name in state:
            state[name] = fit_vocab(state[name], cfg.padded_vocab_size(tp))
    return {k: v + torch.rand_like(v) for k, v in state.items()}  # no zero biases / ones norms


@settings(max_examples=12, deadline=None)
@given(
    tp=st.sampled_from([1, 2]),
    pp=st.sampled_from([1, 2]),
    vpp=st.sampled_from([1, 2]),
    llama=st.booleans(),
    tied=st.booleans(),
)
def test_split_follows_megatron_cores_rules_and_merge_inverts_it(tp, pp, vpp, llama, tied):
    kw = {**LLAMA, "untie_embeddings_and_output_weights": not tied} if llama else {}
    cfg = GPTConfig(vocab_size=100, seq_length=8, hidden_size=16, num_layers=4,
                    num_attention_heads=4, **kw)  # fmt: skip
    whole = whole_model(cfg, tp)
    ranks = megatron_layout.split(whole, cfg, tp, pp, vpp)
    assert set(ranks) == {(t, p) for t in range(tp) for p in range(pp)}
    n = cfg.num_layers // (pp * vpp)
    for (t, p), chunks in ranks.items():
        assert len(chunks) == vpp
        for c, state in enumerate(chunks):
            stage = c * pp + p
            first, last = stage == 0, stage == pp * vpp - 1
            for name, value in state.items():
                if name.endswith("._extra_state"):
                    assert value is None  # as the local spec's linear layers hold
                    continue
                if name.startswith("decoder.layers."):
                    _, _, j, rest = name.split(".", 3)
                    assert int(j) < n
                    source = f"decoder.layers.{stage * n + int(j)}.{rest}"
                elif name == megatron_layout.OUTPUT and cfg.untie_embeddings_and_output_weights:
                    source = name
                elif name == megatron_layout.OUTPUT:  # the tied copy on the last stage
                    assert last and not first
                    source = megatron_layout.WORD
                else:
                    assert first if name.startswith("embedding.") else last
                    source = name
                assert torch.equal(value, by_hand(source, whole[source], cfg, tp, t)), name
            layers = {int(k.split(".")[2]) for k in state if k.startswith("decoder.layers.")}
            assert layers == set(range(n))
            assert (megatron_layout.WORD in state) == first
            assert ("decoder.final_layernorm.weight" in state) == last
    merged = megatron_layout.merge(ranks, cfg, tp, pp)
    assert set(merged) == set(whole)
    assert all(torch.equal(merged[k], whole[k]) for k in whole)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tp2 x pp2 Llama-style megart checkpoint after one iteration."""
    ckpt = tmp_path_factory.mktemp("megart")
    kw = dict(TRAIN_LLAMA, train_iters=1, save=str(ckpt), tensor_model_parallel_size=2,
              pipeline_model_parallel_size=2)  # fmt: skip
    launch(tw.train_kw, 4, kw, timeout=300)
    return ckpt


def _convert(*args: str) -> None:
    assert main(["convert-checkpoint", *args]) == 0


def _megart_whole(ckpt) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    shards = read_shards(iteration_dir(ckpt, latest_iteration(ckpt)))
    cfg = model_config(shards[0, 0])
    return cfg, whole_tensors(shards, cfg)


def megart_logits(ckpt) -> tuple[GPT, torch.Tensor, torch.Tensor]:
    """megart's GPT (float64) of the checkpoint's weights, tokens, and its logits of them."""
    cfg, whole = _megart_whole(ckpt)
    ours = GPT(cfg)
    ours.chunk.load_state_dict({k.removeprefix("chunk."): v for k, v in whole.items()})
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length),
                           generator=torch.Generator().manual_seed(5))  # fmt: skip
    with torch.no_grad():
        return ours.double(), tokens, ours.double()(tokens)


def test_tp2_pp2_round_trip_through_megatrons_ranks_keeps_the_weights(saved, tmp_path):
    megatron, back = tmp_path / "megatron", tmp_path / "back"
    _convert("--from", "megart", "--to", "megatron", "--load", str(saved), "--save", str(megatron))
    root = iteration_dir(megatron, 1)
    assert sorted(p.name for p in root.iterdir()) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"
    ]  # fmt: skip
    args = read_rank(root / "mp_rank_01_001" / FILE)["args"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 2)
    assert args.padded_vocab_size == 256  # the built-in corpus's vocabulary, 128 t
    _convert("--from", "megatron", "--to", "megart", "--load", str(megatron), "--save", str(back))
    cfg, want = _megart_whole(saved)
    back_cfg, got = _megart_whole(back)
    assert back_cfg == cfg
    rows = cfg.padded_vocab_size(1)
    for name, value in want.items():
        if name.endswith(("wte.weight", "output_layer.weight")):
            value = fit_vocab(value, rows)
        assert torch.equal(got[name], value), name
    assert set(got) == set(want)


def test_written_tp2_shards_are_the_one_rank_conversion_split_by_hand(saved, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    common = ["--from", "megart", "--to", "megatron", "--load", str(saved)]
    _convert(*common, "--save", str(one), "--target-tensor-parallel-size", "1",
             "--target-pipeline-parallel-size", "1")  # fmt: skip
    _convert(*common, "--save", str(two), "--target-tensor-parallel-size", "2",
             "--target-pipeline-parallel-size", "1")  # fmt: skip
    whole = read_rank(iteration_dir(one, 1) / "mp_rank_00" / FILE)["model"]
    cfg = model_config(read_shards(iteration_dir(saved, 1))[0, 0])
    for t in range(2):
        shard = read_rank(iteration_dir(two, 1) / f"mp_rank_{t:02d}" / FILE)["model"]
        assert set(shard) == set(whole)
        for name, value in whole.items():
            if value is None:  # an _extra_state
                assert shard[name] is None
                continue
            if name in (megatron_layout.WORD, megatron_layout.OUTPUT):
                value = fit_vocab(value, cfg.padded_vocab_size(2))  # the same for this vocab
            assert torch.equal(shard[name], by_hand(name, value, cfg, 2, t)), name
    cfg_two, merged, iteration = read_megatron(two)
    assert cfg_two == cfg and iteration == 1
    assert all(torch.equal(merged[k], v) for k, v in whole.items() if v is not None)


def test_load_of_a_tp2_megatron_checkpoint_gives_the_one_rank_ones_loss(saved, tmp_path):
    run = dict(TRAIN_LLAMA, train_iters=2)
    losses = {}
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}"
        _convert("--from", "megart", "--to", "megatron", "--load", str(saved), "--save", str(out),
                 "--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size",
                 "1")  # fmt: skip
        losses[tp] = [h["loss"] for h in launch(tw.train_kw, 1, {**run, "load": str(out)},
                                                   timeout=300)[0]]  # fmt: skip
    assert losses[2] == pytest.approx(losses[1], rel=1e-6)
    tuned = launch(tw.train_kw, 1, {**run, "load": str(saved), "finetune": True}, timeout=300)[0]
    assert losses[2] == pytest.approx([h["loss"] for h in tuned], rel=1e-5)


def test_a_missing_rank_file_and_misplaced_target_flags_are_refused(saved, tmp_path, capsys):
    out = tmp_path / "megatron"
    _convert("--from", "megart", "--to", "megatron", "--load", str(saved), "--save", str(out))
    gone = iteration_dir(out, 1) / "mp_rank_01_001" / FILE
    gone.unlink()
    capsys.readouterr()
    args = ["convert-checkpoint", "--from", "megatron", "--to", "megart", "--load", str(out)]
    assert main([*args, "--save", str(tmp_path / "back")]) == 2
    err = capsys.readouterr().err
    assert "tensor-parallel 2 x pipeline-parallel 2" in err and str(gone) in err
    assert main([*args, "--save", str(tmp_path / "b2"), "--target-tensor-parallel-size", "2"]) == 2
    assert "use them there only" in capsys.readouterr().err
    write = ["convert-checkpoint", "--from", "megart", "--to", "megatron", "--load", str(saved)]
    assert main([*write, "--save", str(tmp_path / "b3"), "--target-tensor-parallel-size", "0"]) == 2
    assert "--target-tensor-parallel-size 0: give 1 or more" in capsys.readouterr().err
    assert main([*write, "--save", str(tmp_path / "b4"), "--target-tensor-parallel-size", "3"]) == 2
    assert "do not split over tensor-parallel size 3" in capsys.readouterr().err


def test_megatron_cores_tp2_model_loads_each_rank_file_and_computes_megarts_logits(saved, tmp_path):
    """Independent of megart's reading: Megatron-Core's GPTModel built with tensor-parallel
    size 2 (two processes) loads each written rank file strictly (as it is: every key of its
    state dict, ``_extra_state`` entries included, is there), and its logits, gathered
    over the vocabulary shards, are megart's GPT's of the checkpoint's weights."""
    import megatron_core_workers as mcw

    out = tmp_path / "megatron"
    _convert("--from", "megart", "--to", "megatron", "--load", str(saved), "--save", str(out),
             "--target-tensor-parallel-size", "2",
             "--target-pipeline-parallel-size", "1")  # fmt: skip
    _, tokens, want = megart_logits(saved)
    for got in launch(mcw.tp_rank_logits, 2, str(out), tokens, timeout=300):
        got = got[..., : want.shape[-1]]
        assert (got - want).abs().max().item() < 1e-5
        assert want.abs().max().item() > 0.1
