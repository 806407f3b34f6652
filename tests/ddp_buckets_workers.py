"""Megatron-Core's side of the --ddp-num-buckets tests (megatron-core 0.16.1, one CPU process,
gloo): its DistributedDataParallel over its own one-process GPTModel, with the bucket size
Megatron-LM's get_model gives --ddp-num-buckets N (its training.py of that release:
``num_parameters // N``, ``num_parameters`` the elements of ``model.parameters()``, counted here
on Megatron-Core's model, not megart's)."""

from __future__ import annotations

import megatron_distopt_workers as mdw


def live_buckets_agree(counts: list[int], exact: int) -> list[dict]:
    """megart's GradientBuckets over each test model's Megatron-Core GPTModel's parameters,
    with the bucket size megart gives --ddp-num-buckets N, against the buckets of
    Megatron-Core's DistributedDataParallel (no distributed optimizer, so no padding: elements
    alone decide) with Megatron-LM's size: per model and N, the parameter names of each bucket,
    both ways. Besides ``counts``: the first N whose size rounds down (not evenly) onto the
    end of a parameter in backward's order, where rounding up would not close the bucket there
    (where a model has one); and --ddp-bucket-size exactly the elements of the ``exact``
    parameters backward fills first (a bucket holding exactly the size closes there)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    import megatron_core_workers as mcw
    from megart.models.config import GPTConfig
    from megart.training.grad_sync import GradientBuckets, megatron_bucket_size

    out = []
    for m, model_flags in enumerate(mdw.MODELS):
        cfg = GPTConfig(**model_flags)
        sizes = [p.numel() for p in mcw.megatron_model(cfg).parameters()]
        total, ends = sum(sizes), set()
        for numel in reversed(sizes):  # backward's order
            ends.add(numel + max(ends, default=0))
        edge = next((n for n in range(2, total) if total % n and total // n in ends), None)
        for n in [*counts, edge, None] if edge else [*counts, None]:
            model = mcw.megatron_model(cfg).float()
            names = {p: name for name, p in model.named_parameters()}
            params = list(model.parameters())
            if n is None:
                size = sum(p.numel() for p in params[-exact:])
                elements = megatron_bucket_size(0, 1, bucket_size=size)
            else:
                size = mdw.megatron_lm_size(model, n)
                elements = megatron_bucket_size(sum(p.numel() for p in params), 1, num_buckets=n)
            ours = GradientBuckets(params, None, bucket_elements=elements)
            mine = [[names[p] for p in b.params] for b in ours.buckets]
            ours.remove()
            config = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=size)
            ddp = DistributedDataParallel(model.config, config, model)
            (buffer,) = ddp.buffers
            # Both list a bucket's parameters in the order they fill it (reverse parameter order).
            theirs = [[names[p] for p in b.params_list] for b in buffer.buckets]
            at_edge = edge is not None and n == edge
            out.append(dict(model=m, n=n, ours=mine, theirs=theirs, edge=at_edge))
    return out


def trainer_buckets(kw: dict) -> dict:
    """The parameters' elements in each of megart's gradient buckets, as its Trainer builds
    them for the flags ``kw`` (one rank, nothing trained), and the elements of Megatron-Core's
    GPTModel of the same model (what Megatron-LM divides by N)."""
    import megatron_core_workers as mcw
    import train_workers as tw
    from megart.training.trainer import Trainer

    trainer = Trainer(tw.tiny(**kw))
    theirs = mcw.megatron_model(trainer.model_config)
    return dict(
        buckets=[[p.numel() for p in b.params] for b in trainer.buckets.buckets],
        megatron_parameters=sum(p.nelement() for p in theirs.parameters()),
    )
