"""A class endpoint that builds and trains a small torch model once per replica start.

`enter(snap=True)` does the slow part (import torch, build and fit the model): with
snapshots this runs once, and every later replica starts from its result.

    ember deploy examples/classifier/app.py
    ember call classifier--sentiment/predict '{"text": "what a lovely day"}'
"""

import itertools
import os
from typing import Any

import ember

# A toy labelled set, inline so the example needs no download. 1 = positive.
EXAMPLES = [
    ("what a lovely day", 1),
    ("i love this, it is great", 1),
    ("wonderful and delightful work", 1),
    ("this is excellent, thank you", 1),
    ("a happy and fantastic result", 1),
    ("great job, really nice", 1),
    ("i like it a lot", 1),
    ("superb, brilliant, amazing", 1),
    ("what a terrible day", 0),
    ("i hate this, it is awful", 0),
    ("horrible and disappointing work", 0),
    ("this is bad, very poor", 0),
    ("a sad and dreadful result", 0),
    ("awful job, really ugly", 0),
    ("i dislike it a lot", 0),
    ("worst, broken, useless", 0),
]
BUCKETS = 512


def featurize(text: str) -> list[int]:
    """Hash words and word pairs into buckets: enough signal for a toy sentiment model."""
    words = text.lower().replace(",", " ").replace(".", " ").split()
    grams = words + [f"{a} {b}" for a, b in itertools.pairwise(words)]
    return [sum(map(ord, g)) * 2654435761 % BUCKETS for g in grams] or [0]


@ember.endpoint(name="sentiment", max_replicas=2, concurrency=4, scaledown_window=60)
class Sentiment:
    @ember.enter(snap=True)
    def load(self) -> None:
        import torch

        self.torch = torch
        torch.manual_seed(0)
        self.model = torch.nn.EmbeddingBag(BUCKETS, 2, mode="mean")
        optimizer = torch.optim.Adam(self.model.parameters(), lr=0.1)
        for _ in range(100):
            for text, label in EXAMPLES:
                logits = self.model(torch.tensor([featurize(text)]))
                loss = torch.nn.functional.cross_entropy(logits, torch.tensor([label]))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        self.model.eval()
        print(f"model ready: final loss {loss.item():.4f}")

    @ember.enter()
    def ready(self) -> None:
        # Runs after every start (and, with snapshots, every restore).
        self.torch.manual_seed(int.from_bytes(os.urandom(4), "little"))

    @ember.method
    def predict(self, text: str) -> dict[str, Any]:
        with self.torch.no_grad():
            logits = self.model(self.torch.tensor([featurize(text)]))
            probabilities = self.torch.softmax(logits, dim=-1)[0].tolist()
        label = "positive" if probabilities[1] >= probabilities[0] else "negative"
        return {"label": label, "positive": round(probabilities[1], 4)}

    @ember.method
    def predict_many(self, texts: list[str]) -> list[dict[str, Any]]:
        return [self.predict(text) for text in texts]

    @ember.health_check(period=30, timeout=5)
    def still_predicts(self) -> None:
        # A replica whose model stops answering sensibly is replaced (three failures in a
        # row), instead of answering every caller with nonsense or an error.
        if self.predict("what a lovely day")["label"] != "positive":
            raise RuntimeError("the model no longer tells a lovely day from a terrible one")

    @ember.exit
    def close(self) -> None:
        print("classifier replica shutting down")
