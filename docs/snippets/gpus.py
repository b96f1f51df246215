from tiny import data, mlp

# --8<-- [start:gpus]
import torch

from cerebro_automl import Session, TrainingSpec

# Mixed precision, as Lightning's Trainer(precision=...); "16-mixed" adds a GradScaler
# whose state hops with the optimizer's.
spec = TrainingSpec(model_fn=mlp, optimizer_fn=lambda c, p: torch.optim.Adam(p, lr=c["lr"]),
                    loss_fn=torch.nn.functional.cross_entropy, batch_size=16,
                    precision="bf16-mixed")     # device="auto" (the default): the worker's GPU

if __name__ == "__main__" and torch.cuda.is_available():  # the guard: see LocalCluster
    # One machine, one or several GPUs: one worker process per GPU, each seeing only its own
    # GPU (CUDA_VISIBLE_DEVICES); small models leave a GPU idle between kernel launches,
    # so run several workers per GPU.
    with Session(spec, data, workers_per_gpu=4) as s:
        s.add({"lr": 1e-3, "width": 32}, epochs=1)
        s.run()
# --8<-- [end:gpus]
