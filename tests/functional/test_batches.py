import pytest
import torch

from lightning_tfdebug.functional.batch_schema import (
    compare_schema,
    describe_leaves,
    learn_schema,
    parse_declared_schema,
)
from lightning_tfdebug.functional.batches import (
    SPECIAL_FIELDS,
    length_shift,
    special_token_statistics,
    token_statistics,
    unpack_statistics,
)
from lightning_tfdebug.primitives.batch import flatten_batch

PAD, BOS, EOS, IGN = 9, 7, 8, 100


def describe_batch(batch):
    return describe_leaves(flatten_batch(batch))


def lm_batch(b=2, t=5, dtype=torch.long):
    ids = torch.arange(b * t).reshape(b, t) % 7
    return {"input_ids": ids.to(dtype), "attention_mask": torch.ones(b, t, dtype=torch.long), "labels": ids.clone()}


def test_flatten_names_nested_and_tuple_leaves():
    batch = ({"a": torch.zeros(2), "b": [torch.ones(1), "text"]}, torch.zeros(3))
    leaves = flatten_batch(batch)
    assert set(leaves) == {"0.a", "0.b.0", "0.b.1", "1"}
    specs = describe_batch(batch)
    assert specs["0.a"].describe() == "float32[2]"
    assert specs["0.b.1"].describe() == "str"
    assert set(describe_batch(torch.zeros(2, 3))) == {""}
    # a list of plain per-sample values is one leaf: a smaller last batch is not a missing key
    full = {"input_ids": torch.zeros(4, 3, dtype=torch.long), "ids": ["a", "b", "c", "d"], "n": [1, 2, 3, 4]}
    last = {"input_ids": torch.zeros(1, 3, dtype=torch.long), "ids": ["e"], "n": [5]}
    assert set(flatten_batch(full)) == {"input_ids", "ids", "n"}
    assert describe_batch(full)["ids"].describe() == "list"
    assert compare_schema(learn_schema([describe_batch(full)]), describe_batch(last)) == []


def test_learned_schema_catches_missing_extra_dtype_ndim_and_shared_sizes():
    schema = learn_schema([describe_batch(lm_batch(t=5)), describe_batch(lm_batch(t=9))])
    assert compare_schema(schema, describe_batch(lm_batch(t=3))) == []  # lengths are free
    drifted = lm_batch()
    drifted["labels"] = drifted["labels"].int()
    drifted["attention_mask"] = drifted["attention_mask"].float()
    kinds = {(d.kind, d.key, d.expected, d.found) for d in compare_schema(schema, describe_batch(drifted))}
    assert kinds == {("dtype", "labels", "int64", "int32"), ("dtype", "attention_mask", "int64", "float32")}
    squeezed = {k: v[0] for k, v in lm_batch().items()}
    assert {(d.kind, d.key) for d in compare_schema(schema, describe_batch(squeezed))} == {
        ("ndim", "input_ids"),
        ("ndim", "attention_mask"),
        ("ndim", "labels"),
    }
    missing = lm_batch()
    del missing["labels"]
    missing["position_ids"] = torch.zeros(2, 5)
    assert {(d.kind, d.key) for d in compare_schema(schema, describe_batch(missing))} == {
        ("missing", "labels"),
        ("extra", "position_ids"),
    }
    short_labels = lm_batch()
    short_labels["labels"] = short_labels["labels"][:, :4]
    (drift,) = compare_schema(schema, describe_batch(short_labels))
    assert (drift.kind, drift.key) == ("size", "labels")
    assert "as in 'input_ids'" in drift.expected


def test_declared_schema_fixed_named_and_free_dims():
    schema = parse_declared_schema({"input_ids": "int64[B, 5]", "labels": "int64[B, *]", "attention_mask": "int64"})
    assert {k: (v.dtype, v.dims) for k, v in schema.keys.items()} == {
        "input_ids": ("int64", ["B", 5]),
        "labels": ("int64", ["B", None]),
        "attention_mask": ("int64", None),
    }
    assert compare_schema(schema, describe_batch(lm_batch(t=5))) == []
    drifts = compare_schema(schema, describe_batch(lm_batch(t=6)))
    assert [(d.kind, d.key) for d in drifts] == [("size", "input_ids")]
    mismatched = lm_batch()
    mismatched["labels"] = mismatched["labels"][:1]
    assert [(d.kind, d.key) for d in compare_schema(schema, describe_batch(mismatched))] == [("size", "labels")]
    extra = {**lm_batch(), "more": torch.zeros(1)}
    assert compare_schema(schema, describe_batch(extra)) == []  # a declared schema lists what it needs only


@pytest.mark.parametrize(
    "declared, match",
    [({"x": "int65[B]"}, "not a torch dtype"), ({"x": "int64[B, -1]"}, "dimension"), ({"x": "int64 B"}, "look like")],
)
def test_declared_schema_errors(declared, match):
    with pytest.raises(ValueError, match=match):
        parse_declared_schema(declared)


def reference_statistics(ids, mask, labels, vocab, bos, eos, max_length):
    """Plain-Python counts, row by row, for comparison."""
    ids, mask, labels = ids.tolist(), mask.tolist(), labels.tolist()
    out = dict.fromkeys(
        [
            "ids_out_of_range",
            "labels_out_of_range",
            "labels_ignored",
            "pad_supervised",
            "pad_positions",
            "mask_non_binary",
        ],
        0,
    )
    out.update(bos_missing=0, eos_multiple=0, eos_then_tokens=0, truncated=0, length_sum=0)
    first_bad = None
    for r, (row, mrow, lrow) in enumerate(zip(ids, mask, labels)):
        real = [m != 0 for m in mrow]
        out["mask_non_binary"] += sum(m not in (0, 1) for m in mrow)
        out["length_sum"] += sum(real)
        for c, tok in enumerate(row):
            if not 0 <= tok < vocab:
                out["ids_out_of_range"] += 1
                first_bad = first_bad or (r, c, tok)
        for lab, is_real in zip(lrow, real):
            out["labels_ignored"] += lab == IGN
            out["labels_out_of_range"] += lab != IGN and not 0 <= lab < vocab
            out["pad_supervised"] += (not is_real) and lab != IGN
            out["pad_positions"] += not is_real
        real_tokens = [t for t, is_real in zip(row, real) if is_real]
        out["bos_missing"] += bool(real_tokens) and real_tokens[0] != bos
        n_eos = real_tokens.count(eos)
        out["eos_multiple"] += n_eos > 1
        out["eos_then_tokens"] += n_eos > 0 and real_tokens.index(eos) < len(real_tokens) - 1
        out["truncated"] += len(real_tokens) >= max_length and n_eos == 0
    return out, first_bad


def test_token_statistics_match_a_plain_reference():
    ids = torch.tensor(
        [
            [BOS, 1, 2, EOS, PAD, PAD],  # fine
            [BOS, 1, 12, 3, 4, 5],  # out-of-range id, truncated (fills 6, no EOS)
            [PAD, PAD, BOS, 1, EOS, EOS],  # left-padded, two EOS
            [1, 2, EOS, 3, PAD, PAD],  # no BOS, tokens after EOS
        ]
    )
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6, [0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 2]])
    labels = ids.clone()
    labels[0, 4:] = IGN
    labels[2, :2] = IGN
    labels[3, 4] = -5  # out of range, also a supervised pad
    labels[1, 2] = IGN
    host = unpack_statistics(
        token_statistics(
            ids, mask, labels, vocab_size=10, ignore_index=IGN, bos_id=BOS, eos_id=EOS, max_length=6
        ).tolist()
    )
    expected, first_bad = reference_statistics(ids, mask, labels, 10, BOS, EOS, 6)
    for key, value in expected.items():
        assert host[key] == value, key
    assert (host["first_bad_id_row"], host["first_bad_id_col"], host["first_bad_id_value"]) == first_bad
    assert host["first_bad_label_value"] in (12, -5)
    assert (host["sequences"], host["width"], host["ids_min"], host["ids_max"]) == (4, 6, 1, 12)
    assert host["labels_total"] == 24


def test_token_statistics_without_optional_parts_and_for_one_squeezed_sequence():
    host = unpack_statistics(token_statistics(torch.tensor([3, 4, 5])).tolist())
    assert (host["sequences"], host["width"], host["length_sum"]) == (1, 3, 3)
    assert host["ids_out_of_range"] == host["labels_total"] == host["bos_missing"] == 0
    assert host["first_bad_id_row"] == -1


def test_length_shift_needs_both_relative_and_absolute_change():
    assert not length_shift(40.0, 5.0, 44.0, 0.5)
    assert length_shift(40.0, 5.0, 70.0, 0.5)
    assert not length_shift(40.0, 40.0, 70.0, 0.5)  # within one reference standard deviation
    assert not length_shift(0.0, 0.0, 10.0, 0.5)


def test_labels_of_another_shape_get_range_and_ignored_counts_but_no_padding_check():
    ids = torch.tensor([[5, 6, 9, 9]])
    mask = torch.tensor([[1, 1, 0, 0]])
    seq2seq = torch.tensor([[3, 300, IGN]])  # decoder targets, 3 wide: not aligned with the 4-wide inputs
    s = unpack_statistics(token_statistics(ids, mask, seq2seq, vocab_size=10, ignore_index=IGN).tolist())
    assert (s["labels_total"], s["labels_ignored"], s["labels_out_of_range"], s["first_bad_label_value"]) == (
        3,
        1,
        1,
        300,
    )
    assert s["pad_supervised"] == 0 and s["pad_positions"] == 2
    classes = torch.tensor([IGN])  # one class label per row, all ignored
    s = unpack_statistics(token_statistics(ids, mask, classes, vocab_size=10, ignore_index=IGN).tolist())
    assert s["labels_ignored"] == s["labels_total"] == 1


# ---------------------------------------------------------------- special-token supervision (TFD124's counts)
def special_reference(ids, mask, labels, specials, ignore=-100, aligned=True):
    """Plain Python loops over the rows: the numbers special_token_statistics must give."""
    real = [[m != 0 for m in row] for row in mask.tolist()]
    rows, labs = ids.tolist(), labels.tolist()
    flat_labels = [x for row in labs for x in row]
    supervised = [x != ignore for x in flat_labels]
    out = [sum(map(sum, real)), sum(supervised), 0, 0, 0]
    if aligned:
        for r, row in enumerate(rows):
            for t, token in enumerate(row):
                if labs[r][t] == ignore:
                    continue
                out[2] += 1
                out[3] += labs[r][t] == token
                out[4] += t + 1 < len(row) and labs[r][t] == row[t + 1]
    for s in specials:
        inputs = 0
        for r, row in enumerate(rows):
            first = min((t for t, m in enumerate(real[r]) if m), default=len(row))
            inputs += sum(1 for t, token in enumerate(row) if token == s and real[r][t] and t > first)
        out += [inputs, sum(1 for x, sup in zip(flat_labels, supervised) if sup and x == s)]
    return out


def flat_special(fields):
    """The named fields of special_token_statistics as the reference's flat list: the scalars, then per id the pair."""
    pairs = [x for pair in zip(fields["in_inputs"].tolist(), fields["in_labels"].tolist()) for x in pair]
    return [fields[k].item() for k in SPECIAL_FIELDS[:5]] + pairs


def test_special_token_statistics_match_a_plain_reference():
    ids = torch.tensor([[BOS, 3, 4, EOS, EOS, EOS], [EOS, 5, EOS, 6, EOS, EOS], [EOS, EOS, BOS, 2, 3, EOS]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]])  # right- and left-padded
    masked_by_id = ids.masked_fill(ids == EOS, -100)  # the pad == eos collator: every EOS masked
    shifted = torch.cat([ids[:, 1:], torch.full((3, 1), -100)], 1).masked_fill(
        torch.cat([mask[:, 1:], mask[:, :1] * 0], 1) == 0, -100
    )
    for labels in (masked_by_id, ids.masked_fill(mask == 0, -100), shifted):
        got = flat_special(special_token_statistics(ids, mask, labels, (EOS, BOS, PAD)))
        assert got == special_reference(ids, mask, labels, (EOS, BOS, PAD))
    by_position = flat_special(special_token_statistics(ids, mask, ids.masked_fill(mask == 0, -100), (EOS,)))
    # row 1 begins with an EOS used as BOS: not counted among the inputs; the padding EOS are not real tokens
    assert by_position[5:] == [4, 5]  # labels count wherever supervised, the first position too
    masked = special_token_statistics(ids, mask, masked_by_id, (EOS,))
    assert masked["in_inputs"].tolist() == [4] and masked["in_labels"].tolist() == [0]


def test_special_token_statistics_of_targets_that_do_not_align_with_the_inputs():
    sources = torch.tensor([[3, 4, EOS], [5, EOS, PAD]])
    targets = torch.tensor([[6, EOS, -100, -100], [3, 4, 5, EOS]])  # a decoder's labels: another width
    got = flat_special(special_token_statistics(sources, (sources != PAD).long(), targets, (EOS,)))
    assert got == [5, 6, 0, 0, 0, 2, 2]
    unaligned = flat_special(special_token_statistics(sources, None, sources, (EOS,), labels_aligned=False))
    assert unaligned[2:5] == [0, 0, 0] and unaligned[5:] == [2, 2]  # no mask: every position is real


def statistic_batches():
    """Batches for comparing the two paths of token_statistics: padding at either end, holes, packed rows with
    position ids, non-binary and boolean masks, ids and labels outside the vocabulary, labels of another shape."""
    g = torch.Generator().manual_seed(0)
    rows, width = 5, 8
    ids = torch.randint(0, 10, (rows, width), generator=g)
    lengths = torch.tensor([[8], [5], [1], [0], [3]])
    right = (torch.arange(width) < lengths).long()
    left = right.flip(1)
    holes = right.clone()
    holes[0, 3] = 0  # between real tokens
    holes[1, 0] = 0  # a row masked at both ends
    packed = torch.tensor([[1, 1, 0, 1, 1, 1, 0, 0]] * rows)
    positions = torch.tensor([[0, 1, 0, 0, 1, 2, 0, 0]] * rows)
    bad_ids = ids.clone()
    bad_ids[2, 4], bad_ids[4, 0] = 12, -3
    labels = ids.masked_fill(right == 0, IGN)
    bad_labels = labels.clone()
    bad_labels[3, 6] = 40
    for mask in (right, left, holes, packed, right.bool(), right.float() * 0.5 + right.float() * 0.5, None):
        for batch_ids in (ids, bad_ids):
            yield batch_ids, mask, labels, None
        yield ids, mask, bad_labels, None
        yield ids, mask, torch.tensor([3, IGN, 50]), None  # one class per row: not aligned
    yield ids, packed, labels, positions
    yield ids, torch.tensor([[0, 2, 1, 1, 0, 0, 1, 3]] * rows), labels, None  # not binary
    yield ids[0], right[0], labels[0], None  # one squeezed sequence


def test_the_host_read_path_of_token_statistics_gives_the_device_path_s_vector(monkeypatch):
    """On the CPU a few counts are read on the host to skip kernels; the no-sync path (every kernel, as on CUDA)
    must give the same vector on every kind of batch, and a healthy batch must skip the hole detail."""
    for ids, mask, labels, positions in statistic_batches():
        for options in ({}, {"vocab_size": 10, "bos_id": BOS, "eos_id": EOS, "max_length": 6}):
            kwargs = dict(ignore_index=IGN, position_ids=positions, **options)
            read = token_statistics(ids, mask, labels, host_reads=True, **kwargs)
            no_sync = token_statistics(ids, mask, labels, host_reads=False, **kwargs)
            assert read.dtype == no_sync.dtype == torch.float64
            assert read.tolist() == no_sync.tolist(), (ids, mask, labels, options)
            assert token_statistics(ids, mask, labels, **kwargs).tolist() == read.tolist()  # CPU: the host path
    s = unpack_statistics(token_statistics(*next(statistic_batches())[:3], host_reads=True).tolist())
    assert s["mask_holes"] == 0 and s["padding_id_min"] >= 0 and s["first_hole_row"] == -1
    searched = []
    original = torch.isin
    monkeypatch.setattr(torch, "isin", lambda *a, **k: searched.append(1) or original(*a, **k))
    ids, mask, labels, _ = next(statistic_batches())
    token_statistics(ids, mask, labels, vocab_size=10, ignore_index=IGN)
    assert not searched  # no row has a hole: the hole detail did not run
    holed = mask.clone()
    holed[0, 3] = 0
    assert unpack_statistics(token_statistics(ids, holed, labels, vocab_size=10).tolist())["mask_holes"] == 1
    assert searched


def test_the_no_sync_path_of_token_statistics_reads_nothing_on_the_host(monkeypatch):
    """``host_reads=False`` is the path taken on an accelerator: no value may be read on the host there (each read
    would wait for the device). Checked on the CPU by refusing every read while it runs."""
    batches = list(statistic_batches())

    def refuse(self, *args, **kwargs):
        raise AssertionError("a host read on the no-sync path")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    options = dict(vocab_size=10, bos_id=BOS, eos_id=EOS, max_length=6, ignore_index=IGN, host_reads=False)
    vectors = [token_statistics(ids, mask, labels, position_ids=p, **options) for ids, mask, labels, p in batches]
    monkeypatch.undo()
    assert len(vectors) == len(batches) and all(v.shape == vectors[0].shape for v in vectors)
