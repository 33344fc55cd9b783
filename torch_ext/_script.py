"""Python faces of torch.classes objects.

The C++ classes are registered once, with torch::class_ (csrc/torch_ext/<capability>/library.cpp):
that registration is what TorchScript, C++ programs and Python all call. A Python face adds only
what Python needs on top (paths as os.PathLike, Python-only helpers) and hands every other
attribute (methods and properties) to the torch.classes object it holds as `script_object`,
which is also what scripted code takes.
"""
from __future__ import annotations

import re
from typing import Any

import torch


class ScriptObjectFace:
    """Attributes this class does not define are those of `self.script_object`."""

    script_object: torch.ScriptObject

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found on the face itself.
        try:
            script_object = self.__dict__["script_object"]
        except KeyError:
            raise AttributeError(name) from None
        return getattr(script_object, name)

    def __repr__(self) -> str:
        return repr(self.__dict__.get("script_object", type(self).__name__))


# torch's message for a keyword whose value does not match the constructor's schema (it goes on to
# print the whole schema).
_SCHEMA_MISMATCH = re.compile(r"Expected a value of type '(?P<expected>.+?)' for argument '(?P<name>\w+)' "
                              r"but instead found type '(?P<found>.+?)'")


def construct(owner: str, cls: Any, *args: Any, **options: Any) -> torch.ScriptObject:
    """cls(*args, **options) for a torch.classes class; an option of the wrong type raises a
    TypeError that names it, its type and the value given."""
    try:
        return cls(*args, **options)
    except RuntimeError as error:
        mismatch = _SCHEMA_MISMATCH.search(str(error))
        if mismatch is None or mismatch["name"] not in options:
            raise
        name = mismatch["name"]
        raise TypeError(f"{owner}: option {name} takes {mismatch['expected']}, got {options[name]!r} "
                        f"({mismatch['found']})") from None
