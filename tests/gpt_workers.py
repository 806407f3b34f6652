"""GPT on every rank of a tensor-parallel group, compared with the same model in one process."""

from __future__ import annotations

import torch

import megart.distributed as dist
from megart.models import GPT, GPTConfig
from megart.models.hf import _gather
from megart.tensor_parallel import sync_sequence_parallel_grads

# Every fused op of megart.kernels on (GPTConfig fields, the `megart train` flags' names).
FUSION_FLAGS = {
    "bias_gelu_fusion": True,
    "fused_layer_norm": True,
    "cross_entropy_loss_fusion": True,
}


def small_config(**kw: object) -> GPTConfig:
    base = dict(vocab_size=300, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4)
    return GPTConfig(**{**base, **kw})


def tokens(batch: int = 3, seq: int = 16, vocab: int = 300) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(5))


def loss_and_grads(tp_group: dist.ProcessGroup | None, sp: bool, cfg_kw: dict):
    """The loss and every parameter's full gradient (gathered over tensor parallelism)."""
    torch.manual_seed(0)
    model = GPT(small_config(**cfg_kw), tp_group=tp_group, sequence_parallel=sp)
    x = tokens()
    loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    sync_sequence_parallel_grads(model, tp_group)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.detach()
        shard = torch.nn.Parameter(g)
        if hasattr(p, "partition_dim"):
            shard.partition_dim = p.partition_dim
        full = _gather(shard, tp_group)
        if name == "chunk.wte.weight":
            full = full[:300]  # padding depends on t; real rows must agree
        grads[name] = full
    return loss.item(), grads


def tp_run(sp: bool, cfg_kw: dict):
    dist.init(timeout=120)
    return loss_and_grads(dist.new_group(), sp, cfg_kw)


def hf_logits(path: str, x: torch.Tensor) -> torch.Tensor:
    import megart

    grid = megart.initialize(tp=dist_world_size())
    model = GPT.from_hf(path, grid=grid).eval()
    with torch.no_grad():
        return model(x)


def dist_world_size() -> int:
    import os

    return int(os.environ["WORLD_SIZE"])


def hf_export(src: str, dst: str) -> int:
    dist.init(timeout=120)
    GPT.from_hf(src, tp_group=dist.new_group()).save_hf(dst)
    return dist.get_rank()
