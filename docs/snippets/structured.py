import numpy as np
import torch

from cerebro_automl import PartitionedDataset, Session, TrainingSpec

rng = np.random.default_rng(0)
n = 64
dense = rng.normal(size=(n, 13)).astype("float32")
cat_ids = rng.integers(0, 100, size=(n, 26))
clicks = rng.integers(0, 2, size=n)


# --8<-- [start:dict]
class CriteoNet(torch.nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.embed = torch.nn.EmbeddingBag(100, width)
        self.head = torch.nn.Linear(13 + width, 2)

    def forward(self, dense, cat):            # dense float32 [n, 13], cat int64 [n, 26]
        return self.head(torch.cat([dense, self.embed(cat)], dim=1))

data = PartitionedDataset.from_arrays({"dense": dense, "cat": cat_ids}, clicks, num_partitions=2,
                                      valid_fraction=0.25, shuffle_seed=0)
spec = TrainingSpec(model_fn=lambda c: CriteoNet(), optimizer_fn=lambda c, p: torch.optim.Adam(p, lr=c["lr"]),
                    loss_fn=torch.nn.functional.cross_entropy,
                    batch_size=16)            # the batch is {"dense": ..., "cat": ...} -> model(**x)
# --8<-- [end:dict]
with Session(spec, data, executor="local") as s:
    s.add({"lr": 1e-2}, epochs=1)
    s.run()

X = dense
# --8<-- [start:forward_fn]
autoencoder = TrainingSpec(model_fn=lambda c: torch.nn.Linear(13, 13),
                           optimizer_fn=lambda c, p: torch.optim.SGD(p, lr=0.1),
                           loss_fn=torch.nn.functional.mse_loss, batch_size=16,
                           forward_fn=lambda model, x, y: (model(x), x))    # (outputs, targets)
unlabeled = PartitionedDataset.from_arrays(X, None, num_partitions=2, valid_fraction=0.25)
# a HuggingFace classifier returns a SequenceClassifierOutput: hand the loss its logits
hf_forward = lambda model, x, y: (model(**x).logits, y)
# --8<-- [end:forward_fn]
with Session(autoencoder, unlabeled, executor="local") as s:
    s.add({}, epochs=1)
    s.run()
    assert s.status(0) == "paused"
