"""Saved pipelines and the hub, checked before and after a load: one-line ``ModelLoadError`` where diffusers would
load something else than asked (a folder whose components or weights are missing, a ``model_index.json`` naming
another family's pipeline, a config.json its weights do not cover) or take a minute to say the hub is unreachable.

``svd.load_svd`` and ``video.load_video`` call these; ``who`` in each names the loader in the message.
"""
from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import socket
import types
import typing
import urllib.parse
from pathlib import Path
from typing import Any

import huggingface_hub
import torch
from safetensors import SafetensorError, safe_open

from .names import BUILTIN_MODELS, is_hub_id

__all__ = ["ModelLoadError", "check_local_folder", "check_weights", "index_problem", "check_weights_cover",
           "state_dict_error", "cached_snapshot", "hub_unreachable"]


class ModelLoadError(OSError):
    """A pipeline that cannot be loaded, with what happened and what to do (``load_svd``)."""


def check_local_folder(model: str, who: str = "load_svd", left_out: tuple[str, ...] = ()) -> Path | None:
    """The folder ``model`` names, checked to hold a saved pipeline; ``None`` for a hub id.

    Every component folder its ``model_index.json`` lists must be there (those named ``left_out``: the
    video pipelines' tokenizers and text encoders, never loaded, need not), and a model component's folder (one
    holding a ``config.json``) must hold its safetensors weights; the error names the component's folder.
    ``who``: the loader that says so."""
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"{who}: model={model!r} is a file; expected a pipeline folder or a hub id")
        index = path / "model_index.json"
        if not index.is_file():
            raise ModelLoadError(f"{who}: folder model={model!r} has no model_index.json; expected a folder written "
                                 "by a pipeline's save_pretrained()")
        try:
            components = json.loads(index.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{who}: {index} is not valid JSON ({exc}); save the pipeline again") from exc
        if not isinstance(components, dict):
            raise ModelLoadError(f"{who}: {index} holds no JSON object; save the pipeline again")
        listed = [name for name, entry in components.items() if not name.startswith(("_", *left_out))
                  and isinstance(entry, list) and entry and entry[0] is not None]
        missing = sorted(name for name in listed if not (path / name).is_dir())
        if missing:
            raise ModelLoadError(f"{who}: folder model={model!r} lacks the component folder(s) {missing} that its "
                                 "model_index.json lists; save the pipeline again with save_pretrained()")
        unweighted = sorted(str(path / name) for name in listed
                            if (path / name / "config.json").is_file() and not any((path / name).glob("*.safetensors")))
        if unweighted:
            raise ModelLoadError(f"{who}: component folder {unweighted[0]} holds no .safetensors weights (its "
                                 "config.json says it is a model); save the pipeline again with save_pretrained()")
        return path
    if not is_hub_id(model):
        raise ModelLoadError(f"{who}: no such folder model={model!r}, and not a hub id 'org/name' nor a built-in "
                             f"model ({', '.join(BUILTIN_MODELS)})")
    return None


def check_weights(folder: Path, fix: str, who: str = "load_svd") -> None:
    """Open the header of every safetensors file under ``folder``: a corrupt or truncated one is named."""
    for file in sorted(folder.rglob("*.safetensors")):
        try:
            with safe_open(file, framework="pt"):
                pass
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{who}: weight file {file} is corrupt or truncated ({exc}); {fix}") from exc


def _library_class(library: str, name: str) -> type | None:
    """The class ``name`` of the module ``library`` (a ``model_index.json`` entry), or ``None``."""
    try:
        found = getattr(importlib.import_module(library), name, None)
    except ImportError:
        return None
    return found if isinstance(found, type) else None


def _module_classes(annotation: Any) -> tuple[type, ...]:
    """The ``torch.nn.Module`` classes a pipeline's ``__init__`` annotation names (a class, its name as a string
    in diffusers or transformers, or a union of them); ``()`` for anything else (schedulers, processors)."""
    if isinstance(annotation, str):
        annotation = next((found for library in ("diffusers", "transformers")
                           if (found := _library_class(library, annotation)) is not None), None)
    members = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return tuple(m for m in members if isinstance(m, type) and issubclass(m, torch.nn.Module))


def index_problem(index: dict[str, Any], pipeline: type, left_out: tuple[str, ...] = ()) -> str | None:
    """Why the components a ``model_index.json`` lists cannot make ``pipeline`` (a model component of another
    class than the one ``pipeline`` takes there, as when the index names another family's pipeline; a required
    component missing), or ``None``.  Components named ``left_out`` are not checked (never loaded)."""
    for name, param in inspect.signature(pipeline.__init__).parameters.items():
        if name == "self" or name.startswith(left_out) or param.kind is not param.POSITIONAL_OR_KEYWORD:
            continue
        entry = index.get(name)
        if not (isinstance(entry, list) and len(entry) == 2 and entry[0] is not None):
            if param.default is inspect.Parameter.empty:
                return f"its model_index.json lists no component {name!r}, which {pipeline.__name__} takes"
            continue
        expected = _module_classes(param.annotation)
        if not expected:
            continue
        found = _library_class(*map(str, entry))
        if found is None or not issubclass(found, expected):
            return (f"its component {name!r} is {entry[1]} ({entry[0]}), but {pipeline.__name__} takes "
                    f"{' or '.join(c.__name__ for c in expected)} there: model_index.json names another family's "
                    "pipeline, or holds another model's components")
    return None


def _weight_dtypes(folder: Path) -> dict[str, str]:
    """The tensor names stored in the safetensors files of one component folder, each with its safetensors dtype
    (``F32``, ``BF16``, ``I32``, ``BOOL``, ...; headers only)."""
    dtypes: dict[str, str] = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(file, framework="pt") as handle:
            dtypes.update({key: handle.get_slice(key).get_dtype() for key in handle.keys()})
    return dtypes


_INTEGER = re.compile(r"BOOL|U?I\d+")
"""safetensors dtypes of integers and booleans (``I32``, ``U8``, ``BOOL``, ...)."""
_DTYPE_NAMES = {"BOOL": "bool", **{f"I{bits}": f"int{bits}" for bits in (8, 16, 32, 64)},
                **{f"U{bits}": f"uint{bits}" for bits in (8, 16, 32, 64)}}


def _key_list(keys: list[str]) -> str:
    return ", ".join(keys[:3]) + (f", ... ({len(keys)} in all)" if len(keys) > 3 else "")


def check_weights_cover(pipe: Any, root: Path, who: str = "load_svd") -> None:
    """Refuse (``ModelLoadError``) a loaded pipeline where a model component's weights in ``root/<component>``
    do not hold exactly its state dict: a tensor its ``config.json`` makes but the weights lack would run
    randomly initialised (diffusers only logs "newly initialized"), one the weights hold but the model lacks
    is silently dropped, one stored as integers where the model holds floats (int32 weights) was cast silently.
    Tensors a model class declares ignorable (``_keys_to_ignore_on_load_missing`` /
    ``_unexpected``) and tied copies of a stored tensor are not counted."""
    for name, module in pipe.components.items():
        folder = root / name
        if not isinstance(module, torch.nn.Module) or not folder.is_dir():
            continue
        stored = _weight_dtypes(folder)
        if not stored:
            continue
        state = module.state_dict()
        integer = sorted(key for key, dtype in stored.items()
                         if _INTEGER.fullmatch(dtype) and key in state and state[key].is_floating_point())
        if integer:
            kinds = ", ".join(sorted({_DTYPE_NAMES.get(stored[key], stored[key]) for key in integer}))
            raise ModelLoadError(f"{who}: component folder {folder}: {len(integer)} tensor(s) in the weights are "
                                 f"integers ({kinds}) where the model holds floating-point values "
                                 f"({_key_list(integer)}): not this model's weights; save the pipeline again with "
                                 "save_pretrained()")
        present = {ptr for key, tensor in state.items() if key in stored and (ptr := tensor.data_ptr())}  # not meta

        def ignored(key: str, kind: str) -> bool:
            patterns = getattr(module, f"_keys_to_ignore_on_load_{kind}", None) or ()
            return any(re.search(pattern, key) for pattern in patterns)

        missing = sorted(key for key, tensor in state.items() if key not in stored and not ignored(key, "missing")
                         and tensor.data_ptr() not in present)
        unexpected = sorted(key for key in stored if key not in state and not ignored(key, "unexpected"))
        if missing or unexpected:
            what = "; ".join(part for part in (
                missing and f"{len(missing)} tensor(s) its config.json makes are missing from the weights "
                            f"({_key_list(missing)}) and would run randomly initialised",
                unexpected and f"{len(unexpected)} tensor(s) in the weights are not in the model its config.json "
                               f"makes ({_key_list(unexpected)})") if part)
            raise ModelLoadError(f"{who}: component folder {folder}: config.json and weights disagree: {what}; save "
                                 "the pipeline again with save_pretrained(), or restore the config.json it was "
                                 "saved with")


def state_dict_error(who: str, model: str, exc: RuntimeError) -> ModelLoadError | None:
    """The one-line ``ModelLoadError`` of diffusers' ``Error(s) in loading state_dict for X: size mismatch ...`` (a
    component's config.json makes tensors of other shapes than its weights hold), from its first two lines; ``None``
    for any other ``RuntimeError``."""
    lines = str(exc).splitlines()
    if not lines or not lines[0].startswith("Error(s) in loading state_dict"):
        return None
    mismatch = " ".join(line.strip().rstrip(".") for line in lines[:2])
    return ModelLoadError(f"{who}: model={model!r}: a component's config.json and weights disagree ({mismatch}); "
                          "save the pipeline again with save_pretrained()")


def cached_snapshot(model: str) -> Path | None:
    """The local Hugging Face cache's snapshot folder of hub id ``model``, or ``None`` when not cached."""
    found = huggingface_hub.try_to_load_from_cache(model, "model_index.json")
    return Path(found).parent if isinstance(found, str) else None


_HUB_PROBE_SECONDS = 5.0
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
_unreachable: dict[str, str | None] = {}


def hub_unreachable() -> str | None:
    """Why the Hugging Face hub's endpoint cannot be reached from here (``"gaierror: [Errno -2] Name or service not
    known"``: a TCP connection to it, ``_HUB_PROBE_SECONDS`` at most, once per process), or ``None``.

    Asked before a hub id that is not in the cache is downloaded: huggingface_hub retries every request five times,
    1 + 2 + 4 + 8 + 8 s apart, logging each retry, so an offline machine answered after 33-80 s of retries.  Behind a
    proxy (``HTTPS_PROXY`` and the like) the probe is skipped (``None``): the proxy may reach what this host cannot."""
    endpoint = huggingface_hub.constants.ENDPOINT
    if endpoint not in _unreachable:
        url = urllib.parse.urlsplit(endpoint)
        why = None
        if not any(os.environ.get(name) for name in _PROXY_VARIABLES) and url.hostname:
            try:
                socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                         timeout=_HUB_PROBE_SECONDS).close()
            except OSError as exc:
                why = f"{type(exc).__name__}: {exc}"
        _unreachable[endpoint] = why
    return _unreachable[endpoint]
