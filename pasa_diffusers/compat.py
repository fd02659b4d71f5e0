"""Every private API of diffusers and Triton this package calls, in one place, with the versions it was read from.

The rest of the package calls these functions, never the private names themselves; when a new diffusers or
Triton release moves one of them, this file is the one to change (and pyproject.toml's pins with it).
"""
from __future__ import annotations
