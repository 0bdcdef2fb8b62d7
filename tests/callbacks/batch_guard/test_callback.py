import dataclasses
import json
import warnings
from collections.abc import Mapping

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_tfdebug import BatchGuard, TFDebugError, TFDebugWarning, read_findings
from lightning_tfdebug.core.model import find_context_length, find_vocab_size
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from lightning_tfdebug.demo.data import ByteTokenizer
from lightning_tfdebug.repro import load_bundle, replay
from tests.helpers import SMALL, make_trainer, read_scalars, run_distributed
from tests.helpers import fit_tiny as fit


def codes(callback):
    return sorted({f.code for f in callback.findings})


class ForwardCounter(Callback):
    """Counts the batches whose training_step ran (on_train_batch_end is reached only after the forward)."""

    def __init__(self):
        self.done = 0

    def on_train_batch_end(self, *args):
        self.done += 1


class CorruptOnRank(Callback):
    """Test helper: on one rank, at one step, put an out-of-range token id into the batch (before BatchGuard)."""

    def __init__(self, rank: int = 1, step: int = 2, token: int = 999):
        self.rank, self.step, self.token = rank, step, token

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            batch["input_ids"][0, 0] = self.token


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"learn_batches": 0}, "learn_batches"),
        ({"check_values_every_n_steps": 0}, "check_values_every_n_steps"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"max_truncated_fraction": 1.5}, "max_truncated_fraction"),
        ({"length_shift_tolerance": 0}, "length_shift_tolerance"),
        ({"schema": {}}, "non-empty mapping"),
        ({"schema": {"input_ids": "long64[B]"}}, "not a torch dtype"),
        ({"tokenizer": "no.such.Tokenizer"}, "importable"),
        ({"tokenizer": object()}, "decode"),
        ({"input_key": ["input_ids"]}, "input_key"),
        ({"ignore_index": "x"}, "ignore_index"),
        ({"on_finding": "explode"}, "on_finding"),
        ({"special_token_batches": -1}, "special_token_batches"),
        ({"min_eos_expected": 0}, "min_eos_expected"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        BatchGuard(**kwargs)


def test_healthy_run_has_no_findings_logs_keys_and_decoded_examples(tmp_path):
    guard = BatchGuard(every_n_steps=2, tokenizer="lightning_tfdebug.demo.ByteTokenizer", bos_id=257)
    fit(tmp_path, [guard], max_steps=6)
    assert guard.findings == []
    assert (guard._rules.vocab_size, guard._rules.context) == (259, 64)
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    assert [s for s, _ in scalars["batch_guard/width"]] == [0, 2, 4]
    assert 0 < dict(scalars["batch_guard/ignored_frac"])[0] < 1
    assert dict(scalars["batch_guard/length_mean"])[0] > 1
    examples = (tmp_path / "tb" / "version_0" / "tfdebug" / "batch_examples-rank0.md").read_text()
    assert examples.count("input:") == 4 and "supervised" in examples and "·" in examples
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"tensors": 0})
    acc.Reload()
    assert "batch_guard/examples/text_summary" in acc.Tags()["tensors"]


@pytest.mark.parametrize(
    "flag, code",
    [({"all_labels_ignored": True}, "TFD114"), ({"pad_labels_supervised": True}, "TFD115")],
    ids=["row2-all-ignored", "row3-pad-supervised"],
)
def test_target_bugs_are_found(tmp_path, flag, code):
    guard = BatchGuard()
    fit(tmp_path, [guard], data=TinyTextDataModule(batch_size=8, **flag), max_steps=2)
    assert codes(guard) == [code]
    finding = guard.findings[0]
    assert finding.step == 0 and "'labels'" in finding.message
    assert read_findings(tmp_path / "tb" / "version_0" / "tfdebug" / "findings-rank0.jsonl")[0].code == code


@pytest.mark.parametrize(
    "flag, code, words",
    [
        ({"long_batch_every": 4}, "TFD111", ["'input_ids'", "sequence length 72", "context of 64"]),
        ({"bad_token_every": 4}, "TFD110", ["'input_ids'", "outside [0, 259)", "262 at row 0, position 1"]),
        ({"squeeze_batch_every": 4}, "TFD104", ["'input_ids'", "1 dims (", "expected 2 dims"]),
    ],
    ids=["row4-long", "row5-bad-token", "row6-squeezed"],
)
def test_crashing_batches_raise_the_finding_before_the_forward(tmp_path, flag, code, words):
    guard, counter = BatchGuard(on_finding="raise"), ForwardCounter()
    with pytest.raises(TFDebugError) as info:
        fit(tmp_path, [guard, counter], data=TinyTextDataModule(batch_size=8, **flag), max_steps=8)
    assert counter.done == 3  # the fourth batch never reached training_step
    assert code in str(info.value) and "Batch 3 (step 3" in str(info.value)
    for word in words:
        assert word in str(info.value)


def test_dtype_drift_is_named_with_expected_and_found(tmp_path):
    guard = BatchGuard()
    fit(tmp_path, [guard], data=TinyTextDataModule(batch_size=8, dtype_drift_every=5), max_steps=7)
    found = {(f.code, f.evidence["key"], f.evidence["expected"], f.evidence["found"], f.step) for f in guard.findings}
    assert found == {("TFD103", "labels", "int64", "int32", 4), ("TFD103", "attention_mask", "int64", "float32", 4)}


def test_one_bad_batch_in_a_few_hundred_is_caught(tmp_path):
    guard, counter = BatchGuard(on_finding="raise"), ForwardCounter()
    with pytest.raises(TFDebugError, match="TFD110"):
        fit(tmp_path, [guard, counter], data=TinyTextDataModule(batch_size=4, bad_token_every=150), max_steps=200)
    assert counter.done == 149


def test_bos_eos_and_truncation_conventions(tmp_path):
    wrong_bos = BatchGuard(bos_id=5, eos_id=258, max_truncated_fraction=0.0)
    fit(tmp_path, [wrong_bos], max_steps=2)
    # every demo sequence starts with BOS 257, not 5; documents longer than 64 tokens lose their EOS
    assert codes(wrong_bos) == ["TFD116", "TFD119"]
    eos_twice = BatchGuard(bos_id=257, eos_id=ord("."))  # a "." ends every sentence: several per sequence
    fit(tmp_path / "b", [eos_twice], max_steps=2)
    assert {"TFD117", "TFD118"} <= set(codes(eos_twice))
    assert "TFD116" not in codes(eos_twice)


def lm_batches(lengths, width=24, n=4):
    batches = []
    for i, length in enumerate(lengths):
        ids = torch.full((n, width), 256)
        ids[:, :length] = 65 + i % 26  # distinct batches: identical ones would be TFD121
        mask = (ids != 256).long()
        labels = ids.masked_fill(mask == 0, -100)
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return DataLoader(batches, batch_size=None)


def test_length_distribution_shift_against_the_early_batches(tmp_path):
    guard = BatchGuard(length_window=2)
    trainer = make_trainer(tmp_path, [guard], max_steps=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TFDebugWarning)
        trainer.fit(TinyGPT(**SMALL), train_dataloaders=lm_batches([6, 8, 7, 7, 7, 8, 20, 22]))
    assert codes(guard) == ["TFD120"]
    assert guard.findings[0].step == 7
    assert guard.findings[0].evidence["window_mean"] == pytest.approx(21.0)


def test_declared_schema_catches_a_fixed_dimension(tmp_path):
    guard = BatchGuard(schema={"input_ids": "int64[B, 24]", "labels": "int64[B, T]", "attention_mask": "int64[B, T]"})
    trainer = make_trainer(tmp_path, [guard], max_steps=2)
    batches = lm_batches([5, 5])
    batches.dataset[1]["input_ids"] = batches.dataset[1]["input_ids"][:, :20]
    batches.dataset[1]["attention_mask"] = batches.dataset[1]["attention_mask"][:, :20]
    batches.dataset[1]["labels"] = batches.dataset[1]["labels"][:, :20]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TFDebugWarning)
        trainer.fit(TinyGPT(**SMALL), train_dataloaders=batches)
    assert [(f.code, f.evidence["key"], f.step) for f in guard.findings] == [("TFD105", "input_ids", 1)]


def test_a_key_missing_from_a_later_batch_is_named(tmp_path):
    # the mask drops out of one batch: once while the schema is being learned (batch 1), once after (batch 5),
    # and once against a declared schema; TinyGPT runs without a mask, so nothing crashes and the run goes on
    declared = {"input_ids": "int64[B, T]", "attention_mask": "int64[B, T]", "labels": "int64[B, T]"}
    for name, schema, bad, source in [
        ("learning", None, 1, "learned from the first batches"),
        ("learned", None, 5, "learned from the first batches"),
        ("declared", declared, 2, "the declared schema"),
    ]:
        guard = BatchGuard(schema=schema)
        batches = lm_batches([5, 6, 7, 5, 6, 7, 5])
        del batches.dataset[bad]["attention_mask"]
        fit(tmp_path / name, [guard], data=batches, max_steps=7)
        assert [(f.code, f.severity, f.step) for f in guard.findings] == [("TFD101", "error", bad)], name
        assert guard.findings[0].evidence == {"key": "attention_mask", "expected": "int64", "found": "absent"}
        assert f"Batch {bad} (step {bad}" in guard.findings[0].message
        assert "key 'attention_mask' is missing" in guard.findings[0].message and source in guard.findings[0].message


def test_a_new_key_in_a_later_batch_is_a_warning(tmp_path):
    for name, bad in [("learning", 1), ("learned", 5)]:
        guard = BatchGuard()
        batches = lm_batches([5, 6, 7, 5, 6, 7, 5])
        batches.dataset[bad]["position_ids"] = torch.arange(24).expand(4, 24).clone()
        fit(tmp_path / name, [guard], data=batches, max_steps=7)
        # keys are learned from the first batch only: the later batches without the new key are not TFD101
        assert [(f.code, f.severity, f.step) for f in guard.findings] == [("TFD102", "warning", bad)], name
        assert guard.findings[0].evidence == {"key": "position_ids", "expected": "absent", "found": "int64[4, 24]"}
        assert "key 'position_ids' is new" in guard.findings[0].message
    # a declared schema lists what must be there; an optional key beside it is not drift
    declared = BatchGuard(schema={"input_ids": "int64[B, T]", "labels": "int64[B, T]"})
    fit(tmp_path / "declared", [declared], data=lm_batches([5, 6, 7]), max_steps=3)
    assert declared.findings == []


def test_a_drift_after_many_batches_of_one_structure_is_caught_at_that_batch(tmp_path, monkeypatch):
    """A batch with the structure of the last one that passed is not compared again; a batch that differs in a dtype,
    a size or its width is, and its finding names that very batch."""
    import lightning_tfdebug.callbacks.batch_guard.schema_checks as module

    compared = []
    original = module.compare_schema
    monkeypatch.setattr(
        module, "compare_schema", lambda schema, specs: compared.append(len(compared)) or original(schema, specs)
    )
    loader = lm_batches([5 + i % 7 for i in range(32)])
    batches = loader.dataset
    batches[12]["labels"] = batches[12]["labels"].int()  # TFD103
    wide = batches[20]  # 25 wide: longer than max_length, every key alike (TFD111 only)
    for key, pad in (("input_ids", 256), ("attention_mask", 0), ("labels", -100)):
        wide[key] = torch.cat([wide[key], torch.full((4, 1), pad)], 1)
    for i, batch in enumerate(batches):  # a key the model does not read, as wide as the ids
        batch["token_type_ids"] = torch.zeros(4, 23 if i == 26 else batch["input_ids"].shape[1], dtype=torch.long)
    guard = BatchGuard(max_length=24)
    fit(tmp_path, [guard], data=loader, max_steps=32)
    assert [(f.code, f.evidence["key"], f.step) for f in guard.findings] == [
        ("TFD103", "labels", 12),
        ("TFD111", "input_ids", 20),
        ("TFD105", "token_type_ids", 26),  # no longer as wide as the ids
    ]
    assert [f.message.split(":")[0] for f in guard.findings] == [
        f"Batch {b} (step {b}, epoch 0, rank 0)" for b in (12, 20, 26)
    ]
    # compared while learning (batches 1-3), then on the first learned batch, each changed batch and the one after
    assert len(compared) == 10, compared


def test_an_attention_mask_that_is_not_binary_is_an_error(tmp_path):
    guard = BatchGuard()
    batches = lm_batches([5, 6, 7, 5])
    batches.dataset[2]["attention_mask"][1, 3:7] = 2  # packed segment ids (1, 2) passed as the attention mask
    fit(tmp_path, [guard], data=batches, max_steps=4)
    assert [(f.code, f.severity, f.step) for f in guard.findings] == [("TFD112", "error", 2)]
    assert guard.findings[0].evidence == {"key": "attention_mask", "count": 4.0, "example": 2.0}
    assert "'attention_mask' has 4 value(s) that are neither 0 nor 1" in guard.findings[0].message
    # a boolean mask is binary
    healthy = BatchGuard()
    bool_masks = lm_batches([5, 6])
    for batch in bool_masks.dataset:
        batch["attention_mask"] = batch["attention_mask"].bool()
    fit(tmp_path / "bool", [healthy], data=bool_masks, max_steps=2)
    assert healthy.findings == []


def test_a_label_outside_the_vocabulary_raises_before_the_forward(tmp_path):
    guard, counter = BatchGuard(on_finding="raise"), ForwardCounter()
    batches = lm_batches([8, 8, 8, 8])
    labels = batches.dataset[2]["labels"]
    labels[0, 1] = 258  # the last id of the vocabulary: fine
    labels[1, 2] = -1  # masked with -1 instead of ignore_index -100
    labels[3, 4] = 259  # one past the vocabulary
    with pytest.raises(
        TFDebugError, match=r"(?s)TFD113.*2 label\(s\) outside \[0, 259\).*ignore_index=-100 \(e\.g\. -1\)"
    ):
        fit(tmp_path, [guard, counter], data=batches, max_steps=4)
    assert counter.done == 2  # cross_entropy would have failed on the third batch
    assert [(f.code, f.severity, f.step) for f in guard.findings] == [("TFD113", "error", 2)]
    assert guard.findings[0].evidence == {"count": 2.0, "vocab_size": 259, "ignore_index": -100}
    assert "'labels' holds 2 label(s)" in guard.findings[0].message


class HFLanguageModel(pl.LightningModule):
    """A Hugging Face GPT-2 from a tiny config (no download) inside a LightningModule nobody here wrote."""

    def __init__(self):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=300, n_positions=48, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
        )
        self.lm = GPT2LMHeadModel(config)

    def training_step(self, batch, batch_idx):
        return self.lm(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_vocab_and_context_are_read_from_models_nobody_here_wrote(tmp_path):
    hf = HFLanguageModel()
    assert find_vocab_size(hf)[0] == 300 and "get_input_embeddings" in find_vocab_size(hf)[1]
    assert find_context_length(hf)[0] == 48
    tiny = TinyGPT(**SMALL, context_length=40)
    assert find_vocab_size(tiny)[0] == 259 and find_context_length(tiny) == (40, "position embedding 'pos_emb'")
    assert find_vocab_size(torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Embedding(7, 3)))[0] is None
    guard = BatchGuard(on_finding="raise")
    trainer = make_trainer(tmp_path, [guard], max_steps=3)
    batches = lm_batches([5, 5, 5])
    batches.dataset[2]["input_ids"][1, 3] = 300
    with (
        pytest.raises(TFDebugError, match=r"(?s)TFD110.*outside \[0, 300\).*row 1, position 3"),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore", TFDebugWarning)
        trainer.fit(hf, train_dataloaders=batches)
    assert trainer.global_step == 2


class MinGPTStyle(pl.LightningModule):
    """Another style nobody here wrote: a position table kept as an nn.Parameter (1, T, d), a head tied to the token
    embedding through F.linear (no nn.Linear of vocabulary width), and a token-type table beside it."""

    def __init__(self, vocab: int = 259, block_size: int = 40, d: int = 40):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, d)
        self.type_emb = torch.nn.Embedding(2, d)
        self.pos_embed = torch.nn.Parameter(torch.zeros(1, block_size, d))
        self.mix = torch.nn.Linear(d, d)  # width d == block_size: must not be mistaken for the head

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        x = self.wte(ids) + self.pos_embed[:, : ids.shape[1]] + self.type_emb(torch.zeros_like(ids))
        logits = torch.nn.functional.linear(torch.tanh(self.mix(x)), self.wte.weight)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_parameter_position_table_and_a_tied_head_are_understood(tmp_path):
    model = MinGPTStyle()
    assert find_vocab_size(model) == (259, "the only token embedding, 'wte'")
    assert find_context_length(model) == (40, "position parameter 'pos_embed' (1, 40, 40)")
    guard, counter = BatchGuard(on_finding="raise"), ForwardCounter()
    data = TinyTextDataModule(batch_size=4, context_length=30, long_batch_every=3)  # batch 3 is 38 wide: fits
    with pytest.raises(TFDebugError, match="sequence length 38, longer than the model's context of 37") as info:
        fit(tmp_path, [guard, counter], model=MinGPTStyle(block_size=37), data=data, max_steps=6)
    assert counter.done == 2 and codes(guard) == ["TFD111"] and "Batch 2 (step 2" in str(info.value)


class TupleBatches(MinGPTStyle):
    """nanoGPT-style batches: a tuple (x, y) of ids and next-token targets, no names, no mask."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return super().training_step({"input_ids": x, "labels": y}, batch_idx)


def test_tuple_batches_are_checked_by_position(tmp_path):
    tuples = []
    for _ in range(4):
        x = torch.randint(0, 259, (4, 12))
        tuples.append((x, torch.roll(x, -1, 1)))
    tuples[2][0][3, 5] = 300  # a token id past the vocabulary in the third batch
    guard = BatchGuard(on_finding="raise")
    trainer = make_trainer(tmp_path, [guard], max_steps=4)
    expected = r"'0' holds 1 token id\(s\) outside \[0, 259\); the first is 300 at row 3"
    with pytest.raises(TFDebugError, match=expected), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TFDebugWarning)
        trainer.fit(TupleBatches(), train_dataloaders=DataLoader(tuples, batch_size=None))
    # where the fields were found goes to the debug log, not to a warning pointing at the library's source
    assert not any("token ids taken from" in str(w.message) for w in caught)
    assert trainer.global_step == 2


def test_learned_schema_is_saved_and_restored_on_resume(tmp_path):
    guard = BatchGuard(length_window=2)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=5)
    fit(tmp_path, [guard, ckpt], max_steps=5, enable_checkpointing=True)
    resumed = BatchGuard(length_window=2)
    trainer = make_trainer(tmp_path / "r", [resumed], max_steps=7, enable_checkpointing=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TFDebugWarning)
        trainer.fit(
            TinyGPT(**SMALL),
            TinyTextDataModule(batch_size=8, dtype_drift_every=1),  # every batch drifts: no chance to re-learn
            ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"),
        )
    assert resumed._lengths.reference == guard._lengths.reference is not None
    # resumed at batch 5 of a shuffled loader that cannot restore its position: TFD125, info
    assert {(f.code, f.severity) for f in resumed.findings} == {("TFD103", "error"), ("TFD125", "info")}
    assert resumed.findings[0].step == 5


class ResumableLoader(DataLoader):
    """A DataLoader that Lightning restores on resume (it has ``state_dict`` and ``load_state_dict``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read = self.skip = 0

    def __iter__(self):
        skip, self.skip = self.skip, 0
        for i, batch in enumerate(super().__iter__()):
            if i >= skip:
                self.read = i + 1
                yield batch

    def state_dict(self):
        return {"read": self.read}

    def load_state_dict(self, state):
        self.skip = state["read"]


@pytest.mark.parametrize("loader_class", [DataLoader, ResumableLoader])
def test_a_mid_epoch_resume_is_named_when_the_loader_restarts_the_epoch(tmp_path, loader_class):
    def loader():  # ten distinct batches in a fixed order
        return loader_class(lm_batches([4, 5, 6, 7, 8, 9, 10, 11, 12, 13]).dataset, batch_size=None)

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=6)
    fit(tmp_path, [BatchGuard(), ckpt], data=loader(), max_steps=6, enable_checkpointing=True)
    guard = BatchGuard()  # resumed at batch 6 of 10, then a whole epoch
    fit(tmp_path / "r", [guard], data=loader(), max_steps=14, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    if loader_class is ResumableLoader:
        assert guard.findings == []
        return
    [finding] = guard.findings  # TFD125 only: the restarted batches 0-3 are not "data that repeats" (TFD123)
    assert (finding.code, finding.severity, finding.step) == ("TFD125", "warning", 6)
    assert finding.evidence["repeated"] == [0, 3] and finding.evidence["skipped"] == [6, 9]


def test_built_from_lightning_cli_yaml():
    from jsonargparse import ArgumentParser

    config = yaml.safe_load(
        """
        callbacks:
          - class_path: lightning_tfdebug.BatchGuard
            init_args:
              on_finding: raise
              schema: {input_ids: "int64[B, T]", labels: "int64[B, T]"}
              tokenizer: lightning_tfdebug.demo.ByteTokenizer
              eos_id: 258
              check_values_every_n_steps: 4
        """
    )
    parser = ArgumentParser()
    parser.add_argument("--callbacks", type=list[Callback])
    guard = parser.instantiate_classes(parser.parse_object(config)).callbacks[0]
    assert isinstance(guard, BatchGuard)
    assert guard.on_finding == "raise" and guard.eos_id == 258 and guard.check_values_every_n_steps == 4
    assert isinstance(guard.tokenizer, ByteTokenizer)
    assert {k: v.dims for k, v in guard._schema.declared.keys.items()} == {
        "input_ids": ["B", "T"],
        "labels": ["B", "T"],
    }


@pytest.mark.ddp
def test_ddp_a_bad_batch_on_one_rank_raises_on_every_rank_before_the_forward(tmp_path):
    results = run_distributed(
        tmp_path,
        {
            "strategy": "ddp",
            "model": SMALL,
            "data": {"batch_size": 4},
            "trainer": {"max_steps": 6},
            "callbacks": [
                {
                    "class_path": "tests.callbacks.batch_guard.test_callback.CorruptOnRank",
                    "init_args": {"rank": 1, "step": 2},
                },
                {"class_path": "lightning_tfdebug.BatchGuard", "init_args": {"on_finding": "raise"}},
                {"class_path": "lightning_tfdebug.ReproCapture"},
            ],
        },
    )
    assert [r["global_step"] for r in results] == [2, 2]
    assert all(r["error"]["type"] == "TFDebugError" for r in results)
    assert "TFD110" in results[1]["error"]["message"] and "rank 1" in results[1]["error"]["message"]
    assert "another rank" in results[0]["error"]["message"]
    assert results[0]["findings"]["BatchGuard"] == []
    assert [f["code"] for f in results[1]["findings"]["BatchGuard"]] == ["TFD110"]
    # each rank wrote its own bundle; rank 1's holds the bad batch and replays to the crash the guard prevented
    repro = tmp_path / "tb" / "version_0" / "tfdebug" / "repro"
    assert sorted(p.name for p in repro.iterdir()) == ["step2-rank0", "step2-rank1"]
    bad = load_bundle(repro / "step2-rank1")
    assert bad.batch["input_ids"][0, 0] == 999 and bad.meta["exception"]["type"].endswith("TFDebugError")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert isinstance(replay(bad, TinyGPT(**SMALL)).exception, IndexError)
        assert replay(repro / "step2-rank0", TinyGPT(**SMALL)).exception is None  # rank 0's batch was fine


# ---------------------------------------------------------------- batches read twice (TFD121)
class UnshardedStream(torch.utils.data.IterableDataset):
    """Every DataLoader worker yields the whole stream: with two workers each batch arrives twice."""

    def __iter__(self):
        for i in range(40):
            ids = (torch.arange(24).repeat(4, 1) + i) % 250
            yield {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


class ShardedStream(UnshardedStream):
    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        for k, batch in enumerate(super().__iter__()):
            if info is None or k % info.num_workers == info.id:
                yield batch


class IgnoresIndex(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        return torch.arange(24) % 250  # the index is never used


def ids_only(rows):
    ids = torch.stack(rows)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def test_batches_read_twice_in_one_epoch_are_named(tmp_path):
    stream = BatchGuard()
    loader = DataLoader(UnshardedStream(), batch_size=None, num_workers=2)
    fit(tmp_path / "stream", [stream], data=loader, max_steps=12)
    [finding] = [f for f in stream.findings if f.code == "TFD121"]
    assert finding.severity == "warning" and finding.evidence["repeats_step"] == finding.evidence["step"] - 1
    assert finding.evidence["repeated"] >= 3 and "get_worker_info" in finding.hint

    same = BatchGuard()
    fit(tmp_path / "index", [same], data=DataLoader(IgnoresIndex(), batch_size=8, collate_fn=ids_only), max_steps=6)
    [finding] = [f for f in same.findings if f.code == "TFD121"]
    assert (finding.evidence["checked"], finding.evidence["repeated"]) == (4, 3)


def test_distinct_batches_and_a_stream_that_cycles_are_not_repeats(tmp_path):
    sharded = BatchGuard()
    fit(tmp_path / "sharded", [sharded], data=DataLoader(ShardedStream(), batch_size=None, num_workers=2), max_steps=12)
    assert "TFD121" not in codes(sharded)

    class Cycling(UnshardedStream):  # a stream that loops over 20 batches: repeats, but far apart
        def __iter__(self):
            batches = list(super().__iter__())[:20]
            yield from batches + batches

    cycling = BatchGuard()
    fit(tmp_path / "cycling", [cycling], data=DataLoader(Cycling(), batch_size=None), max_steps=40)
    assert "TFD121" not in codes(cycling)

    epochs = BatchGuard()  # a map-style dataset seen for several epochs: repeats across epochs are expected
    fit(tmp_path / "epochs", [epochs], data=lm_batches([5, 6, 7, 8]), max_steps=12)
    assert epochs.findings == []


# ---------------------------------------------------------------- lazy value checks
def test_a_bad_id_between_checked_steps_is_named_when_the_embedding_raises(tmp_path):
    guard, counter = BatchGuard(every_n_steps=5), ForwardCounter()  # checks values at steps 0 and 5 only
    with pytest.raises(IndexError):  # the embedding's own error reaches the user, unchanged
        fit(tmp_path, [guard, counter], data=TinyTextDataModule(batch_size=8, bad_token_every=4), max_steps=8)
    assert counter.done == 3  # step 3 is not a checked step: its batch reached the model
    [finding] = guard.findings
    assert finding.code == "TFD110" and finding.step == 3
    assert "Batch 3 (step 3" in finding.message and "'input_ids'" in finding.message
    assert "262 at row 0, position 1" in finding.message
    written = read_findings(tmp_path / "tb" / "version_0" / "tfdebug" / "findings-rank0.jsonl")
    assert [f.code for f in written] == ["TFD110"]


def test_a_healthy_batch_that_crashes_for_another_reason_gets_no_finding(tmp_path):
    class Boom(Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 3:
                raise RuntimeError("boom")

    guard = BatchGuard(every_n_steps=10)
    with pytest.raises(RuntimeError, match="boom"):
        fit(tmp_path, [guard, Boom()], max_steps=8)
    assert guard.findings == []


def test_repeated_batches_are_found_from_fingerprints_read_on_checked_steps_only(tmp_path):
    same = BatchGuard(every_n_steps=5)  # fingerprints of steps 1-4 are read with step 5's transfer
    fit(tmp_path, [same], data=DataLoader(IgnoresIndex(), batch_size=8, collate_fn=ids_only), max_steps=8)
    [finding] = [f for f in same.findings if f.code == "TFD121"]
    assert (finding.evidence["checked"], finding.evidence["repeated"]) == (4, 3)
    assert finding.step == 3 and finding.evidence["step"] == 1 and finding.evidence["repeats_step"] == 0


# ---------------------------------------------------------------- batch types read by core.batch
@dataclasses.dataclass
class LMBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor


class ReadsFields(TinyGPT):
    """A module whose batches are dataclasses or Hugging Face BatchEncodings."""

    def training_step(self, batch, batch_idx):
        get = batch.__getitem__ if isinstance(batch, Mapping) else lambda k: getattr(batch, k)
        fields = {k: get(k) for k in ("input_ids", "attention_mask", "labels")}
        return super().training_step(fields, batch_idx)


def typed_batches(kind, bad_at=None):
    from transformers import BatchEncoding

    out = []
    for i, batch in enumerate(lm_batches([6, 8, 7, 9]).dataset):
        if i == bad_at:
            batch["input_ids"][1, 2] = 400
        out.append(LMBatch(**batch) if kind == "dataclass" else BatchEncoding(batch))
    return DataLoader(out, batch_size=None, collate_fn=lambda b: b)


class BatchType(Callback):
    def __init__(self):
        self.types = set()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.types.add(type(batch).__name__)


@pytest.mark.parametrize("kind, type_name", [("dataclass", "LMBatch"), ("encoding", "BatchEncoding")])
def test_dataclass_and_batch_encoding_batches_are_checked(tmp_path, kind, type_name):
    guard, seen = BatchGuard(on_finding="raise"), BatchType()
    trainer = make_trainer(tmp_path, [seen, guard], max_steps=4)
    expected = r"'input_ids' holds 1 token id\(s\) outside \[0, 259\); the first is 400"
    with pytest.raises(TFDebugError, match=expected), warnings.catch_warnings():
        warnings.simplefilter("ignore", TFDebugWarning)
        trainer.fit(ReadsFields(**SMALL), train_dataloaders=typed_batches(kind, bad_at=2))
    assert seen.types == {type_name} and trainer.global_step == 2
    assert "batch_guard/pad_frac" in trainer.callback_metrics


# ------------------------------------------------------------------------------------------------ mask holes (TFD122)
class TwoDocumentsPerRow(TinyTextDataModule):
    """Two documents per row, padded with EOS as GPT-2 and Llama users do (``pad_token = eos_token``); the mask is
    ``input_ids != pad_id`` (``mask_from_ids``), which also hides the EOS between the documents, or the tokenizer's
    mask by position (healthy)."""

    def __init__(self, mask_from_ids: bool, **kwargs):
        super().__init__(**kwargs)
        self.mask_from_ids = mask_from_ids

    def train_dataloader(self):
        eos = ByteTokenizer.eos_id

        def collate(samples):
            rows = [[*a[:-1][:29], eos, *b[:-1][:25], eos] for a, b in zip(samples[::2], samples[1::2])]
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), eos)
            by_position = torch.zeros_like(ids)
            for i, r in enumerate(rows):
                ids[i, : len(r)] = torch.tensor(r)
                by_position[i, : len(r)] = 1
            mask = (ids != eos).long() if self.mask_from_ids else by_position
            return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

        return DataLoader(self.train_set, batch_size=2 * self.hparams.batch_size, shuffle=True, collate_fn=collate)


@pytest.mark.parametrize("family", ["tinygpt", "gpt2"])
def test_an_attention_mask_with_holes_is_named_on_two_families_and_the_tokenizer_mask_is_not(tmp_path, family):
    from tests.healthy_models import build

    guard = BatchGuard()
    fit(tmp_path / "holes", [guard], build(family), TwoDocumentsPerRow(mask_from_ids=True, batch_size=4), max_steps=2)
    [finding] = [f for f in guard.findings if f.code == "TFD122"]
    assert finding.severity == "warning" and finding.step == 0
    assert finding.evidence["first_hole_id"] == ByteTokenizer.eos_id and finding.evidence["rows"] == 4
    assert f"input_ids != {ByteTokenizer.eos_id}" in finding.message
    healthy = BatchGuard()
    fit(tmp_path / "ok", [healthy], build(family), TwoDocumentsPerRow(mask_from_ids=False, batch_size=4), max_steps=2)
    assert "TFD122" not in codes(healthy) and [f for f in healthy.findings if f.severity != "info"] == []


def test_an_encoder_decoders_labels_of_the_sources_width_are_not_taken_for_supervised_padding(tmp_path):
    # T5: the labels are the decoder's targets; a batch whose target width happens to equal the source's must not be
    # read as labels aligned with the source's attention mask (TFD115)
    from tests.healthy_models import HFLM, seq2seq_collate

    rows = [list(range(40, 40 + n)) for n in (20, 24, 16, 24)]  # sources 10/12/8/12, targets 10/12/8/12: same width
    batches = DataLoader([seq2seq_collate(rows)] * 3, batch_size=None)
    guard = BatchGuard()
    fit(tmp_path, [guard], HFLM("t5"), batches, max_steps=3)
    assert [f for f in guard.findings if f.severity != "info"] == []
    # the same batch fed to a decoder-only model is aligned: its supervised padding is named
    batch = seq2seq_collate(rows)
    batch["labels"] = batch["input_ids"].clone()
    decoder = BatchGuard()
    fit(tmp_path / "decoder", [decoder], HFLM("gpt2"), DataLoader([batch] * 3, batch_size=None), max_steps=3)
    assert "TFD115" in codes(decoder)


# ---------------------------------------------------------------- batches back sooner than the data allows (TFD123)
def repeat_codes(guard):
    return [f for f in guard.findings if f.code in ("TFD121", "TFD123")]


@pytest.mark.parametrize("setting, family", [("overfit_batches", "gpt2"), ("limit_train_batches", "llama")])
def test_a_trainer_limit_that_rereads_the_same_batches_is_named(tmp_path, setting, family):
    # written on TinyGPT; checked here on Hugging Face models
    from tests.healthy_models import build

    guard = BatchGuard()
    # limit_train_batches=2 on an unshuffled loader reads the same first two batches every epoch
    data = TinyTextDataModule(batch_size=8, n_documents=200)
    if setting == "limit_train_batches":
        data.train_dataloader = lambda: DataLoader(
            data.train_set, batch_size=8, collate_fn=data.collator, drop_last=True
        )
    fit(tmp_path, [guard], build(family), data, max_steps=8, **{setting: 1 if setting == "overfit_batches" else 2})
    [finding] = repeat_codes(guard)
    assert finding.code == "TFD123" and finding.severity == "warning"
    assert f"Trainer({setting}=" in finding.message and finding.evidence["loader_length"] == 23
    assert finding.evidence["distinct"] == (1 if setting == "overfit_batches" else 2)

    shuffled = BatchGuard()  # the same limit on a shuffled loader reads new batches every epoch: silent
    fit(tmp_path / "shuffled", [shuffled], build(family), TinyTextDataModule(batch_size=8, n_documents=200),
        max_steps=8, limit_train_batches=2)  # fmt: skip
    assert repeat_codes(shuffled) == []


class IgnoresIndexSmall(IgnoresIndex):
    def __len__(self):
        return 16  # two batches of 8 per epoch: one repeat per epoch, never three in one


def test_a_dataset_ignoring_its_index_and_a_loader_of_one_fixed_batch_are_named_across_short_epochs(tmp_path):
    from tests.healthy_models import build

    guard = BatchGuard()
    fit(tmp_path, [guard], build("llama"), DataLoader(IgnoresIndexSmall(), batch_size=8, collate_fn=ids_only),
        max_steps=8)  # fmt: skip
    [finding] = repeat_codes(guard)
    assert finding.code == "TFD123" and finding.evidence["repeats_within_epochs"] == 3
    assert "ignores its index" in finding.message and finding.evidence["setting"] is None
    # tuple batches of a causal LM on nn.TransformerEncoder: a loader over two copies of one batch
    text = torch.arange(9 * 17).reshape(9, 17) % 250
    tokens, targets = text[:, :-1], text[:, 1:]
    fixed = BatchGuard()
    fit(tmp_path / "fixed", [fixed], build("encoder_lm"), DataLoader([(tokens, targets)] * 2, batch_size=None),
        max_steps=8)  # fmt: skip
    [finding] = repeat_codes(fixed)
    assert finding.code == "TFD123" and finding.evidence["distinct"] == 1


@pytest.mark.parametrize("shuffle", [False, True])
def test_many_epochs_over_a_small_dataset_with_accumulation_are_not_repeats(tmp_path, shuffle):
    from tests.healthy_models import build, periodic_text

    text = periodic_text(rows=32, length=17)
    per_batch = BatchGuard()  # 4 batches of 8 per epoch, 2 micro-batches per step: 12 epochs
    loader = DataLoader(torch.utils.data.TensorDataset(text[:, :-1], text[:, 1:]), batch_size=8, shuffle=shuffle)
    fit(tmp_path, [per_batch], build("encoder_lm"), loader, max_steps=24, accumulate_grad_batches=2)
    assert repeat_codes(per_batch) == [] and per_batch._repeats.period.read == 48
    # one row per batch: a shuffled sample may come back a batch after it was read, across an epoch's end
    rows = torch.randperm(250)[:6, None] + torch.arange(17)
    one = BatchGuard()
    loader = DataLoader(torch.utils.data.TensorDataset(rows[:, :-1], rows[:, 1:]), batch_size=1, shuffle=shuffle)
    fit(tmp_path / "one", [one], build("encoder_lm"), loader, max_steps=30)
    assert repeat_codes(one) == [] and one._repeats.period.read == 30 and len(one._repeats.period.seen) == 6


@pytest.mark.ddp
@pytest.mark.slow  # ~25 s of DDP epochs; the repeat checks run in one process by default
def test_ddp_epochs_over_a_distributed_sampler_are_silent_and_overfit_batches_is_named(tmp_path):
    spec = {
        "strategy": "ddp",
        "model": SMALL,
        "data": {"batch_size": 4, "n_documents": 100},  # 95 documents: 48 per rank, 12 batches of 4 per epoch
        "callbacks": [{"class_path": "lightning_tfdebug.BatchGuard"}],
    }
    healthy = run_distributed(tmp_path / "healthy", {**spec, "trainer": {"max_steps": 36}})
    assert [r["global_step"] for r in healthy] == [36, 36]
    assert all(r["findings"]["BatchGuard"] == [] for r in healthy)
    overfit = run_distributed(tmp_path / "overfit", {**spec, "trainer": {"max_steps": 8, "overfit_batches": 2}})
    for rank, result in enumerate(overfit):
        [finding] = result["findings"]["BatchGuard"]
        assert finding["code"] == "TFD123" and finding["rank"] == rank
        assert "Trainer(overfit_batches=2)" in finding["message"] and finding["evidence"]["loader_length"] == 12


# ---------------------------------------------------------------- EOS never supervised (TFD124)
EOS, BOS = ByteTokenizer.eos_id, ByteTokenizer.bos_id


def char_tokenizer(pad_is_eos=True):
    """A Hugging Face fast tokenizer built here (nothing downloaded): printable characters keep their byte ids, and
    the specials are ByteTokenizer's (pad 256, bos 257, eos 258)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i for i in range(32, 127)} | {"<unk>": 0, "<pad>": 256, "<bos>": BOS, "<eos>": EOS}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")),
        unk_token="<unk>", pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
    )  # fmt: skip
    if pad_is_eos:
        tok.pad_token = tok.eos_token  # the usual fix-up for GPT-2 / Llama tokenizers, which have no pad token
    return tok


def documents(tok, n=64, bos=False, eos=True):
    from lightning_tfdebug.demo.data import generate_corpus

    rows = []
    for doc in generate_corpus(n, seed=3):
        ids = tok(doc)["input_ids"][:56]
        rows.append({"input_ids": [BOS] * bos + ids + [EOS] * eos})
    return rows


def labels_by_position(tok, mask_first=False):
    """A healthy collator: padding masked by position (attention mask 0), not by id."""

    def collate(features):
        batch = dict(tok.pad(features, return_tensors="pt"))
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        if mask_first:
            batch["labels"][:, 0] = -100  # the BOS is never a target
        return batch

    return collate


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_an_eos_masked_by_a_collator_that_masks_the_pad_id_is_named(tmp_path, family):
    # written on TinyGPT's ByteTokenizer batches; checked here on Hugging Face models with Hugging Face's own collator
    from transformers import DataCollatorForLanguageModeling

    from tests.healthy_models import build

    tok = char_tokenizer(pad_is_eos=True)
    module = build(family)
    if family == "llama":  # no `tokenizer`: the ids come from the collator's tokenizer (and the model's config agrees)
        module.model.config.eos_token_id = module.model.config.pad_token_id = EOS
        guard = BatchGuard()
    else:
        guard = BatchGuard(tokenizer=tok)
    collator = DataCollatorForLanguageModeling(tok, mlm=False)  # labels[labels == pad_token_id] = -100
    fit(tmp_path, [guard], module, DataLoader(documents(tok), batch_size=8, collate_fn=collator), max_steps=3)
    [finding] = [f for f in guard.findings if f.code == "TFD124"]
    # 8 EOS per batch, 98% of the real tokens supervised: 8 expected after the second batch
    assert finding.severity == "warning" and finding.step == 1
    assert finding.evidence["eos_id"] == EOS and finding.evidence["eos_supervised"] == 0
    assert finding.evidence["eos_in_inputs"] == 16 and finding.evidence["pad_is_eos"]
    collator_source = "the training DataLoader's collator's tokenizer"
    assert finding.evidence["eos_source"] == (collator_source if family == "llama" else "`tokenizer`")
    assert "DataCollatorForLanguageModeling" in finding.message and "attention_mask == 0" in finding.hint

    # the same data with padding masked by position, a BOS in front that is never a target: silent
    healthy = BatchGuard(tokenizer=tok)
    data = DataLoader(documents(tok, bos=True), batch_size=8, collate_fn=labels_by_position(tok, mask_first=True))
    fit(tmp_path / "ok", [healthy], build(family), data, max_steps=3)
    assert [f for f in healthy.findings if f.severity != "info"] == [] and healthy._tally.done


def test_an_eos_used_as_bos_and_never_predicted_is_not_an_unsupervised_eos(tmp_path):
    # GPT-2's convention: <|endoftext|> in front of each document as its BOS, padding with it too (mask 0)
    from tests.healthy_models import build

    tok = char_tokenizer(pad_is_eos=True)
    rows = [{"input_ids": [EOS] + r["input_ids"]} for r in documents(tok, eos=False)]
    guard = BatchGuard(tokenizer=tok)
    fit(tmp_path, [guard], build("llama"), DataLoader(rows, batch_size=8, collate_fn=labels_by_position(tok, True)),
        max_steps=3)  # fmt: skip
    assert [f for f in guard.findings if f.severity != "info"] == []
    totals = guard._tally.totals
    assert totals["in_inputs"][0] == totals["in_labels"][0] == 0.0  # the leading EOS is not counted among the inputs


def test_masked_lm_and_seq2seq_batches_are_not_taken_for_an_unsupervised_eos(tmp_path):
    from tests.healthy_models import MLM_MASK_ID, PAD, _documents, _right_pad, build

    def mlm_without_specials(rows):  # Hugging Face's MLM recipe: special tokens are never chosen for masking
        ids, mask = _right_pad(rows, PAD)
        chosen = (torch.rand(ids.shape) < 0.15) & (mask == 1) & (ids < 256)
        labels = ids.masked_fill(~chosen, -100)
        return {"input_ids": ids.masked_fill(chosen, MLM_MASK_ID), "attention_mask": mask, "labels": labels}

    mlm = BatchGuard(tokenizer=ByteTokenizer())  # every row ends with EOS, never supervised
    rows = [[*r[:40], EOS] for r in _documents().samples]
    fit(tmp_path / "mlm", [mlm], build("bert_mlm"), DataLoader(rows, batch_size=16, collate_fn=mlm_without_specials),
        max_steps=10)  # fmt: skip
    assert [f for f in mlm.findings if f.severity != "info"] == []
    # 128 EOS or more over the 8 batches, 15% of the tokens supervised: 19 EOS would be expected of a causal LM
    assert mlm._tally.done and mlm._tally.batches == 8 and mlm._tally.totals["in_inputs"][0] >= 128

    def seq2seq(rows, drop_eos=False):  # T5's tokenizer ends sources and targets with EOS
        sources, mask = _right_pad([[*r[1 : len(r) // 2], EOS] for r in rows], 0)
        targets, target_mask = _right_pad([r[len(r) // 2 :] for r in rows], 0)
        labels = targets.masked_fill(target_mask == 0, -100)
        if drop_eos:
            labels = labels.masked_fill(labels == EOS, -100)
        return {"input_ids": sources, "attention_mask": mask, "labels": labels}

    t5 = BatchGuard(tokenizer=ByteTokenizer())
    fit(tmp_path / "t5", [t5], build("t5"), DataLoader(_documents(), batch_size=8, collate_fn=seq2seq), max_steps=3)
    assert [f for f in t5.findings if f.severity != "info"] == [] and t5._tally.done
    lost = BatchGuard(tokenizer=ByteTokenizer())  # a decoder whose targets lose their EOS is named
    data = DataLoader(_documents(), batch_size=8, collate_fn=lambda rows: seq2seq(rows, drop_eos=True))
    fit(tmp_path / "lost", [lost], build("t5"), data, max_steps=3)
    [finding] = [f for f in lost.findings if f.code == "TFD124"]
    assert finding.evidence["labels_layout"] == "targets" and not finding.evidence["pad_is_eos"]


def test_the_eos_check_stands_aside_alone_when_the_batch_cannot_serve_it(tmp_path):
    from tests.healthy_models import build

    unknown = BatchGuard()  # the encoder LM names no EOS anywhere
    text = torch.arange(32 * 17).reshape(32, 17) % 250
    fit(tmp_path / "unknown", [unknown], build("encoder_lm"),
        DataLoader(torch.utils.data.TensorDataset(text[:, :-1], text[:, 1:]), batch_size=8), max_steps=2)  # fmt: skip
    [(check, why)] = unknown.checks_aside.items()
    assert check == "EOS supervision (TFD124)" and "To let it run: `eos_id` or `tokenizer`." in why
    assert unknown.active and unknown.stood_aside is None  # the rest of BatchGuard runs on
    # recorded once for the report's "did not run" block (not printed during the run)
    [aside_file] = (tmp_path / "unknown").rglob("stood-aside-rank0.jsonl")
    [record] = [json.loads(line) for line in aside_file.read_text().splitlines()]
    assert record["check"] == "BatchGuard: EOS supervision (TFD124)" and record["setting"] == "`eos_id` or `tokenizer`"

    class NoMask(TinyTextDataModule):  # pad id == EOS id and no attention mask: a real EOS looks like padding
        def train_dataloader(self):
            def collate(rows):
                ids = self.collator(rows)["input_ids"]
                ids[ids == ByteTokenizer.pad_id] = EOS
                return {"input_ids": ids, "labels": ids.masked_fill(ids == EOS, -100)}

            return DataLoader(self.train_set, batch_size=8, collate_fn=collate)

    class PadIsEos(ByteTokenizer):
        pad_id = EOS

    guard = BatchGuard(tokenizer=PadIsEos())
    fit(tmp_path / "nomask", [guard], data=NoMask(), max_steps=3)
    why = guard.checks_aside["EOS supervision (TFD124)"]
    assert "no attention mask" in why and "`mask_key`" in why and guard.active
    assert "TFD124" not in codes(guard) and guard._last is None


def test_the_eos_id_is_read_from_the_training_dataloaders_collator(tmp_path):
    """A plain DataLoader whose collator holds the tokenizer (as Hugging Face's data collators do): no `tokenizer`
    argument, no DataModule, and the EOS check still runs."""
    data = TinyTextDataModule(batch_size=8)
    data.setup("fit")

    class Collator:
        def __init__(self, inner) -> None:
            self.inner, self.tokenizer = inner, ByteTokenizer()

        def __call__(self, rows):
            return self.inner(rows)

    guard = BatchGuard()
    loader = DataLoader(data.train_set, batch_size=8, collate_fn=Collator(data.collator), drop_last=True)
    fit(tmp_path, [guard], data=loader, max_steps=3)
    assert "EOS supervision (TFD124)" not in guard.checks_aside and guard.active

    # a collator without a tokenizer, and one whose tokenizer has no EOS: the check stands aside once, recorded with
    # the setting that lets it run; nothing is raised and the rest of BatchGuard runs on
    class NoEos:
        eos_token_id = None
        pad_token_id = ByteTokenizer.pad_id

    bare = Collator(data.collator)
    del bare.tokenizer
    for name, collate in (("bare", bare), ("no-eos", Collator(data.collator))):
        if name == "no-eos":
            collate.tokenizer = NoEos()
        guard = BatchGuard()
        loader = DataLoader(data.train_set, batch_size=8, collate_fn=collate, drop_last=True)
        fit(tmp_path / name, [guard], data=loader, max_steps=3)
        why = guard.checks_aside["EOS supervision (TFD124)"]
        assert "To let it run: `eos_id` or `tokenizer`." in why and guard.active and guard.stood_aside is None
