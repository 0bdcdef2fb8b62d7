"""How the pack's warnings read: ``lightning_tfdebug: [TFD220] ERROR ...``, not a line of the pack's own source.

:func:`pack_warning` issues the warning as coming from the pack itself (``warnings.warn_explicit`` with the pack's
name as file and module): only those warnings render differently, and they stay filterable by category and module.
"""

from __future__ import annotations

import warnings

PACK = "lightning_tfdebug"
_LINENO = 0  # no source line: the warning comes from the pack, not from a line of it


def _is_ours(filename: str, lineno: int | None) -> bool:
    return filename == PACK and lineno == _LINENO


def _install_format() -> None:
    """Wrap ``warnings.formatwarning`` once so that the pack's warnings read ``lightning_tfdebug: <text>``."""
    current = warnings.formatwarning
    if getattr(current, "_tfdebug", False):
        return

    def formatwarning(
        message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
    ) -> str:
        if _is_ours(filename, lineno):
            return f"{PACK}: {message}\n"
        return current(message, category, filename, lineno, line)

    formatwarning._tfdebug = True  # type: ignore[attr-defined]
    warnings.formatwarning = formatwarning


def pack_warning(text: str, category: type[Warning]) -> None:
    """Warn ``text`` (of ``category``) as the pack, shown as ``lightning_tfdebug: <text>`` (never de-duplicated
    here: the caller does that)."""
    _install_format()
    warnings.warn_explicit(text, category, filename=PACK, lineno=_LINENO, module=PACK, registry={})
