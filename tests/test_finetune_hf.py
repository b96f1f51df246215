"""A peft LoRA fine-tune of a local HuggingFace checkpoint, the user's code unchanged:
only the adapters and the classifier hop, the bits do not depend on the workers, and
``best().build()`` is the whole model."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

import hf_models  # noqa: E402
from cerebro_automl import PartitionedDataset, Session, TrainingSpec, accuracy  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' deprecations
CONFIGS = [{"r": r, "lr": lr} for r in (2, 4) for lr in (1e-3, 5e-3)]


def _search(folder, **kwargs):
    spec = TrainingSpec(
        model_fn=hf_models.lora_model_fn(folder),
        optimizer_fn=lambda c, params: torch.optim.AdamW(params, lr=c["lr"]),
        metrics={"accuracy": accuracy},
        batch_size=32,
    )
    X, y = hf_models.tokens(256)
    Xv, yv = hf_models.tokens(64, seed=1)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid=(Xv, yv))
    with Session(spec, data, seed=0, progress=False, **kwargs) as s:
        ids = [s.add(c, epochs=2) for c in CONFIGS]
        s.run()
        h = s.history.sort_values(["model_id", "epoch"])
        return list(h.val_loss), [s.model(i).state() for i in ids], s.best("val_loss").build()


@pytest.mark.cluster
def test_a_peft_lora_search_hops_only_the_adapters_and_gives_the_same_bits_on_1_and_2_workers(tmp_path):
    folder = hf_models.save_base(str(tmp_path / "base"))
    one, states_one, best = _search(folder, n_workers=1)
    two, states_two, _ = _search(folder, n_workers=2)
    assert one == two
    for a, b in zip(states_one, states_two):
        assert a["model"].keys() == b["model"].keys()
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    whole = hf_models.lora_model_fn(folder)(CONFIGS[0])
    trainable = sum(p.numel() * p.element_size() for p in whole.parameters() if p.requires_grad)
    hopped = sum(t.numel() * t.element_size() for t in states_one[0]["model"].values())
    assert all(k.endswith(("lora_A.default.weight", "lora_B.default.weight")) or "modules_to_save" in k
               or "buffer" in k or k.endswith("_ids") for k in states_one[0]["model"])
    assert hopped <= trainable + 1024 < sum(t.numel() * t.element_size() for t in whole.state_dict().values()) / 10
    # the whole model: the base's tensors come from the checkpoint folder, the adapters trained
    assert type(best).__name__ == "PeftModelForSequenceClassification"
    assert best.state_dict().keys() == whole.state_dict().keys()
    base = whole.base_model.model.bert.embeddings.word_embeddings.weight
    assert torch.equal(best.base_model.model.bert.embeddings.word_embeddings.weight, base)


def test_a_peft_checkpoint_holds_the_adapters_not_the_base(tmp_path):
    folder = hf_models.save_base(str(tmp_path / "base"))
    _search(folder, executor="local", checkpoint_dir=str(tmp_path / "checkpoints"))
    whole = hf_models.lora_model_fn(folder)({"r": 4})
    trainable = sum(p.numel() * p.element_size() for p in whole.parameters() if p.requires_grad)
    files = list((tmp_path / "checkpoints").rglob("epoch-*.pt"))
    assert len(files) == 2 * len(CONFIGS)
    # AdamW's two moments per trainable parameter, and metadata (the base's digests, the param groups)
    assert max(f.stat().st_size for f in files) <= 3 * trainable + 64 * 1024


def test_a_tokenized_datasets_dataset_goes_in_directly(tmp_path):
    datasets = pytest.importorskip("datasets")
    folder = hf_models.save_base(str(tmp_path / "base"))
    X, y = hf_models.tokens(96)
    Xv, yv = hf_models.tokens(32, seed=1)
    train = datasets.Dataset.from_dict({"text": ["..."] * 96, **{k: v.tolist() for k, v in X.items()}, "label": y})
    valid = datasets.Dataset.from_dict({**{k: v.tolist() for k, v in Xv.items()}, "label": yv})
    data = PartitionedDataset.from_hf(train, 2, valid=valid)
    spec = TrainingSpec(model_fn=hf_models.lora_model_fn(folder), metrics={"accuracy": accuracy}, batch_size=32,
                        optimizer_fn=lambda c, params: torch.optim.AdamW(params, lr=c["lr"]))
    with Session(spec, data, executor="local", progress=False) as s:  # no forward_fn: the ModelOutput's logits
        s.add(CONFIGS[0], epochs=1)
        history = s.run()
    assert history.val_accuracy.notna().all()


@pytest.mark.parametrize("make, message", [
    (lambda ds: ds.Dataset.from_dict({"input_ids": [[1, 2], [3]], "label": [0, 1]}),
     "column 'input_ids' holds rows of different lengths"),
    (lambda ds: ds.DatasetDict({"train": ds.Dataset.from_dict({"input_ids": [[1]], "label": [0]})}),
     r"is a DatasetDict with splits \['train'\], but must be one Dataset"),
    (lambda ds: ds.Dataset.from_dict({"input_ids": [[1]], "target": [0]}),
     r"label is 'label', but dataset has columns \['input_ids', 'target'\]"),
])
def test_a_datasets_dataset_that_cannot_be_batched_is_refused_naming_why(make, message):
    datasets = pytest.importorskip("datasets")
    with pytest.raises((ValueError, TypeError), match=message):
        PartitionedDataset.from_hf(make(datasets), 1)


def test_a_from_pretrained_model_fn_is_checked_and_fused_on_the_meta_device(tmp_path, caplog):
    """peft users' model_fn calls from_pretrained, which refuses a meta device context:
    built there with device_map="meta" instead (no weights read), its configs are
    checked before training, and LoRA configs of one rank fuse."""
    folder = hf_models.save_base(str(tmp_path / "base"))
    spec = TrainingSpec(model_fn=hf_models.lora_model_fn(folder),
                        optimizer_fn=lambda c, params: torch.optim.AdamW(params, lr=c["lr"]), batch_size=16)
    X, y = hf_models.tokens(96)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid_fraction=0.25)
    with Session(spec, data, seed=0, executor="local", fuse=2) as s:
        with pytest.raises(ValueError, match=r"lacks key 'r'"):
            s.add({"lr": 1e-3}, epochs=1)  # refused at add, not on a worker
        ids = [s.add({"r": 4, "lr": lr}, epochs=1) for lr in (1e-3, 2e-3, 5e-3, 1e-2)]
        s.run()
        groups = sorted(sorted(m.model_id for m in g.members) for g in s._fusion.groups.values())
        assert set(s.statuses().values()) == {"paused"}
    assert groups == [ids[:2], ids[2:]]
    assert not any("not all checked before training" in r.message for r in caplog.records)


def test_a_model_fn_that_imports_transformers_itself_is_checked_from_its_first_config(tmp_path):
    """In a fresh process transformers is first imported by model_fn, inside the meta
    build: that build is tried again, so even the first config is checked."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    folder = hf_models.save_base(str(tmp_path / "base"))
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import torch
        import hf_models
        from cerebro_automl import TrainingSpec
        assert "transformers" not in sys.modules
        spec = TrainingSpec(model_fn=hf_models.lora_model_fn({folder!r}),
                            optimizer_fn=lambda c, p: torch.optim.AdamW(p, lr=c["lr"]), batch_size=16)
        try:
            spec.validate_config({{"lr": 1e-3}})
        except ValueError as err:
            print("refused:", err)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused: config {'lr': 0.001} lacks key 'r'" in done.stdout, done.stdout + done.stderr[-2000:]


def test_from_pretrained_outside_our_meta_builds_is_transformers_own(tmp_path):
    """Once wrapped, from_pretrained acts differently only inside on_meta, in the
    thread that entered it: a user's own meta context still gets transformers' refusal."""
    import threading

    from transformers import AutoModelForSequenceClassification

    from cerebro_automl.meta_device import on_meta

    folder = hf_models.save_base(str(tmp_path / "base"))
    with on_meta():
        assert next(AutoModelForSequenceClassification.from_pretrained(folder).parameters()).is_meta
        errors = []

        def other_thread():
            try:
                with torch.device("meta"):
                    AutoModelForSequenceClassification.from_pretrained(folder)
            except RuntimeError as err:
                errors.append(str(err))

        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert errors and "meta device context manager" in errors[0]
    with pytest.raises(RuntimeError, match="meta device context manager"), torch.device("meta"):
        AutoModelForSequenceClassification.from_pretrained(folder)
