"""The README's "Use your own model" examples, kept runnable: the two functions' bodies are what README quotes."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from api_toys import interactions
from torch import nn
from torch.utils.data import DataLoader
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor


def torchrec_example(dataset):
    import widedp

    class Recommender(nn.Module):  # your model: a torchrec EBC + an MLP
        def __init__(self):
            super().__init__()
            self.ebc = EmbeddingBagCollection(tables=[
                EmbeddingBagConfig(name=f, embedding_dim=8, num_embeddings=n, feature_names=[f])
                for f, n in [("user", 7), ("item", 9), ("tags", 5)]])
            self.mlp = nn.Sequential(nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 1))

        def forward(self, kjt):
            return self.mlp(self.ebc(kjt).values()).squeeze(1)

    def collate(rows):  # rows: [{"user": [3], "item": [5], "tags": [1, 1, 4], "label": 1.0}, ...]
        keys = ["user", "item", "tags"]
        kjt = KeyedJaggedTensor.from_lengths_sync(keys, torch.tensor([i for k in keys for r in rows for i in r[k]]),
                                                  torch.tensor([len(r[k]) for k in keys for r in rows]))
        return kjt, torch.tensor([r["label"] for r in rows])

    model = Recommender()
    engine = widedp.PrivacyEngine(selection={"name": "exponential", "k": 8, "epsilon": 0.05, "score_clip": 0.1},
                                  clip1=1.0, clip2=1.0, noise_multiplier=1.0, delta=1e-5)
    model, optimizer, loader = engine.make_private(model, torch.optim.Adam(model.parameters(), lr=0.01),
                                                   DataLoader(dataset, batch_size=16, collate_fn=collate), epochs=2)
    for _ in range(2):  # epochs
        for kjt, labels in loader:  # Poisson batches, q = 16 / len(dataset)
            loss = F.binary_cross_entropy_with_logits(model(kjt), labels, reduction="none")  # [B] per-sample losses
            loss.sum().backward()  # one backward: hooks record per-sample gradients
            optimizer.step()  # the DP step: clip, select rows, noise, update
    print(engine.statement().text)  # (ε=…, δ=1e-05) for adding/removing one training example [PLD accountant]
    return engine


def embedding_bag_example(dataset, run_dir: Path):
    import widedp

    model = nn.Sequential(nn.EmbeddingBag(100, 8, mode="mean"), nn.Linear(8, 2))  # dataset: (ids [L], label) items
    engine = widedp.PrivacyEngine(selection={"name": "exponential", "k": 20, "epsilon": 0.1, "score_clip": 0.05},
                                  clip1=1.0, clip2=1.0, target_epsilon=8.0, delta=1e-5)  # σ calibrated for 2 epochs
    model, optimizer, loader = engine.make_private(model, torch.optim.SGD(model.parameters(), lr=0.5),
                                                   DataLoader(dataset, batch_size=50), epochs=2)

    def per_sample_loss(batch):
        return F.cross_entropy(model(batch[0]), batch[1], reduction="none")  # [B]

    for _ in range(2):  # epochs
        for batch in loader:
            engine.step(batch, per_sample_loss)  # forward + backward + DP step
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "engine": engine.state_dict()}, run_dir / "checkpoint.pt")  # no secrets in here
        engine.save_private(run_dir)  # the secret seeds -> run_dir/private/ (0700): never share it
    print(engine.statement().text)
    return engine


def test_torchrec_example_runs(capsys):
    torch.manual_seed(0)
    data = [{k: it[k] for k in ("user", "item", "tags", "label")} for it in interactions(160)]
    engine = torchrec_example(data)
    assert engine.steps == 20 and "training example [PLD accountant]" in capsys.readouterr().out


def test_embedding_bag_example_runs(tmp_path, capsys):
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (500, 1))
    engine = embedding_bag_example(list(zip(ids, (ids[:, 0] < 50).long())), tmp_path)
    assert engine.steps == 20 and engine.epsilon() <= 8.0
    assert (tmp_path / "private" / "seeds.json").is_file() and (tmp_path / "checkpoint.pt").is_file()
    assert "(ε=" in capsys.readouterr().out
