"""The admin load's path fields (``path``, ``worker_path``): a value no file system takes is a
400 that names the field, before anything looks at the disk (a NUL byte is Python's
``ValueError``, an over-long path or name the OS's ``ENAMETOOLONG``: neither may become a 500).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from pantheon import errors
from pantheon.errors import ApiError

if TYPE_CHECKING:
    from pantheon.api.auth import Guard

PATH_MAX = 4096  # bytes, Linux's limit for a whole path
NAME_MAX = 255  # bytes, for one component


def check_path_field(field: str, value: str) -> None:
    """400 naming ``field`` unless ``value`` is a path the OS could take."""
    if "\x00" in value:
        raise errors.invalid_param(field, f"'{field}' must not contain a NUL character")
    try:
        raw = os.fsencode(value)
    except UnicodeError:
        raise errors.invalid_param(field, f"'{field}' is not a valid path (its characters)") from None
    if len(raw) >= PATH_MAX:
        raise errors.invalid_param(field, f"'{field}' is too long (at most {PATH_MAX - 1} bytes)")
    if any(len(part) > NAME_MAX for part in raw.split(b"/")):
        raise errors.invalid_param(field, f"'{field}' has a name longer than {NAME_MAX} bytes")


def check_root(guard: Guard, field: str, value: str) -> None:
    """The ``--models-dir`` rule for ``field`` (403 naming it; the message is the same whether
    or not anything exists at ``value``)."""
    try:
        guard.check_model_path(value)
    except ApiError as e:
        if e.param == field:
            raise
        raise errors.renamed(e, field) from None
