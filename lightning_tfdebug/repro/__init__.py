"""Repro bundles: what ReproCapture writes when training fails, and how to replay the failing step.

A bundle is a directory ``step<k>-rank<r>/`` of data only: ``bundle.json`` and ``.pt`` files that are read with
``torch.load(weights_only=True)`` after their checksum is verified (the files are listed in
``docs/callbacks/repro_capture.md``). A modified or truncated bundle raises :class:`BundleError`. Writing and reading
bundles: :mod:`~lightning_tfdebug.repro.bundles`; replaying one: :mod:`~lightning_tfdebug.repro.replay`.
"""

from lightning_tfdebug.repro.bundles import (
    BUNDLE_META,
    Bundle,
    BundleError,
    capture_rng,
    host_copy,
    host_rng_moved,
    load_bundle,
    restore_rng,
    run_first,
    run_info,
    share_host_copy,
    shared_host_copy,
    write_bundle,
)
from lightning_tfdebug.repro.replay import (
    ReplayResult,
    build_module,
    describe_exception,
    find_bundles,
    replay,
    replay_with_config,
)

__all__ = [
    "BUNDLE_META",
    "Bundle",
    "BundleError",
    "ReplayResult",
    "build_module",
    "capture_rng",
    "describe_exception",
    "find_bundles",
    "host_copy",
    "host_rng_moved",
    "load_bundle",
    "replay",
    "replay_with_config",
    "restore_rng",
    "run_first",
    "run_info",
    "share_host_copy",
    "shared_host_copy",
    "write_bundle",
]
