"""Megatron-LM's --use-checkpoint-args in megart train: the model's flags (and with
--use-mp-args-from-checkpoint-args the layout, with --no-use-tokenizer-model-from-checkpoint-args
without the tokenizer) taken from the latest checkpoint in --load, whichever format wrote it:
import-hf's release checkpoint, megart's files, Megatron-LM's legacy files and torch_dist store.
The references: transformers' loss, the uninterrupted run's curve, the flags the checkpoint
was trained with."""

import argparse
import json

import pytest
import torch

import megatron_workers as mw
import train_workers as tw
from megart import ConfigError
from megart.cli.main import main as megart_main
from megart.cli.train import add_arguments, config_from_args
from megart.launcher import launch
from megart.training import trainer_setup
from megart.training.megatron_files import torch_load
from test_export_hf import small_tokenizer
from test_hf_llama import saved_llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors.torch")

BATCH = ["--micro-batch-size", "2", "--global-batch-size", "8", "--eval-iters", "0"]
# A model unlike the default in every flag --use-checkpoint-args takes (GQA, SwiGLU, RMSNorm
# with another epsilon, rope of another base, untied, no biases, no dropout: which also makes
# the curve the same in every layout).
ARCH = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--ffn-hidden-size", "48", "--swiglu", "--normalization",
        "RMSNorm", "--layernorm-epsilon", "1e-6", "--position-embedding-type", "rope",
        "--rotary-base", "500000", "--untie-embeddings-and-output-weights",
        "--disable-bias-linear", "--group-query-attention", "--num-query-groups", "2",
        "--hidden-dropout", "0", "--attention-dropout", "0"]  # fmt: skip
USE = ["--use-checkpoint-args"]
MP = ["--use-mp-args-from-checkpoint-args"]


def flags_config(argv: list[str]):
    """megart train's TrainConfig for ``argv``, as its command line builds it."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def cli(nproc: int, argv: list[str], log=None) -> tuple[str, list[dict]]:
    """megart train ``argv`` on ``nproc`` launched ranks: rank 0's output and --log-jsonl's."""
    extra = [] if log is None else ["--log-jsonl", str(log)]
    status, out = launch(mw.run_cli, nproc, [*argv, *extra], timeout=400)[0]
    assert status == 0, out
    lines = [] if log is None else log.read_text().splitlines()
    return out, [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def imported_llama(tmp_path_factory):
    """transformers' Llama (GQA, untied, rope base 500000) and its import-hf checkpoint."""
    root = tmp_path_factory.mktemp("llama")
    model = saved_llama(root / "hf")
    ckpt = root / "ckpt"
    assert megart_main(["import-hf", "--input", str(root / "hf"), "--save", str(ckpt)]) == 0
    return ckpt, model


@pytest.mark.parametrize("tp", [1, 2])
def test_an_imported_llama_trains_from_its_checkpoint_args_with_transformers_first_loss(
    imported_llama, tmp_path, tp
):
    ckpt, hf = imported_llama
    run = ["--load", str(ckpt), *USE, "--train-iters", "2", "--lr-warmup-iters", "0", *BATCH]
    layout = ["--tensor-model-parallel-size", str(tp)]
    out, history = cli(tp, [*run, *layout], tmp_path / "log.jsonl")
    assert "Setting rotary_base to 500000 from checkpoint" in out
    assert "Setting num_query_groups to 2 from checkpoint" in out
    assert f"seq 64; tp {tp} x pp 1" in out  # import-hf's length (max_position_embeddings)
    config = flags_config(run)
    data = trainer_setup.datasets(config, None)[0]
    inputs, targets = data.global_batch(config.seed, 0, config.global_batch_size)
    with torch.no_grad():
        logits = hf(inputs).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    assert history[0]["loss"] == pytest.approx(want, rel=1e-5)
    assert history[1]["loss"] < history[0]["loss"]


def test_a_tp2_pp2_checkpoint_resumes_on_the_curve_from_its_args_in_its_layout_or_another(
    tmp_path,
):
    run = ["--train-iters", "4", "--lr-warmup-iters", "1", *BATCH]
    _, straight = cli(1, [*ARCH, *run], tmp_path / "straight.jsonl")
    ckpt = tmp_path / "ckpt"
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    cli(4, [*ARCH, *run, *layout, "--save", str(ckpt), "--exit-interval", "2"])
    # Its own layout from its args; no model flag and no layout flag given.
    out, resumed = cli(4, ["--load", str(ckpt), *USE, *MP, *run], tmp_path / "mp.jsonl")
    assert "Setting tensor_model_parallel_size to 2 from checkpoint" in out
    assert "tp 2 x pp 2 x dp 1" in out and "resharded" not in out
    tw.assert_resumed_on_curve(straight, [{"history": resumed}], rel=1e-5)
    # Without the layout's args: this run's own (one process), resharded.
    out, resumed = cli(1, ["--load", str(ckpt), *USE, *run], tmp_path / "one.jsonl")
    assert "tensor_model_parallel_size" not in out and "tp 1 x pp 1 x dp 1" in out
    tw.assert_resumed_on_curve(straight, [{"history": resumed}], rel=1e-5)


def strip_megart_record(root) -> None:
    """Megatron-LM's checkpoint as Megatron-LM writes it: without megart's own record beside
    its args (what megart's files keep of the model), so that only the args tell the model."""
    for path in root.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        tw.rewrite_checkpoint_file(path, lambda state: state.pop("megart"))
    for path in root.glob("iter_*/common.pt"):
        common = torch_load(path)
        common.pop("megart")
        torch.save(common, path)


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_megatron_checkpoints_give_the_model_and_layout_their_args_record(
    tmp_path, ckpt_format, capsys
):
    ckpt = tmp_path / "ckpt"
    layout = ["--tensor-model-parallel-size", "2"]
    run = ["--train-iters", "2", *BATCH]  # the scheduler Megatron's files hold: the same
    trained = [*ARCH, *run, *layout, "--hidden-dropout", "0.05"]
    cli(2, [*trained, "--exit-interval", "1", "--ckpt-format", ckpt_format, "--save", str(ckpt)])
    strip_megart_record(ckpt)
    want = flags_config(trained)
    got = flags_config(["--load", str(ckpt), *USE, *MP, *run])
    assert got.gpt_config() == want.gpt_config()
    assert (got.tp, got.pp, got.vocab_size, got.hidden_dropout) == (2, 1, 256, 0.05)
    assert f"the model's flags from {ckpt}/iter_0000001 ({ckpt_format})" in capsys.readouterr().out
    # The same checkpoint trains on, in another layout, from those args.
    out, history = cli(1, ["--load", str(ckpt), *USE, *run], tmp_path / "log.jsonl")
    assert "4 layers x 32 hidden, 4 heads in 2 query groups, seq 16; tp 1" in out
    assert [h["iteration"] for h in history] == [2]


def test_the_tokenizer_is_taken_from_the_checkpoint_and_recorded_again(tmp_path, capsys):
    small_tokenizer(tmp_path / "tok")
    first, second = tmp_path / "first", tmp_path / "second"
    tiny = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--mock-data", *BATCH]  # fmt: skip
    hf = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "tok")]
    cli(1, [*tiny, "--train-iters", "1", *hf, "--save", str(first)])
    resume = ["--load", str(first), *USE, "--mock-data", *BATCH, "--train-iters", "2"]
    cli(1, [*resume, "--save", str(second)])
    record = torch_load(second / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt")["tokenizer"]
    assert record == {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": hf[3]}
    capsys.readouterr()
    out = tmp_path / "hf"
    assert megart_main(["export-hf", "--load", str(second), "--output", str(out)]) == 0
    assert capsys.readouterr().out.endswith("; the tokenizer it was trained with\n")
    assert (out / "tokenizer.json").is_file()
    # Without the checkpoint's tokenizer: neither its type nor its model, its vocabulary kept.
    saved = flags_config(resume)
    config = flags_config([*resume, "--no-use-tokenizer-model-from-checkpoint-args"])
    assert (config.tokenizer_type, config.tokenizer_model) == (None, None)
    assert saved.tokenizer_model == hf[3] and config.vocab_size == saved.vocab_size < 256


def test_refusals_and_what_the_command_line_keeps(tmp_path, capsys):
    with pytest.raises(ConfigError, match="--use-checkpoint-args .* give --load DIR"):
        flags_config(USE)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no latest_checkpointed_iteration.txt there"):
        flags_config(["--load", str(tmp_path / "empty"), *USE])
    for flag in (*MP, "--no-use-tokenizer-model-from-checkpoint-args"):
        with pytest.raises(ConfigError, match=f"{flag} goes with --use-checkpoint-args"):
            flags_config(["--load", str(tmp_path / "empty"), flag])
    status, out = mw.run_cli(["--load", str(tmp_path / "empty"), *USE])
    assert status == 2 and "--use-checkpoint-args reads the model's flags" in out
    # A GPT-2-style checkpoint: its switches (forced, as Megatron-LM's) override the command
    # line's, saying so; a size the command line gave is kept (the load then names it).
    ckpt = tmp_path / "ckpt"
    cli(1, ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--train-iters", "1", *BATCH, "--save", str(ckpt)])  # fmt: skip
    capsys.readouterr()
    given = ["--swiglu", "--hidden-dropout", "0.2", "--num-layers", "3", "--seq-length", "32"]
    config = flags_config(["--load", str(ckpt), *USE, *given])
    assert (config.swiglu, config.hidden_dropout) == (False, 0.1)  # the default it recorded
    assert (config.num_layers, config.seq_length, config.hidden_size) == (3, 32, 32)
    assert config.max_position_embeddings is None  # --seq-length's table, given
    printed = capsys.readouterr().out
    assert "Setting swiglu to False from checkpoint (overriding the command line's --swiglu)\n" in (
        printed
    )
    assert "Setting hidden_dropout to 0.1 from checkpoint (overriding the command line's " in (
        printed
    )
    assert "num_layers" not in printed and "seq_length" not in printed


def test_uneven_stages_and_interleaving_come_with_the_layout_args(tmp_path):
    ckpt = tmp_path / "ckpt"
    run = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
           "--seq-length", "16", "--train-iters", "1", *BATCH]  # fmt: skip
    uneven = ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1"]
    cli(2, [*run, *uneven, "--save", str(ckpt)])
    config = flags_config(["--load", str(ckpt), *USE, *MP])
    assert (config.pp, config.decoder_first_pipeline_num_layers) == (2, 1)
    assert config.decoder_last_pipeline_num_layers is None and config.chunks == 1
    # The command line's split wins over the checkpoint's (resharded on load).
    last = ["--decoder-last-pipeline-num-layers", "1"]
    config = flags_config(["--load", str(ckpt), *USE, *MP, *last])
    assert config.decoder_first_pipeline_num_layers is None
    assert config.decoder_last_pipeline_num_layers == 1
    interleaved = tmp_path / "interleaved"
    per = ["--num-layers-per-virtual-pipeline-stage", "1"]
    cli(2, [*run, "--pipeline-model-parallel-size", "2", *per, "--save", str(interleaved)])
    config = flags_config(["--load", str(interleaved), *USE, *MP])
    assert (config.pp, config.num_layers_per_virtual_pipeline_stage, config.chunks) == (2, 1, 2)
