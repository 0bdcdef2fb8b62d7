"""ReproCapture's rules with plain values."""

import pytest

from lightning_tfdebug.functional.repro_checks import bundle_not_written, bundle_written


def written(**kwargs):
    args = dict(step=4, rank=1, in_batch=True, batch_saved=True, after_step=False)
    return bundle_written("/logs/repro/step4-rank1", "ValueError", **{**args, **kwargs})


def test_a_written_bundle_is_tfd130_with_its_path_and_the_replay_command():
    verdict = written()
    assert verdict.code == "TFD130" and verdict.severity is None and verdict.key == "/logs/repro/step4-rank1"
    assert verdict.message == (
        "Training failed with ValueError at step 4 (rank 1); a repro bundle was written to /logs/repro/step4-rank1."
    )
    assert verdict.evidence == {"bundle": "/logs/repro/step4-rank1", "exception": "ValueError"}
    assert verdict.hint == (
        "Replay the failing step: python -m lightning_tfdebug replay /logs/repro/step4-rank1 "
        "--config <your LightningCLI config>"
    )


@pytest.mark.parametrize(
    "kwargs, said",
    [
        (
            {"in_batch": False, "batch_saved": False},
            " It holds no batch (the exception came outside a training batch).",
        ),
        (
            {"batch_saved": False},
            " The batch could not be copied to the host (see bundle.json); it cannot be replayed.",
        ),
        ({"after_step": True}, " It came after that step's training_step and backward"),
    ],
)
def test_the_message_says_what_the_bundle_can_replay(kwargs, said):
    assert said in written(**kwargs).message


def test_a_bundle_that_could_not_be_written_is_tfd131():
    verdict = bundle_not_written("ValueError", "OSError: disk full", step=4, key="4:99")
    assert verdict.code == "TFD131" and verdict.key == "4:99" and verdict.evidence == {"error": "OSError: disk full"}
    assert verdict.message == "ReproCapture could not write a bundle for the ValueError at step 4: OSError: disk full"
