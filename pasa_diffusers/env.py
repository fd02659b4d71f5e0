"""Environment flags, read one way everywhere: ``flag(name)``.

A flag is on for ``1``, ``true``, ``yes``, ``on`` or ``y`` and off for ``0``, ``false``, ``no``, ``off``, ``n`` or
the empty string, in any case; unset, it takes its default.  These are Triton 3's words for ``TRITON_INTERPRET``
(its ``getenv_bool``: ``1``/``true``/``yes``/``on``/``y`` turn the interpreter on, anything else leaves it off),
so the package and Triton agree on whether the interpreter runs.  Any other value (``2``, ``enabled``, `` 1``)
is refused with ``EnvFlagError`` naming the variable, where Triton would take it silently as off.
This module imports nothing heavy: the command line reads its flags before torch is imported.
"""
from __future__ import annotations

import os

__all__ = ["EnvFlagError", "ON", "OFF", "flag"]

ON = ("1", "true", "yes", "on", "y")
"""The values (any case) that turn a flag on."""
OFF = ("0", "false", "no", "off", "n", "")
"""The values (any case) that turn a flag off."""


class EnvFlagError(ValueError):
    """An environment flag set to a value that is neither on nor off; the message names it and the values taken."""


def flag(name: str, default: bool = False) -> bool:
    """Whether the environment variable ``name`` is on (module docstring); ``default`` when it is unset.

    Raises ``EnvFlagError`` for a value that is neither on nor off."""
    value = os.environ.get(name)
    if value is None:
        return default
    if value.lower() in ON:
        return True
    if value.lower() in OFF:
        return False
    raise EnvFlagError(f"environment variable {name}={value!r}: expected one of {', '.join(ON)} (on) or "
                       f"{', '.join(v or repr(v) for v in OFF)} (off)")
