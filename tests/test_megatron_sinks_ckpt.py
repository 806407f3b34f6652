"""Attention sinks (--softmax-type learnable, megart.models.sinks) in Megatron-LM's legacy
checkpoint format (--ckpt-format torch): each layer's softmax_offset under Megatron-Core's key
(``decoder.layers.N.self_attention.core_attention.softmax_offset``), split over tensor
parallelism with the heads, first in its layer's attention in the optimizer's order; args record
softmax_type. Megatron-Core 0.16.1 loads megart's files (model strictly, optimizer through its
FP32Optimizer), trains on megart's curve and writes files megart resumes on it; megart resumes
its own files under tp2, pp2 and dp2 with the distributed optimizer; convert-checkpoint writes
files Megatron-Core computes megart's logits from, and reads them back bitwise. torch_dist
(whose sharded keys megart does not write a sink under yet) is refused by name."""

import pytest
import torch

import megatron_core_workers as mcw
import megatron_optim_workers as mow
import train_workers as tw
from megart.cli.main import main
from megart.launcher import launch
from megart.models import GPTConfig
from megart.training.megatron_args import config_from_args, megatron_args

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


@pytest.mark.parametrize("name", list(SAVES))
def test_megart_resumes_its_legacy_files_on_the_curve(tmp_path, one_process, name):
    nproc, flags = SAVES[name]
    kw = dict(TRAIN, **flags, train_iters=3)
    launch(tw.train_kw, nproc, dict(kw, save=str(tmp_path), exit_interval=2, ckpt_format="torch"),
           timeout=300)  # fmt: skip
    for rank in launch(tw.train_kw, nproc, dict(kw, load=str(tmp_path)), timeout=300):
        assert [h["loss"] for h in rank] == pytest.approx(
            [h["loss"] for h in one_process[2:]], **tw.SAME_RUN
        )


def test_convert_checkpoint_writes_sinks_for_megatron_core(tmp_path, capsys):
    """megart's checkpoint converted to tp2 legacy files: Megatron-Core's two ranks load
    them strictly and compute the checkpoint's logits; converted back, the weights are
    unchanged; torch_dist is refused by name."""
    import megatron_core_ckpt_workers as mckw

    launch(tw.train_kw, 1, dict(TRAIN, save=str(tmp_path / "megart"), train_iters=1),
           timeout=300)  # fmt: skip
    out = tmp_path / "megatron"
    convert = ["convert-checkpoint", "--from", "megart", "--to", "megatron", "--load",
               str(tmp_path / "megart"), "--target-tensor-parallel-size", "2"]  # fmt: skip
    assert main([*convert, "--save", str(out)]) == 0
    cfg = tw.tiny(**TRAIN).gpt_config()
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length),
                           generator=torch.Generator().manual_seed(3))  # fmt: skip
    want = launch(mckw.checkpoint_logits, 1, str(tmp_path / "megart"), tokens, timeout=300)[0]
    assert want.abs().max() > 0.1
    for logits in launch(mcw.tp_rank_logits, 2, str(out), tokens, timeout=300):
        assert (logits[..., : cfg.vocab_size] - want).abs().max().item() < 1e-10
    assert main(["convert-checkpoint", "--from", "megatron", "--to", "megart", "--load",
                 str(out), "--save", str(tmp_path / "back")]) == 0  # fmt: skip
    back = launch(mckw.checkpoint_gpt, 1, str(tmp_path / "back"), timeout=300)[0][1]
    ours = launch(mckw.checkpoint_gpt, 1, str(tmp_path / "megart"), timeout=300)[0][1]
    assert "blocks.0.attn.softmax_offset" in ours and set(back) == set(ours)
    assert all(torch.equal(back[k], ours[k]) for k in ours)
    capsys.readouterr()
    assert main([*convert, "--ckpt-format", "torch_dist", "--save", str(tmp_path / "d")]) == 2
    says = "attention sinks (--softmax-type learnable): megart does not write or read them in"
    assert says + " Megatron-LM's torch_dist" in capsys.readouterr().err
