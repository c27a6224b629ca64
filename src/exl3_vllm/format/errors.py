"""The one exception type every malformed-input path raises."""

from __future__ import annotations

from typing import Callable

# Set inside a serving process (plugin.register): each error is reported once, in one line, as it is raised,
# before whatever traceback the host prints around it.
on_raise: Callable[[str], None] | None = None
_reported: set[str] = set()


class Exl3FormatError(ValueError):
    """A checkpoint, tensor or argument that does not follow the EXL3 format.

    The message always names what is wrong, where (file and tensor when known)
    and what to do about it.
    """

    def __init__(self, what: str, *, file: str | None = None, tensor: str | None = None,
                 fix: str | None = None):
        self.what = what
        self.file = file
        self.tensor = tensor
        self.fix = fix
        parts = []
        if file:
            parts.append(f"{file}")
        if tensor:
            parts.append(f"tensor '{tensor}'")
        where = ": ".join(parts)
        msg = f"{where}: {what}" if where else what
        if fix:
            msg += f" ({fix})"
        super().__init__(msg)
        if on_raise is not None and msg not in _reported:
            _reported.add(msg)
            on_raise(msg)
