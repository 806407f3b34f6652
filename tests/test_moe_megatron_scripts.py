"""Megatron-LM's own MoE example, examples/mixtral/train_mixtral_8x7b_distributed.sh, under
megart train with its flags as written there, MoE flags included (--moe-grouped-gemm,
--moe-token-dispatcher-type alltoall: training.moe_kernels), the sizes shrunk to a few CPU
processes and its data and Llama 2 tokenizer replaced by --mock-data (--bf16 kept): at
tp1 x pp2 x ep2 with the distributed optimizer, and at tp2 x ep2, it follows the one-process
curve (loss, gradient norm, load-balancing loss); the dispatcher's two kinds and the kernel
switches give that curve exactly; Megatron's checkpoint args record them (the flag with
Megatron's formats taken: its files are SequentialMLP's); what megart cannot honour of them is
refused by name."""

import pytest

import train_workers as tw
from megart import ConfigError
from megart.cli.train import FlagParser, add_arguments, config_from_args
from megart.launcher import launch
from megart.training.config import TrainConfig
from megart.training.config_checks import check_config
from megart.training.megatron_files import torch_load

# The script's MODEL_ARGS, MOE_ARGS, TRAINING_ARGS, MODEL_PARALLEL_ARGS and LOGGING_ARGS, each
# flag as written there; sizes, iterations and the batch shrunk (the script's value after #).
MODEL = [
    "--use-mcore-models", "--disable-bias-linear",
    "--seq-length", "32",  # 4096
    "--max-position-embeddings", "64",  # 32768
    "--num-layers", "4",  # 32
    "--hidden-size", "32",  # 4096
    "--ffn-hidden-size", "48",  # 14336
    "--num-attention-heads", "4",  # 32
    "--init-method-std", "0.01", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
    "--untie-embeddings-and-output-weights", "--group-query-attention",
    "--num-query-groups", "2",  # 8
    "--no-masked-softmax-fusion", "--no-position-embedding", "--rotary-base", "1000000",
]  # fmt: skip
MOE = [
    "--num-experts", "4",  # 8
    "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
    "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm", "--moe-token-dispatcher-type",
    "alltoall", "--overlap-param-gather", "--overlap-grad-reduce",
]  # fmt: skip
# --tokenizer-type Llama2Tokenizer --tokenizer-model M --data-path D --split 99990,8,2: megart
# takes no Llama2Tokenizer (the same tokenizer loads as HuggingFaceTokenizer); mock data here.
# (--split 99990,8,2 would leave --mock-data's corpus a test split shorter than a sequence.)
DATA = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
        "--split", "98,1,1"]  # fmt: skip
TRAINING = [
    "--micro-batch-size", "1",
    "--global-batch-size", "8",  # 256
    "--lr", "1e-4",
    "--train-iters", "6",  # 500000
    "--lr-decay-iters", "5",  # 320000
    "--lr-decay-style", "cosine", "--min-lr", "1.0e-5", "--weight-decay", "0.1",
    "--lr-warmup-iters", "2",  # 500
    "--clip-grad", "1.0", "--bf16",
]  # fmt: skip
PARALLEL = [
    "--tensor-model-parallel-size", "1",
    "--pipeline-model-parallel-size", "2",  # 4
    "--expert-model-parallel-size", "2",  # 8
    "--use-distributed-optimizer", "--sequence-parallel",
]  # fmt: skip
LOGGING = ["--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000",
           "--eval-iters", "10", "--no-load-optim", "--no-load-rng"]  # fmt: skip
MIXTRAL = [*MODEL, *MOE, *DATA, *TRAINING, *PARALLEL, *LOGGING]
ONE_PROCESS = {"--pipeline-model-parallel-size": "1", "--expert-model-parallel-size": "1"}
CURVE = dict(rel=1e-5, abs=0)


def parsed(argv: list[str]) -> TrainConfig:
    """megart train's config for ``argv``, as its command line reads it."""
    parser = FlagParser(prog="megart train")
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def replaced(argv: list[str], values: dict[str, str]) -> list[str]:
    """``argv`` with the value after each flag of ``values`` replaced."""
    out = list(argv)
    for flag, value in values.items():
        out[out.index(flag) + 1] = value
    return out


def train_flags(argv: list[str], directory: str) -> list[dict]:
    """One rank's history of megart train ``argv``, saving to and loading from ``directory``
    (the script's --save/--load/--tensorboard-dir)."""
    from megart.training.trainer import Trainer

    paths = ["--save", directory, "--load", directory, "--tensorboard-dir", f"{directory}/tb"]
    return Trainer(parsed([*argv, *paths])).train(quiet=True)


def curve(history: list[dict]) -> list[tuple[float, float, float]]:
    """Each iteration's loss, gradient norm and load-balancing loss: a norm or loss over one
    rank's experts, or their gradients unscaled, would leave it."""
    return [(h["loss"], h["grad_norm"], h["load_balancing_loss"]) for h in history]


def one_process_curve(argv: list[str], directory: str) -> list[tuple[float, float, float]]:
    """``argv``'s curve in one process (one thread: tw.ONE_THREAD says why; and at two the run
    took 40 times as long on a busy 2-core machine)."""
    return curve(launch(train_flags, 1, argv, directory, timeout=300, env=tw.ONE_THREAD)[0])


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The script's flags in one process: its loss curve."""
    return one_process_curve(replaced(MIXTRAL, ONE_PROCESS), str(tmp_path_factory.mktemp("one")))


def test_the_scripts_flags_parse_as_megatron_gives_them():
    cfg = parsed(MIXTRAL)
    assert cfg.moe_token_dispatcher_type == "alltoall" and cfg.moe_grouped_gemm
    assert (cfg.num_experts, cfg.moe_router_topk, cfg.moe_aux_loss_coeff) == (4, 2, 0.01)
    assert (cfg.pp, cfg.expert_model_parallel_size, cfg.use_distributed_optimizer) == (2, 2, True)
    assert not cfg.moe_permute_fusion and not cfg.moe_router_fusion
    assert parsed(MODEL + DATA).moe_token_dispatcher_type == "allgather"  # Megatron's default


# The script's layout shrunk (tp1 x pp2 x ep2, dp2), and tensor parallelism with it (its
# --sequence-parallel then in force): 4 processes each.
LAYOUTS = {
    "tp1-pp2-ep2": {},
    "tp2-pp1-ep2": {"--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "1"},
}
# Relative tolerance of each (--bf16): pp2 x ep2 moves whole activations (seen 1e-9 off);
# tp2 splits the bf16 products and sums their parts (seen 4.4e-5 off, on the grad norm; a bf16
# ulp is 3.9e-3 relative).
TOLERANCE = {"tp1-pp2-ep2": CURVE, "tp2-pp1-ep2": dict(rel=1e-3, abs=0)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_script_follows_the_one_process_curve(tmp_path, one_process, layout):
    ranks = launch(train_flags, 4, replaced(MIXTRAL, LAYOUTS[layout]), str(tmp_path), timeout=600)
    assert len(one_process) == 6
    # The last stage logs the curve.
    for got, want in zip(curve(ranks[-1]), one_process, strict=True):
        assert got == pytest.approx(want, **TOLERANCE[layout])


@pytest.mark.parametrize(
    "change",
    [
        {"--moe-token-dispatcher-type": "allgather"},
        {"--moe-grouped-gemm": "--moe-permute-fusion"},  # the flag swapped for the other
    ],
)
def test_the_dispatchers_and_kernels_give_the_same_curve(tmp_path, one_process, change):
    argv = replaced(MIXTRAL, ONE_PROCESS)
    flag, value = next(iter(change.items()))
    if value.startswith("--"):
        argv[argv.index(flag)] = value
    else:
        argv = replaced(argv, change)
    argv = [*argv, "--moe-router-fusion"]
    assert one_process_curve(argv, str(tmp_path)) == one_process


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--moe-token-dispatcher-type", "flex"],
            "flex: Megatron-Core's flex dispatcher runs DeepEP's",
        ),
    ],
)
def test_what_megart_cannot_honour_is_refused_by_name(tmp_path, argv, message):
    with pytest.raises(ConfigError, match=message):
        check_config(with_paths(argv, tmp_path), 1)


def with_paths(argv: list[str], directory: object) -> TrainConfig:
    """The script's flags in one process with ``argv`` added, saving to and loading from
    ``directory``."""
    paths = ["--save", str(directory), "--load", str(directory)]
    return parsed([*replaced(MIXTRAL, ONE_PROCESS), *paths, *argv])


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_the_flag_is_taken_with_megatrons_formats(tmp_path, fmt):
    """--moe-grouped-gemm with --ckpt-format torch or torch_dist (the script's flag with
    Megatron's formats): the files are SequentialMLP's, as without the flag
    (test_moe_grouped_ckpt)."""
    cfg = with_paths(["--ckpt-format", fmt], tmp_path)
    assert cfg.moe_grouped_gemm and cfg.ckpt_format == fmt
    check_config(cfg, 1)


def test_the_llama2_tokenizer_is_refused_by_name():
    argv = replaced(MIXTRAL, {"--tokenizer-type": "Llama2Tokenizer"})
    with pytest.raises(ConfigError, match="invalid choice: 'Llama2Tokenizer'"):
        parsed(argv)


def test_megatrons_checkpoint_records_the_dispatcher_and_kernels(tmp_path):
    """--ckpt-format torch's args hold the flags as Megatron-LM 0.16's do; its experts are
    SequentialMLP's with --moe-grouped-gemm too (moe_grouped_gemm False: megart's grouped
    experts write SequentialMLP's per-expert weights, as without the flag)."""
    argv = replaced(MIXTRAL, {**ONE_PROCESS, "--train-iters": "1", "--save-interval": "1"})
    assert "--moe-grouped-gemm" in argv
    argv += ["--ckpt-format", "torch", "--moe-permute-fusion", "--moe-router-fusion"]
    launch(train_flags, 1, argv, str(tmp_path), timeout=300, env=tw.ONE_THREAD)
    args = vars(torch_load(tmp_path / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")["args"])
    assert args["moe_token_dispatcher_type"] == "alltoall"
    assert (args["moe_permute_fusion"], args["moe_router_fusion"]) == (True, True)
    assert args["moe_grouped_gemm"] is False
