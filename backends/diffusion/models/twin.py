"""The safetensors twin of a pickled model file: its tensors, written once beside it, read instead of it ever after.

Some releases keep a model as a `torch.save` pickle (JoyAI-Image's DiT and VAE `.pth`, ACE-Step's silence latent
`.pt`). DiffSynth's loader reads such a file with `torch.load`; unitgraph never unpickles a model file while it runs:
it reads `NAME.safetensors` beside `NAME.pth` (the twin) and, when there is none, names the command that writes it
(`unitgraph twin FILE`). That command is the one place a pickle is opened, because the user asked for it, and then
only through torch's weights-only unpickler, which builds tensors and containers and nothing else.

The twin holds what DiffSynth's `load_state_dict_from_bin` would hand its models: a flat state dict, unwrapped from a
one-key `state_dict`, `module` or `model_state` container as that function unwraps it; a file holding one bare tensor
keeps it under the file's stem (`silence_latent.pt` -> `silence_latent`). Key names and shapes are kept, so DiffSynth's
table knows the twin by the same key hash as the pickle. Tensors that share storage are written as copies
(safetensors stores no aliasing), the rest as they are, and the twin appears only once complete (a temporary file
beside it, renamed).

>>> twin_path(Path("transformer/transformer.pth"))
PosixPath('transformer/transformer.safetensors')
>>> is_pickled(Path("a.safetensors")), is_pickled(Path("model.ckpt"))
(False, True)
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from unitgraph.atomic import TEMP_SUFFIX

from ..errors import BackendError

__all__ = ["PICKLED", "flat_tensors", "is_pickled", "twin_command", "twin_path", "write_twin"]

PICKLED = (".pth", ".pt", ".bin", ".ckpt")  # the suffixes torch.save files are released under
_WRAPPERS = ("state_dict", "module", "model_state")  # the one-key containers DiffSynth's loader unwraps


def is_pickled(path: Path) -> bool:
    """Whether `path` names a torch.save file by its suffix."""
    return path.suffix in PICKLED


def twin_path(path: Path) -> Path:
    """Where the twin of `path` is kept: `NAME.safetensors` beside it."""
    return path.with_suffix(".safetensors")


def twin_command(path: Path) -> str:
    """The command that writes the twin of `path`, for the one line that asks for it."""
    quoted = str(path) if " " not in str(path) else f"'{path}'"
    return f"unitgraph twin {quoted}"


def flat_tensors(loaded: Any, stem: str, source: str) -> dict[str, Any]:
    """{name: tensor} of what torch.load returned: a state dict (unwrapped as DiffSynth unwraps it) or one tensor
    (named `stem`). Anything else is one line naming what it holds.

    >>> import torch
    >>> sorted(flat_tensors({"state_dict": {"w": torch.zeros(1)}}, "x", "x.pth"))
    ['w']
    >>> list(flat_tensors(torch.zeros(2), "silence_latent", "s.pt"))
    ['silence_latent']
    >>> flat_tensors({"w": torch.zeros(1), "step": 3}, "x", "x.pth")
    Traceback (most recent call last):
    ...
    unitgraph.backends.diffusion.errors.BackendError: x.pth: holds 'step', a int, where a state dict holds tensors only
    """
    import torch

    if isinstance(loaded, torch.Tensor):
        return {stem: loaded}
    if not isinstance(loaded, dict):
        raise BackendError(f"holds a {type(loaded).__name__}, not a state dict or a tensor", source=source)
    if len(loaded) == 1 and next(iter(loaded)) in _WRAPPERS and isinstance(next(iter(loaded.values())), dict):
        loaded = next(iter(loaded.values()))
    for key, value in loaded.items():
        if not isinstance(key, str):
            raise BackendError(f"holds a key {key!r:.40} that is not a name, where a state dict has names",
                               source=source)
        if not isinstance(value, torch.Tensor):
            raise BackendError(f"holds {key!r:.60}, a {type(value).__name__}, where a state dict holds tensors only",
                               source=source)
    if not loaded:
        raise BackendError("holds no tensor", source=source)
    return dict(loaded)


def _storable(tensors: dict[str, Any]) -> dict[str, Any]:
    """`tensors` as safetensors stores them: each contiguous, and those sharing storage with an earlier one copied."""
    seen: set[tuple[Any, int]] = set()
    out = {}
    for name, value in tensors.items():
        value = value.detach()
        where = (value.device.type, value.untyped_storage().data_ptr()) if value.numel() else None
        if where is not None and where in seen:
            value = value.clone()
        elif where is not None:
            seen.add(where)
        out[name] = value.contiguous()
    return out


def _load(path: Path) -> Any:
    """torch's weights-only load of `path`, memory-mapped where the file allows it (a 30 GB DiT is not read at
    once); one line when it is not a file torch's weights-only unpickler reads."""
    import warnings

    import torch

    warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)  # not a problem
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as exc:
        if "mmap" not in str(exc) and "zipfile" not in str(exc).lower():
            problem = exc
        else:  # a file in torch's legacy (pre-zip) format cannot be mapped: read it whole
            try:
                return torch.load(path, map_location="cpu", weights_only=True)
            except Exception as again:  # torch raises many types for files it cannot read
                problem = again
    except Exception as exc:  # torch raises many types (UnpicklingError, EOFError, ...) for files it cannot read
        problem = exc
    first = (str(problem).strip().splitlines() or [type(problem).__name__])[0]
    raise BackendError(f"not a file torch's weights-only loader reads ({type(problem).__name__}: {first[:200]})",
                       source=str(path))


def write_twin(path: "str | Path") -> tuple[Path, int]:
    """Write the twin of the pickled model file `path` (see the module docstring); return it and its tensor count.
    An existing twin is never overwritten, and a failure leaves nothing behind."""
    from safetensors.torch import save_file

    path = Path(path)
    if not is_pickled(path):
        raise BackendError(f"not a pickled model file (its suffix is not one of {', '.join(PICKLED)})",
                           source=str(path))
    if not path.is_file():
        raise BackendError("file not found" if not path.exists() else "not a file", source=str(path))
    target = twin_path(path)
    if target.exists() or target.is_symlink():
        raise BackendError("its safetensors twin exists already (remove it to write it again)", source=str(target))
    tensors = _storable(flat_tensors(_load(path), path.stem, str(path)))
    temp = ""
    try:
        handle, temp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=TEMP_SUFFIX, dir=target.parent)
        os.close(handle)
        save_file(tensors, temp, metadata={"format": "pt"})
        os.replace(temp, target)
    except OSError as exc:
        raise BackendError(f"cannot write the twin ({exc.strerror or exc})", source=str(target)) from None
    finally:
        if temp and os.path.exists(temp):
            os.unlink(temp)
    return target, len(tensors)
