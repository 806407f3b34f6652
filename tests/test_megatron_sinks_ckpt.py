"""Attention sinks (--softmax-type learnable, megart.models.sinks) in Megatron-LM's checkpoint
formats: each layer's softmax_offset under Megatron-Core's key
(``decoder.layers.N.self_attention.core_attention.softmax_offset``; in torch_dist
``decoder.layers.self_attention.core_attention.softmax_offset``, [layers, heads], the heads
split over tensor parallelism), first in its layer's attention in the optimizer's order; args
record softmax_type. Megatron-Core 0.16.1 loads megart's legacy files (model strictly, optimizer
through its FP32Optimizer), trains on megart's curve and writes files megart resumes on it, and
its DistributedOptimizer holds megart's torch_dist state of the sinks bitwise; megart resumes
its own files of both formats under tp2, pp2 and dp2 with the distributed optimizer;
convert-checkpoint writes files of both formats Megatron-Core computes megart's logits from,
and reads them back bitwise."""

import pytest
import torch

import megatron_core_workers as mcw
import megatron_optim_workers as mow
import train_workers as tw
from megart.cli.main import main
from megart.launcher import launch
from megart.models import GPTConfig
from megart.training.checkpoint import iteration_dir
from megart.training.megatron_args import config_from_args, megatron_args
from megart.training.megatron_dist import read_common

TRAIN = dict(softmax_type="learnable", position_embedding_type="rope", init_method_std=0.2,
             lr=1e-2, num_query_groups=2, group_query_attention=True)  # fmt: skip
KEY = "decoder.layers.0.self_attention.core_attention.softmax_offset"


def test_args_record_softmax_type_and_read_back():
    cfg = GPTConfig(vocab_size=100, seq_length=16, hidden_size=32, num_layers=2,
                    num_attention_heads=4, softmax_type="off-by-one")  # fmt: skip
    args = megatron_args(cfg, 1)
    assert args.softmax_type == "off-by-one"
    assert config_from_args(vars(args)).softmax_type == "off-by-one"
    del args.softmax_type  # older args: the plain softmax
    assert config_from_args(vars(args)).softmax_type == "vanilla"


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_core_trains_from_megarts_files_on_megarts_curve(tmp_path, tp):
    """Megatron-Core loads megart's iteration-1 files (the sinks in its first group-less
    place: the no-decay group, after the layer's input norm), steps iterations 2 and 3 to
    megart's losses, and megart resumes Megatron-Core's files on its own curve."""
    kw = dict(TRAIN, train_iters=5, tensor_model_parallel_size=tp)
    ours, theirs = str(tmp_path / "megart"), str(tmp_path / "megatron")
    straight = launch(tw.train_kw, tp, dict(kw, save=ours, save_interval=1, ckpt_format="torch"),
                      timeout=300)[0]  # fmt: skip
    state = torch.load(f"{ours}/iter_0000001/mp_rank_00/model_optim_rng.pt", weights_only=False)
    assert state["model"][KEY].shape == (4 // tp,) and state["args"].softmax_type == "learnable"
    for rank in launch(mow.resume_and_write, tp, kw, ours, theirs, timeout=300):
        assert rank["weights_diff"] < 1e-6
        assert rank["losses"] == pytest.approx([h["loss"] for h in straight[1:3]], **tw.SAME_RUN)
    resumed = launch(tw.train_kw, tp, dict(kw, load=theirs), timeout=300)[0]
    assert [h["loss"] for h in resumed] == pytest.approx(
        [h["loss"] for h in straight[3:]], **tw.SAME_RUN
    )


@pytest.fixture(scope="module")
def one_process():
    return launch(tw.train_kw, 1, dict(TRAIN, train_iters=3), timeout=300)[0]


SAVES = {  # name: (processes, flags)
    "tp2": (2, dict(tensor_model_parallel_size=2)),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
    "dp2-distopt": (2, dict(use_distributed_optimizer=True)),
}


FORMATS = pytest.mark.parametrize("fmt", ["torch", "torch_dist"])


@FORMATS
@pytest.mark.parametrize("name", list(SAVES))
def test_megart_resumes_its_megatron_format_files_on_the_curve(tmp_path, one_process, name, fmt):
    nproc, flags = SAVES[name]
    kw = dict(TRAIN, **flags, train_iters=3)
    launch(tw.train_kw, nproc, dict(kw, save=str(tmp_path), exit_interval=2, ckpt_format=fmt),
           timeout=300)  # fmt: skip
    for rank in launch(tw.train_kw, nproc, dict(kw, load=str(tmp_path)), timeout=300):
        assert [h["loss"] for h in rank] == pytest.approx(
            [h["loss"] for h in one_process[2:]], **tw.SAME_RUN
        )


@FORMATS
def test_convert_checkpoint_writes_sinks_for_megatron_core(tmp_path, fmt):
    """megart's checkpoint converted to tp2 files: Megatron-Core's two ranks load them
    (strictly; torch_dist through dist_checkpointing) and compute the checkpoint's logits;
    converted back, the weights are unchanged."""
    import megatron_core_ckpt_workers as mckw
    import megatron_dist_workers as mdw

    launch(tw.train_kw, 1, dict(TRAIN, save=str(tmp_path / "megart"), train_iters=1),
           timeout=300)  # fmt: skip
    out = tmp_path / "megatron"
    convert = ["convert-checkpoint", "--from", "megart", "--to", "megatron", "--load",
               str(tmp_path / "megart"), "--target-tensor-parallel-size", "2",
               "--ckpt-format", fmt]  # fmt: skip
    assert main([*convert, "--save", str(out)]) == 0
    cfg = tw.tiny(**TRAIN).gpt_config()
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length),
                           generator=torch.Generator().manual_seed(3))  # fmt: skip
    want = launch(mckw.checkpoint_logits, 1, str(tmp_path / "megart"), tokens, timeout=300)[0]
    assert want.abs().max() > 0.1
    if fmt == "torch":
        got = launch(mcw.tp_rank_logits, 2, str(out), tokens, timeout=300)
    else:
        got = launch(mdw.load_and_run, 2, str(out), tokens, 2, 1, timeout=300)
    for logits in got:
        assert (logits[..., : cfg.vocab_size] - want).abs().max().item() < 1e-10
    assert main(["convert-checkpoint", "--from", "megatron", "--to", "megart", "--load",
                 str(out), "--save", str(tmp_path / "back")]) == 0  # fmt: skip
    back = launch(mckw.checkpoint_gpt, 1, str(tmp_path / "back"), timeout=300)[0][1]
    ours = launch(mckw.checkpoint_gpt, 1, str(tmp_path / "megart"), timeout=300)[0][1]
    assert "blocks.0.attn.softmax_offset" in ours and set(back) == set(ours)
    assert all(torch.equal(back[k], ours[k]) for k in ours)


def test_megatron_cores_distributed_optimizer_holds_megarts_sinks(tmp_path):
    """megart's dp2 torch_dist store with the distributed optimizer: Megatron-Core's model and
    DistributedOptimizer load it (dp_reshardable), and every piece they hold of the sinks
    (fp32 main copy and both moments) is megart's state at the save, bitwise, the pieces
    covering each sink whole; so is the first layer's fc1."""
    import megatron_dist_distopt_workers as w
    from megart.models.megatron_names import to_megatron
    from test_megatron_dist_distopt import MOMENTS, _global_name

    flags = dict(TRAIN, use_distributed_optimizer=True)
    saving = tw.holding(2, dict(flags, train_iters=4, exit_interval=2, save=str(tmp_path),
                                ckpt_format="torch_dist"))  # fmt: skip
    trained = [r["trained"] for r in saving]
    cfg = tw.tiny(**flags).gpt_config()
    whole = {}
    for key in ("weights", *MOMENTS):
        merged = {k.removeprefix("chunk."): v for k, v in tw.merged_by_place(trained, key).items()}
        whole[key] = {n: t.reshape(-1) for n, t in to_megatron(merged, cfg).items()}
    args = read_common(iteration_dir(tmp_path, 2))["args"]
    covered: dict[str, list] = {}
    for rank in launch(w.load_and_save, 2, flags, str(tmp_path), None, timeout=300):
        assert rank["steps"] == {2.0}
        for (chunk, local), piece in rank["pieces"].items():
            name = _global_name(local, chunk, rank["place"][1], args)
            if not name.endswith(("softmax_offset", "layers.0.mlp.linear_fc1.weight")):
                continue
            start, end = piece["range"]
            for ours, theirs in (("weights", "param"), *((m, m) for m in MOMENTS)):
                assert torch.equal(piece[theirs], whole[ours][name][start:end]), (name, theirs)
            covered.setdefault(name, []).append((start, end))
    sinks = [n for n in covered if n.endswith("softmax_offset")]
    assert len(sinks) == cfg.num_layers
    for name, ranges in covered.items():
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == whole["weights"][name].numel(), name
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False)), name


@FORMATS
def test_use_checkpoint_args_takes_the_softmax_type(tmp_path, capsys, fmt):
    """From Megatron's args alone (megart's record stripped), forced over the command line's
    (megart's extra: Megatron-LM's loader leaves it to the command line, whose vanilla model
    would not hold the sinks)."""
    from test_checkpoint_args import USE, flags_config, strip_megart_record

    kw = dict(TRAIN, save=str(tmp_path), train_iters=1, ckpt_format=fmt)
    launch(tw.train_kw, 1, kw, timeout=300)
    strip_megart_record(tmp_path)
    got = flags_config(["--load", str(tmp_path), *USE, "--softmax-type", "off-by-one"])
    assert "Setting softmax_type to learnable from checkpoint" in capsys.readouterr().out
    assert got.softmax_type == "learnable"
