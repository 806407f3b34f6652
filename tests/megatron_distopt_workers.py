"""Megatron-Core's side of the distributed-optimizer checkpoint tests (megatron-core 0.16.1,
CPU, gloo; one launched process per rank of tensor x pipeline x data parallelism): its own
DistributedDataParallel and DistributedOptimizer, built as Megatron-LM builds them (under
interleaving a GPTModel and a DistributedDataParallel per model chunk, one optimizer over all;
with --fp16 a DynamicGradScaler), read megart's ``distrib_optim.pt`` with their own
``load_parameter_state`` and write theirs with ``save_parameter_state``.

Stubbed, as the other Megatron-Core workers do, only what needs CUDA: ``torch.cuda
.current_device`` (the CPU), the optimizer's type-name checks (``torch.cuda.FloatTensor``), its
and the grad scaler's CUDA scalars, and the grad scaler's move of a loaded scale to the CUDA
device (``Tensor.cuda``: the tensor stays on the CPU). One more: with torch's Adam (no Apex or
Transformer Engine, as on this CPU) each parameter's optimizer state holds ``step`` besides the
moments, and Megatron-Core's ``_set_main_param_and_optimizer_states`` copies every key of that
state from what it read, which has no ``step`` (Apex's and Transformer Engine's FusedAdam keep
no per-parameter step): the step it already holds (from the file's param groups) is kept.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

FILE = "model_optim_rng.pt"
DISTRIB = "distrib_optim.pt"


@contextlib.contextmanager
def _step_kept():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    real = DistributedOptimizer._set_main_param_and_optimizer_states

    def keeping_step(self, model_param, tensors):
        group, order = self.model_param_group_index_map[model_param]
        main = self.optimizer.param_groups[group]["params"][order]
        real(self, model_param, {**tensors, "step": self.optimizer.state[main]["step"]})

    DistributedOptimizer._set_main_param_and_optimizer_states = keeping_step
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = real


def _ddp(model, args: dict[str, Any], bucket_size: int | None = None, chunk: int = 0):
    """Megatron-LM's get_model wrapping: DistributedDataParallel with the run's flags, one per
    model chunk (bucketing off on chunks after the first)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    # Megatron-LM's arguments.py: bf16 accumulates and reduces in fp32 unless
    # --grad-reduce-in-bf16.
    bf16 = bool(args.get("bf16")) and not args.get("grad_reduce_in_bf16")
    config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        overlap_grad_reduce=bool(args.get("overlap_grad_reduce")),
        grad_reduce_in_fp32=bf16 or bool(args.get("accumulate_allreduce_grads_in_fp32")),
        bucket_size=bucket_size,
    )
    return DistributedDataParallel(model.config, config, model, disable_bucketing=chunk > 0)


def _distributed_optimizer(ddps: list, kw: dict, args: dict[str, Any]):
    """Megatron-Core's DistributedOptimizer over torch's AdamW and its own param groups, as
    get_megatron_optimizer builds it: over every model chunk's DistributedDataParallel (its
    buffers under the chunk's number) and, with --fp16, a DynamicGradScaler of the run's loss
    scale flags."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import _get_param_groups
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

    import megatron_optim_workers as mow
    import train_workers as tw

    c = tw.tiny(**kw)
    config = mow._optimizer_config(c)
    config.use_distributed_optimizer = True
    config.bf16, config.fp16 = bool(args.get("bf16")), bool(args.get("fp16"))
    adamw = torch.optim.AdamW(_get_param_groups(ddps, config, None), lr=config.lr)
    with mow._cuda_named():
        scaler = None
        if config.fp16 and c.loss_scale:  # Megatron-Core's choice: a static --loss-scale
            scaler = ConstantGradScaler(c.loss_scale)
        elif config.fp16:
            scaler = DynamicGradScaler(
                initial_scale=c.initial_loss_scale, min_scale=c.min_loss_scale,
                growth_factor=2.0, backoff_factor=0.5, growth_interval=c.loss_scale_window,
                hysteresis=c.hysteresis,  # the run's --hysteresis
            )  # fmt: skip
        return DistributedOptimizer(
            adamw, config, scaler, None, ddps, {i: ddp.buffers for i, ddp in enumerate(ddps)},
            # Megatron-LM's get_megatron_optimizer: sharded over data x context parallelism.
            ps.get_data_parallel_group(with_context_parallel=True),
            ps.get_data_parallel_group_gloo(with_context_parallel=True),
            ps.get_model_parallel_group().rank(), 0,
        )  # fmt: skip


def _expected(ref_file: Path) -> tuple[dict[tuple[int, str], dict[str, torch.Tensor]], Any]:
    """From megart's own checkpoint file of the same rank: each parameter's weight and Adam
    moments under (model chunk, Megatron-Core's name) and its shape, through the weights'
    mapping; and its loss scaler."""
    from megart.training.checkpoint import model_config
    from megart.training.ckpt_files import read_file
    from megart.training.megatron_files import chunk_names_to_megatron

    state = read_file(ref_file)
    cfg = model_config(state)
    out: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key in ("param", "exp_avg", "exp_avg_sq"):
        per_chunk: list[dict[str, torch.Tensor]] = [{} for _ in state["model"]]
        for i, (c, name) in enumerate(state["optimizer_params"]):
            per_chunk[c][name] = (
                state["model"][c][name] if key == "param" else state["optimizer"]["state"][i][key]
            )
        for c, sd in enumerate(per_chunk):
            for name, value in chunk_names_to_megatron(sd, cfg, state["layer_ids"][c]).items():
                out.setdefault((c, name), {})[key] = value
    return out, state["loss_scaler"]


def held_pieces(optimizer, ddps: list) -> dict:
    """Per (model chunk, parameter) of which this data-parallel rank's DistributedOptimizer
    holds a piece: the piece's range in the flattened parameter, its fp32 main copy and Adam
    moments (Megatron-Core's own tensors), and the parameter's size."""
    out = {}
    for i, ddp in enumerate(ddps):
        for name, param in ddp.module.named_parameters():
            if param in optimizer.model_param_group_index_map:
                r = optimizer._get_model_param_range_map(param)["param"]
                held = optimizer._get_main_param_and_optimizer_states(param)
                out[i, name] = (r, held, param.numel())
    return out


def load_and_write(kw: dict, megart_dir: str, ref_dir: str, out_dir: str | None) -> dict:
    """On each rank: Megatron-Core's GPTModel of each of its model chunks (one under 1F1B, one
    per virtual stage under interleaving, in the run's precision) loads its chunk of its rank's
    model_optim_rng.pt of megart's checkpoint strictly, a DistributedDataParallel per chunk and
    one DistributedOptimizer over them are built, load the file's optimizer entry
    (load_state_dict, the grad scaler's state with --fp16) and distrib_optim.pt
    (load_parameter_state, scattered from data-parallel rank 0). Returns, per (model chunk,
    parameter) this rank's optimizer holds a piece of, the piece's range and the largest
    difference of its fp32 main copy and moments from megart's own checkpoint of the same run
    (``ref_dir``), and the grad scaler's state beside megart's loss scaler there. With
    ``out_dir``, writes Megatron-LM's legacy checkpoint from what it holds there (as its
    save_checkpoint does: data-parallel rank 0 the rank file, save_parameter_state)."""
    from megatron.core import parallel_state as ps

    import megatron_core_workers as mcw
    import megatron_optim_workers as mow
    import train_workers as tw
    from megart.training.checkpoint import latest_iteration, rank_dir
    from megart.training.megatron_args import config_from_args
    from megart.training.megatron_files import model_chunks

    c = tw.tiny(**kw)
    tp, pp = c.tp, c.pp
    per = c.num_layers_per_virtual_pipeline_stage
    vp = c.num_layers // (pp * per) if per else None
    mow._init(tp, pp, vp, c.context_parallel_size)
    t, p = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    # The optimizer's shards (and so the pieces) run over data x context parallelism.
    d = ps.get_data_parallel_rank(with_context_parallel=True)
    dp = ps.get_data_parallel_world_size()
    iteration = latest_iteration(megart_dir)
    here = Path(f"iter_{iteration:07d}") / rank_dir(t, p, pp)
    state = torch.load(Path(megart_dir) / here / FILE, weights_only=False)
    args = vars(state["args"])
    cfg = config_from_args(args)
    dtype = torch.bfloat16 if args.get("bf16") else torch.float16 if args.get("fp16") else None
    models = []
    for i, saved in enumerate(model_chunks(state)):
        model = mcw.megatron_model(cfg, tp, pp, i if vp else None).to(dtype or torch.float32)
        model.load_state_dict(saved, strict=True)
        models.append(model)
    # Megatron-LM's get_model (training.py of megatron-core 0.16.1's release): with
    # --ddp-num-buckets, the bucket size is the rank's parameters over all its chunks // N.
    size = args.get("ddp_bucket_size")
    if args.get("ddp_num_buckets"):
        num_parameters = sum(p.nelement() for m in models for p in m.parameters())
        size = num_parameters // args["ddp_num_buckets"]
    ddps = [_ddp(model, args, size, chunk=i) for i, model in enumerate(models)]
    optimizer = _distributed_optimizer(ddps, kw, args)
    with mcw.cuda_stays_on_cpu():  # the grad scaler moves its scale to the CUDA device
        optimizer.load_state_dict(state["optimizer"])
    with torch.no_grad(), _step_kept():
        optimizer.load_parameter_state(str(Path(megart_dir) / here / DISTRIB))
    want, loss_scaler = _expected(Path(ref_dir) / here / FILE)
    pieces = {}
    for (i, name), (r, held, numel) in held_pieces(optimizer, ddps).items():
        diffs = {}
        for key in ("param", "exp_avg", "exp_avg_sq"):
            ref = want[i, name][key].float().reshape(-1)[r.start : r.end]
            scale = want[i, name][key].float().abs().max().item() or 1.0
            diffs[key] = (held[key].float() - ref).abs().max().item() / scale
        pieces[i, name] = dict(range=(r.start, r.end), numel=numel, diffs=diffs)
    scaler = optimizer.grad_scaler.state_dict() if optimizer.grad_scaler else None
    if out_dir is not None:
        written = mow._args(cfg, c, tp, iteration, pp)
        written.use_distributed_optimizer = True
        written.data_parallel_size = dp  # Megatron-LM's: without context parallelism
        written.context_parallel_size = c.context_parallel_size
        written.overlap_grad_reduce = bool(args.get("overlap_grad_reduce"))
        written.bf16, written.fp16 = bool(args.get("bf16")), bool(args.get("fp16"))
        written.virtual_pipeline_model_parallel_size = vp
        written.num_layers_per_virtual_pipeline_stage = per
        if d == 0:
            mow._write(out_dir, str(Path(rank_dir(t, p, pp)) / FILE), written, ddps, optimizer, c)
        torch.distributed.barrier()
        optimizer.save_parameter_state(str(Path(out_dir) / here / DISTRIB))
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return dict(
        place=(t, p, d),
        pieces=pieces,
        chunks=len(ddps),
        buckets=[tuple(b.numel_unpadded for b in ddp.buffers[0].buckets) for ddp in ddps],
        # The file's grad_scaler entry, and the state_dict() of the scaler Megatron-Core built.
        file_scaler=state["optimizer"].get("grad_scaler"),
        scaler_kind=type(optimizer.grad_scaler).__name__,
        scaler_state=scaler,
        scaler=None
        if not scaler  # None, or a ConstantGradScaler's {}
        else (float(scaler["scale"]), scaler["growth_tracker"], scaler["hysteresis_tracker"]),
        loss_scaler=None
        if loss_scaler is None
        else (
            float(loss_scaler["scale"]),
            int(loss_scaler["good_steps"]),
            int(loss_scaler["hysteresis_tracker"]),
        ),
    )


MODELS = [
    dict(vocab_size=100, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4),
    dict(vocab_size=300, seq_length=16, hidden_size=32, num_layers=3, num_attention_heads=4,
         ffn_hidden_size=40, normalization="rmsnorm", position_embedding="rotary",
         activation="swiglu", untie_embeddings_and_output_weights=True, num_query_groups=2),
]  # fmt: skip


def _megatron_core_layout(cfg, args: dict, tied_copy: bool) -> tuple[dict, int, tuple]:
    """Where Megatron-Core's DistributedDataParallel puts each parameter of a one-process
    GPTModel in the saved vector (its buffer's buckets without their end padding, one after
    another, as get_parameter_state_dp_zero saves them), the vector's length, each bucket's
    part of it."""
    import megatron_core_workers as mcw

    model = mcw.megatron_model(cfg).float()
    if tied_copy:  # as Megatron-Core's LanguageModule marks a first stage's tied embedding
        model.embedding.word_embeddings.weight.shared_embedding = True
    ddp = _ddp(model, args, args.get("ddp_bucket_size"))
    (buffer,) = ddp.buffers
    names = {param: n for n, param in ddp.module.named_parameters()}
    before, at = [], 0
    for bucket in buffer.buckets:
        before.append(at)
        at += bucket.numel_unpadded
    ranges = {}
    for param, (start, end, b) in buffer.param_index_map.items():
        offset = before[b] - buffer.buckets[b].offset
        ranges[names[param]] = (start + offset, end + offset)
    return ranges, buffer.numel_unpadded, tuple(b.numel_unpadded for b in buffer.buckets)


def megatron_lm_size(model, num_buckets: int) -> int:
    """The bucket size Megatron-LM's get_model gives --ddp-num-buckets N (its training.py of
    megatron-core 0.16.1's release): the elements of ``model.parameters()`` (a Megatron-Core
    model: counted on Megatron's side, not megart's) // N."""
    return sum(p.nelement() for p in model.parameters()) // num_buckets


def layouts_agree(examples: int, by_count: bool = False) -> dict:
    """One process, hypothesis over models, bucket sizes (with ``by_count``, numbers of buckets:
    --ddp-num-buckets, Megatron-Core given Megatron-LM's size for it), --overlap-grad-reduce and
    a tied embedding copy: megart's layout of the chunk it writes (megart.training
    .megatron_files' names and order) equals Megatron-Core's, bucket by bucket (raises with the
    example where it does not). Returns the examples run and the most buckets one had."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    import megatron_core_workers as mcw
    from megart.models import GPT
    from megart.models.config import GPTConfig
    from megart.training.megatron_distrib_optim import layouts
    from megart.training.megatron_files import chunk_to_megatron

    seen = {"examples": 0, "most_buckets": 0}
    limits = st.integers(1, 64) if by_count else st.one_of(st.none(), st.integers(1, 40_000))

    @settings(max_examples=examples, deadline=None, database=None)
    @given(
        model=st.sampled_from(MODELS),
        limit=limits,
        overlap=st.booleans(),
        tied_copy=st.booleans(),
    )
    def check(model, limit, overlap, tied_copy):
        cfg = GPTConfig(**model)
        tied_copy = tied_copy and not cfg.untie_embeddings_and_output_weights
        args = dict(
            overlap_grad_reduce=overlap,
            data_parallel_size=1,
            pipeline_model_parallel_size=2 if tied_copy else 1,
            untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights,
        )
        size = limit
        if by_count:
            size = megatron_lm_size(mcw.megatron_model(cfg), limit)
        chunk = chunk_to_megatron(GPT(cfg).state_dict(), cfg, list(range(cfg.num_layers)))
        flag = "ddp_num_buckets" if by_count else "ddp_bucket_size"
        (ours,) = layouts([chunk], {**args, flag: limit}, 0)
        ranges, numel, buckets = _megatron_core_layout(
            cfg, {**args, "ddp_bucket_size": size}, tied_copy
        )
        assert ours.ranges == ranges, (limit, ours.ranges, ranges)
        assert ours.numel == numel, (limit, ours.numel, numel)
        assert ours.buckets == buckets, (limit, ours.buckets, buckets)
        seen["examples"] += 1
        seen["most_buckets"] = max(seen["most_buckets"], len(buckets))

    check()
    return seen


def buffer_dtypes(runs: list[dict]) -> list[list[tuple]]:
    """Per run's flags (bf16, fp16, --grad-reduce-in-bf16, ...): the (parameter dtype,
    gradient dtype) of each buffer Megatron-Core's DistributedDataParallel builds for a
    one-process GPTModel in that precision, the key of distrib_optim.pt's vectors."""
    import megatron_core_workers as mcw
    from megart.models.config import GPTConfig

    out = []
    for args in runs:
        dtype = torch.bfloat16 if args.get("bf16") else torch.float16 if args.get("fp16") else None
        model = mcw.megatron_model(GPTConfig(**MODELS[0]))
        ddp = _ddp(model.to(dtype) if dtype else model.float(), args)
        out.append([(b.param_dtype, b.grad_dtype) for b in ddp.buffers])
    return out
