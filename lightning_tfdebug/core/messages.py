"""How the pack's warnings read: ``lightning_tfdebug: [TFD220] ERROR ...``, not a line of the pack's own source.

A plain ``warnings.warn`` inside a callback is shown as ``.../lightning_tfdebug/core/base.py:249: TFDebugWarning: ...``:
a location in our code that tells the user nothing. :func:`pack_warning` issues the warning as coming from the
pack itself (``warnings.warn_explicit`` with the pack's name as file and module), so it

* reads ``lightning_tfdebug: <text>`` (the rendering of those warnings only is replaced; every other warning is
  formatted as before);
* stays filterable by category (``warnings.filterwarnings("ignore", category=TFDebugWarning)``, ``-W``, pytest's
  ``filterwarnings``) and by module (``module="lightning_tfdebug"``).
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
    """Warn ``text`` (of ``category``) as the pack: shown as ``lightning_tfdebug: <text>``.

    The pack de-duplicates its own warnings (once per finding code); every call here is shown unless a filter says
    otherwise.
    """
    _install_format()
    warnings.warn_explicit(text, category, filename=PACK, lineno=_LINENO, module=PACK, registry={})
