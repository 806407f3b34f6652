"""Megatron-Core's side of tests/test_moe_ep_megatron_distopt.py (megatron-core 0.16.1, CPU,
gloo; one launched process per rank of expert-parallel 2 x data-parallel 4): its own MoE
GPTModel, one DistributedDataParallel (dense and expert buffers) and, as get_megatron_optimizer
builds them under expert parallelism, a ChainedOptimizer of two DistributedOptimizers (the dense
parameters' over data parallelism, the experts' over the expert-data-parallel group) load each
rank's legacy files (model_optim_rng.pt's optimizer list, distrib_optim.pt with
load_parameter_state) and write their own (save_parameter_state from every rank, as
Megatron-LM's save_checkpoint calls it). The CUDA stubs are tests/megatron_distopt_workers.py's.
"""

from __future__ import annotations

from pathlib import Path

import torch

EP = 2
FILE = "model_optim_rng.pt"
DISTRIB = "distrib_optim.pt"


def _expected(ref_file: Path, e: int) -> dict:
    """From megart's own checkpoint file of expert-parallel rank ``e``: each parameter's weight
    and Adam moments under Megatron-Core's name (experts numbered locally)."""
    from megart.training import megatron_expert_files as experts
    from megart.training.checkpoint import model_config
    from megart.training.ckpt_files import read_file
    from megart.training.megatron_files import chunk_names_to_megatron

    state = read_file(ref_file)
    cfg = model_config(state)
    state = experts.shifted(state, -experts.first_expert(e, EP, cfg.num_experts))
    out: dict = {}
    for key in ("param", "exp_avg", "exp_avg_sq"):
        sd = {}
        for i, (c, name) in enumerate(state["optimizer_params"]):
            sd[name] = (
                state["model"][c][name] if key == "param" else state["optimizer"]["state"][i][key]
            )
        for name, value in chunk_names_to_megatron(sd, cfg, state["layer_ids"][0]).items():
            out.setdefault(name, {})[key] = value
    return out


def _chained(model, kw: dict, args: dict):
    """Megatron-Core's DistributedDataParallel over ``model`` and its ChainedOptimizer of two
    DistributedOptimizers (dense first, then the experts', each over its own group)."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import _get_param_groups
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    import megatron_distopt_workers as mdw
    import megatron_optim_workers as mow
    import train_workers as tw

    ddp = mdw._ddp(model, args, args.get("ddp_bucket_size"))
    config = mow._optimizer_config(tw.tiny(**kw))
    config.use_distributed_optimizer = True
    config.bf16 = bool(args.get("bf16"))  # the fp32 main copies of the 16-bit weights
    groups = _get_param_groups([ddp], config, None)
    parts = []
    for experts in (False, True):
        mine = [g for g in groups if g["is_expert_parallel"] == experts]
        adamw = torch.optim.AdamW(mine, lr=config.lr)
        # get_megatron_optimizer's groups and numbers (the one optimizer instance: id 0).
        if experts:
            buffers = ddp.expert_parallel_buffers
            group, gloo = (
                ps.get_expert_data_parallel_group(),
                ps.get_expert_data_parallel_group_gloo(),
            )
            idx = ps.get_expert_tensor_model_pipeline_parallel_group().rank()
        else:
            buffers = ddp.buffers
            group = ps.get_data_parallel_group(with_context_parallel=True)
            gloo = ps.get_data_parallel_group_gloo(with_context_parallel=True)
            idx = ps.get_model_parallel_group().rank()
        with mow._cuda_named():
            parts.append(DistributedOptimizer(adamw, config, None, None, [ddp], {0: buffers},
                                              group, gloo, idx, 0))  # fmt: skip
    return ddp, ChainedOptimizer(parts)


def _compared(optimizer, ddp, want: dict) -> dict:
    """Per parameter the chain's optimizers hold a piece of: its range, the parameter's size
    and whether the piece's fp32 main copy and moments are ``want``'s bitwise."""
    import megatron_distopt_workers as mdw

    pieces = {}
    for part in optimizer.chained_optimizers:
        for (_, name), (r, held, numel) in mdw.held_pieces(part, [ddp]).items():
            same = {
                key: torch.equal(held[key], want[name][key].reshape(-1)[r.start : r.end])
                for key in ("param", "exp_avg", "exp_avg_sq")
            }
            pieces[name] = dict(range=(r.start, r.end), numel=numel, same=same)
    return pieces


def load_and_write(kw: dict, stores: list[str], ref_dir: str, out_dir: str) -> list[dict]:
    """On each rank, for each checkpoint in ``stores`` (iteration 2): Megatron-Core's model
    loads its rank folder's model strictly, its chained optimizer the file's optimizer list
    (load_state_dict) and distrib_optim.pt (load_parameter_state). Per store: the error it
    raised, or per parameter this rank's optimizers hold a piece of, the piece's range and
    whether its fp32 main copy and moments equal megart's own checkpoint of the run
    (``ref_dir``) bitwise. After the first store it writes Megatron-LM's legacy checkpoint into
    ``out_dir``: the rank file where data-parallel or expert-data-parallel rank 0, and
    save_parameter_state on every rank."""
    from megatron.core import parallel_state as ps

    import megatron_core_workers as mcw
    import megatron_distopt_workers as mdw
    import megatron_optim_workers as mow
    import train_workers as tw
    from megart.training.megatron_args import config_from_args
    from megatron_ep_start import megatron_ep

    tp = kw.get("tensor_model_parallel_size", 1)
    pp = kw.get("pipeline_model_parallel_size", 1)
    results = []
    with megatron_ep(tp, pp, EP) as folder:
        e, p = ps.get_expert_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        here = Path("iter_0000002") / folder
        want = _expected(Path(ref_dir) / here / FILE, e)
        for n, store in enumerate(stores):
            state = torch.load(Path(store) / here / FILE, weights_only=False)
            args = vars(state["args"])
            dtype = torch.bfloat16 if args.get("bf16") else torch.float32
            sp = bool(args.get("sequence_parallel"))
            model = mcw.megatron_model(config_from_args(args), tp, pp, ep=EP, sequence_parallel=sp)
            model = model.to(dtype)
            model.load_state_dict(state["model"], strict=True)
            ddp, optimizer = _chained(model, kw, args)
            try:
                optimizer.load_state_dict(state["optimizer"])
                with torch.no_grad(), mdw._step_kept():
                    optimizer.load_parameter_state(str(Path(store) / here / DISTRIB))
            except Exception as error:  # noqa: BLE001 - the test reads which mistake raised what
                results.append(dict(error=f"{type(error).__name__}: {error}", stage=p))
            else:
                results.append(dict(pieces=_compared(optimizer, ddp, want), rank=e, stage=p))
            if n == 0:  # every rank meets the barriers: one stage's error is the test's to read
                loaded = "error" not in results[-1]
                dp0 = ps.get_data_parallel_rank(with_context_parallel=True) == 0
                if loaded and (dp0 or ps.get_expert_data_parallel_rank() == 0):
                    mow._write(out_dir, f"{folder}/{FILE}", state["args"], model, optimizer,
                               tw.tiny(**kw))  # fmt: skip
                torch.distributed.barrier()
                if loaded:
                    optimizer.save_parameter_state(str(Path(out_dir) / here / DISTRIB))
                torch.distributed.barrier()
    return results


def assert_same_vectors(ours: Path, theirs: Path) -> None:
    """Two distrib_optim.pt files of the chain (or of one optimizer) hold the same buffers'
    vectors bitwise, None where the other's is None."""
    from megart.training.megatron_files import torch_load

    mine, its = torch_load(ours), torch_load(theirs)
    assert isinstance(mine, list) == isinstance(its, list), (ours, theirs)
    pairs = zip(mine, its, strict=True) if isinstance(mine, list) else [(mine, its)]
    for a, b in pairs:
        assert (a is None) == (b is None), (ours, theirs)
        if a is None:
            continue
        assert sorted(a, key=str) == sorted(b, key=str)
        for buffer in (k for k in a if isinstance(k, int)):
            (key,) = a[buffer]
            assert list(b[buffer]) == [key]
            for name, value in a[buffer][key].items():
                other = b[buffer][key][name]
                assert torch.equal(value, other) if torch.is_tensor(value) else value == other
