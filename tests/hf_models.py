"""A HuggingFace + peft LoRA fine-tune as a user writes it, for the tests (sent to Dask
workers by value): a small BERT saved with ``save_pretrained`` into a local folder,
loaded with ``from_pretrained`` inside ``model_fn`` and wrapped by ``get_peft_model``."""

from __future__ import annotations

import sys

import cloudpickle
import numpy as np
import torch

cloudpickle.register_pickle_by_value(sys.modules[__name__])

VOCAB, LENGTH = 200, 16


def save_base(folder: str, hidden: int = 64, layers: int = 2) -> str:
    """A seeded BERT-style classifier saved where ``from_pretrained`` reads it."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                        intermediate_size=2 * hidden, max_position_embeddings=LENGTH, num_labels=2)
    BertForSequenceClassification(config).save_pretrained(folder)
    return folder


def tokens(rows: int, seed: int = 0):
    """Token ids whose label says whether token 7 appears: a task a small model learns."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(10, VOCAB, size=(rows, LENGTH))
    label = rng.integers(0, 2, size=rows)
    ids[label == 1, rng.integers(0, LENGTH)] = 7
    return {"input_ids": ids.astype(np.int64), "attention_mask": np.ones_like(ids)}, label.astype(np.int64)


def lora_model_fn(folder: str):
    def model_fn(config):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForSequenceClassification

        base = AutoModelForSequenceClassification.from_pretrained(folder)
        lora = LoraConfig(r=config["r"], lora_alpha=2 * config["r"], target_modules=["query", "value"],
                          task_type="SEQ_CLS")
        return get_peft_model(base, lora)

    return model_fn
