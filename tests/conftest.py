import os

import pytest
import torch

# Tiny models run fastest single-threaded, and the suite shares 2 cores with the distributed tests' processes.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The default run's heaviest files (seconds of one worker, `--durations` on a loaded 2-core machine): handed out first,
# so that no long file starts last and pins one worker while the other has gone idle (`--dist loadfile` runs a file
# on one worker). A file not listed weighs ~10 s per distributed (`ddp`) test it holds, and cheap files come last.
HEAVY_FILES: dict[str, float] = {
    "tests/test_fault_matrix.py": 280,
    "tests/test_docs_commands.py": 117,
    "tests/callbacks/test_per_rank_logger.py": 106,
    "tests/test_tfdebug.py": 45,
    "tests/test_report.py": 48,
    "tests/callbacks/test_throughput_monitor.py": 66,
    "tests/core/test_reduction.py": 63,
    "tests/core/test_base.py": 58,
    "tests/callbacks/test_nan_first_frame.py": 57,
    "tests/callbacks/test_update_ratio.py": 52,
    "tests/callbacks/test_optimizer_audit.py": 48,
    "tests/callbacks/loss_at_init/test_callback_transforms.py": 40,
    "tests/core/test_distributed.py": 36,
    "tests/callbacks/loss_at_init/test_callback_baselines.py": 36,
    "tests/test_collectives.py": 35,
    "tests/test_model_shapes.py": 21,
    "tests/test_compile.py": 17,
    "tests/test_non_interference.py": 16,
    "tests/test_replay.py": 14,
    "tests/test_bad_input.py": 10,
}


def pytest_configure(config):
    # pytest-xdist (>= 3.6) otherwise hands out files by their number of tests, most first: the few-test files that
    # each start real processes (the fault matrix, the docs' commands) came last and ran alone at the end. Keep the
    # order `pytest_collection_modifyitems` sets (heaviest first) instead.
    if getattr(config.option, "loadscopereorder", None):
        config.option.loadscopereorder = False


def _file_weights(items) -> dict[str, float]:
    weights: dict[str, float] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if path in HEAVY_FILES:
            weights[path] = HEAVY_FILES[path]
        else:
            weights[path] = weights.get(path, 0.0) + (10.0 if "ddp" in item.keywords else 0.0)
    return weights


@pytest.hookimpl(trylast=True)  # after `-m` has deselected: weigh what runs
def pytest_collection_modifyitems(config, items):
    weights = _file_weights(items)
    # stable: a file's own tests keep their order (and their module-scoped fixtures), files go heaviest first
    items.sort(key=lambda item: -weights[item.nodeid.split("::", 1)[0]])
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
