import tempfile
import warnings

import numpy as np
import torch
from transformers import BertConfig, BertForSequenceClassification

warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' own deprecations
checkpoint = tempfile.mkdtemp()  # stands in for a downloaded checkpoint folder
torch.manual_seed(0)
BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, max_position_embeddings=16)).save_pretrained(checkpoint)
rng = np.random.default_rng(0)
input_ids = rng.integers(5, 100, size=(96, 16))
labels = rng.integers(0, 2, size=96)
input_ids[labels == 1, 3] = 4  # token 4 marks the positive rows
attention_mask = np.ones_like(input_ids)

# --8<-- [start:lora]
# --8<-- [start:lora_core]
import optuna
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForSequenceClassification

from cerebro_automl import PartitionedDataset, TrainingSpec, accuracy
from cerebro_automl.adapters.optuna import optimize

# tokenized text: (rows, tokens) arrays, one label per row
data = PartitionedDataset.from_arrays({"input_ids": input_ids, "attention_mask": attention_mask}, labels,
                                      num_partitions=2, valid_fraction=0.25)


def space(trial):
    return {"r": trial.suggest_categorical("r", [4, 8]), "lr": trial.suggest_float("lr", 1e-4, 1e-2, log=True)}


def model_fn(config):  # as peft users write it; checkpoint: a Hub name or a local folder
    base = AutoModelForSequenceClassification.from_pretrained(checkpoint)
    lora = LoraConfig(r=config["r"], lora_alpha=2 * config["r"], target_modules=["query", "value"],
                      task_type="SEQ_CLS")
    return get_peft_model(base, lora)


spec = TrainingSpec(model_fn=model_fn, optimizer_fn=lambda c, params: torch.optim.AdamW(params, lr=c["lr"]),
                    metrics={"accuracy": accuracy}, batch_size=16)
study = optuna.create_study(direction="maximize", pruner=optuna.pruners.SuccessiveHalvingPruner())
result = optimize(study, spec, data, space, n_trials=4, epochs=2, metric="val_accuracy", executor="local")
result.best_model().save_pretrained("best-lora")  # the tuned PeftModel: writes the adapter
# --8<-- [end:lora_core]
# --8<-- [end:lora]
assert type(result.best_model()).__name__ == "PeftModelForSequenceClassification" and len(study.trials) == 4
assert sorted(p.name for p in __import__("pathlib").Path("best-lora").iterdir())[0] == "README.md"
