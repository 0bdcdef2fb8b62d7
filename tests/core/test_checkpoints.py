import pickle
from types import SimpleNamespace

import pytest
import torch

from lightning_tfdebug.core.checkpoints import DamagedCheckpoint, load_checkpoint, read_sharded, resumable_savers


class NotData:  # an object `torch.load(weights_only=True)` refuses
    pass


def test_a_data_only_file_is_read_without_running_code(tmp_path):
    path = tmp_path / "w.ckpt"
    torch.save({"state_dict": {"w": torch.ones(3)}, "global_step": 4}, path)
    checkpoint, weights_only = load_checkpoint(str(path), written_by_this_run=False)
    assert weights_only and checkpoint["global_step"] == 4 and checkpoint["state_dict"]["w"].tolist() == [1, 1, 1]


def test_objects_are_unpickled_only_from_a_file_this_run_wrote(tmp_path):
    path = tmp_path / "o.ckpt"
    torch.save({"hparams": NotData(), "global_step": 1}, path)
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(str(path), written_by_this_run=False)
    checkpoint, weights_only = load_checkpoint(str(path), written_by_this_run=True)
    assert not weights_only and isinstance(checkpoint["hparams"], NotData)


@pytest.mark.parametrize("content", [b"", b"not a zip archive at all", None])
def test_an_empty_or_cut_file_is_a_damaged_checkpoint_with_its_verdict(tmp_path, content):
    path = tmp_path / "bad.ckpt"
    if content is None:  # a real checkpoint cut in half
        torch.save({"w": torch.ones(1000)}, path)
        content = path.read_bytes()[: path.stat().st_size // 2]
    path.write_bytes(content)
    with pytest.raises(DamagedCheckpoint) as caught:
        load_checkpoint(str(path), written_by_this_run=True)
    assert caught.value.verdict.code == "TFD716" and str(len(content)) in caught.value.verdict.message


def test_the_savers_a_run_can_resume_from():
    savers = [
        SimpleNamespace(save_weights_only=True, save_top_k=1, dirpath="/w"),
        SimpleNamespace(save_weights_only=False, save_top_k=0, save_last=False, dirpath="/none"),
        SimpleNamespace(save_weights_only=False, save_top_k=0, save_last=True, dirpath="/last"),
        SimpleNamespace(save_weights_only=False, save_top_k=2, dirpath=None),
    ]
    assert resumable_savers(savers) == ["SimpleNamespace(/last)", "SimpleNamespace"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_directory_is_read_from_its_metadata_and_file_sizes(tmp_path):
    import torch.distributed.checkpoint as dcp

    assert not read_sharded(str(tmp_path)).has_metadata
    dcp.save({"w": torch.ones(64)}, checkpoint_id=str(tmp_path / "ok"))
    reading = read_sharded(str(tmp_path / "ok"))
    assert reading.has_metadata and reading.metadata_error is None and reading.needed
    assert all(reading.sizes[name] >= end for name, end in reading.needed.items())
    shard = next(iter(reading.needed))
    (tmp_path / "ok" / shard).unlink()
    assert read_sharded(str(tmp_path / "ok")).sizes[shard] is None
    (tmp_path / "ok" / ".metadata").write_bytes(b"cut")
    broken = read_sharded(str(tmp_path / "ok"))
    assert broken.metadata_error is not None and broken.metadata_bytes == 3
