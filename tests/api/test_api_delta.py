"""``PrivacyEngine``'s δ against the dataset's size n (as ``dp.delta`` against N in a config)."""

from __future__ import annotations

import pytest
import torch

from widedp import PrivacyEngine
from widedp.errors import ConfigError


def test_a_delta_at_or_above_one_over_n_is_refused_unless_allowed():
    """δ ≥ 1/n is met by publishing each item in the clear with probability δ: make_private refuses it in one line
    naming n and the opt-out; ``allow_large_delta=True`` accepts it."""
    data = [(torch.tensor([i % 7]), 0) for i in range(100_000)]
    model = torch.nn.EmbeddingBag(7, 2)
    kw = dict(selection="all", clip1=1.0, noise_multiplier=1.0, delta=1e-5)
    loader = torch.utils.data.DataLoader(data, batch_size=100)
    with pytest.raises(ConfigError, match=r"delta=1e-05 is not below 1/n = 1e-05 for n = 100,000 .*allow_large_delta"):
        PrivacyEngine(**kw).make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, epochs=1)
    engine = PrivacyEngine(**kw, allow_large_delta=True)
    engine.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, epochs=1)
    assert engine.sampling_rate == 100 / 100_000
    engine.remove_hooks()
    small = PrivacyEngine(**{**kw, "delta": 1e-6})
    small.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, epochs=1)
