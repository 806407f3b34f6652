"""The tensor-parallel mappings: each forward and its backward pair, on real processes."""

import torch

import megart.tensor_parallel as tp
import tp_workers as w
from megart.launcher import launch

ONE_PROCESS = [
    tp.copy_to_region,
    tp.reduce_from_region,
    tp.scatter_to_region,
    tp.gather_from_region,
    tp.scatter_to_sequence_region,
    tp.gather_from_sequence_region,
    tp.reduce_scatter_to_sequence_region,
]


def test_every_mapping_and_its_backward_for_tp_1_2_4():
    # Groups None, 1, 2 and 4 on 4 ranks; dims 0 and 1 for the sequence-parallel ones.
    checks = launch(w.mappings, 4, 11, timeout=120)
    assert checks == [4 * 14] * 4


def test_without_a_group_every_mapping_is_the_identity():
    # None is "no tensor parallelism": no init, no communication, no autograd node.
    x = torch.randn(4, 3, 8, requires_grad=True)
    for mapping in ONE_PROCESS:
        assert mapping(x, None) is x
