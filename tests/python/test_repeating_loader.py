"""zcore.utils.RepeatingLoader, as deepspeed.utils.RepeatingLoader: a loader
iterated again and again, each pass in the loader's own order."""

import pytest
import torch

from zcore.utils import RepeatingLoader


def test_it_starts_the_loader_afresh_whenever_it_ends():
    data = torch.utils.data.TensorDataset(torch.arange(5.0))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    repeating = RepeatingLoader(loader)
    got = [batch[0].tolist() for _, batch in zip(range(7), repeating)]
    one_pass = [[0.0, 1.0], [2.0, 3.0], [4.0]]
    assert got == one_pass + one_pass + one_pass[:1]
    assert iter(repeating) is repeating


def test_an_empty_loader_ends_rather_than_spinning():
    with pytest.raises(StopIteration):
        next(RepeatingLoader([]))
