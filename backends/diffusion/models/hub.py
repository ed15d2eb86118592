"""Where a model id (`--model_id_with_origin_paths "org/name:sub/pattern"`) is found, as DiffSynth-Studio finds it.

1. **DiffSynth's local layout**: `DIFFSYNTH_MODEL_BASE_PATH` (default `./models`) `/<org>/<name>/<pattern>`,
   where DiffSynth's own downloads land, so a DiffSynth user's models are found where they are.
2. **The modelscope cache** (`snapshot_download` with `local_files_only` when offline; `--modelscope_cache_dir`
   or modelscope's default cache).
3. **A download** through modelscope, unless offline. Before the first download of a run, one TCP connection to
   modelscope's endpoint (or the HTTPS proxy) is tried for at most a few seconds: with no network the run reads
   the cache only and a missing model stops it at once in one line, instead of after modelscope's retries (about
   25 s for each model id).

Offline means any of `DIFFSYNTH_SKIP_DOWNLOAD`, `UNITGRAPH_OFFLINE`, `MODELSCOPE_OFFLINE` or `HF_HUB_OFFLINE`
is set to a true value (read once, where the flags are parsed: `config.ModelConfig`). A model found nowhere
is one line saying where it was looked for and how to point at local files.
"""

from __future__ import annotations

import fnmatch
import os
import socket
from functools import lru_cache
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

OFFLINE_VARIABLES = ("DIFFSYNTH_SKIP_DOWNLOAD", "UNITGRAPH_OFFLINE", "MODELSCOPE_OFFLINE", "HF_HUB_OFFLINE")
BASE_PATH_VARIABLE = "DIFFSYNTH_MODEL_BASE_PATH"
DEFAULT_BASE_PATH = "./models"
PROBE_SECONDS = 3.0  # how long the network probe waits for modelscope's endpoint
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Hub:
    """How model ids resolve for one run: DiffSynth's local base folder, the modelscope cache, online or not."""

    base_path: Path = Path(DEFAULT_BASE_PATH)
    cache_dir: Optional[str] = None
    offline: bool = False
    offline_reason: str = ""  # the variable that made it offline, for messages

    @classmethod
    def from_env(cls, cache_dir: Optional[str] = None, environ: Optional[Mapping[str, str]] = None,
                 offline: Optional[bool] = None) -> "Hub":
        environ = os.environ if environ is None else environ
        reason = next((name for name in OFFLINE_VARIABLES if str(environ.get(name, "")).strip().lower() in _TRUE), "")
        return cls(base_path=Path(environ.get(BASE_PATH_VARIABLE) or DEFAULT_BASE_PATH), cache_dir=cache_dir,
                   offline=bool(reason) if offline is None else offline,
                   offline_reason=reason if offline is None else ("" if not offline else reason or "offline"))

    def local(self, model_id: str, pattern: str) -> Optional[Path]:
        """The folder of `pattern` under DiffSynth's local layout, when a file there matches it."""
        root = self.base_path / model_id
        sub = origin_subfolder(pattern)
        folder = root / sub if sub else root
        if not folder.is_dir():
            return None
        return folder if matches(root, folder, pattern) else None

    def found_locally(self, model_id: str, pattern: str) -> Optional[Path]:
        """The folder of `pattern` in DiffSynth's local layout or the modelscope cache, without any network
        lookup; None when neither holds it (a command naming several model ids tries every local copy before a
        download of any: each download that fails costs modelscope's retries)."""
        found = self.local(model_id, pattern)
        if found is not None:
            return found
        from dataclasses import replace

        try:
            return replace(self, offline=True, offline_reason="local files first").snapshot(model_id, pattern, _Missing)
        except _Missing:
            return None

    def snapshot(self, model_id: str, pattern: str, error: Any) -> Path:
        """The folder holding `pattern` of `model_id` (see the module docstring); `error(path, problem)` builds
        the exception for a model found nowhere."""
        found = self.local(model_id, pattern)
        if found is not None:
            return found
        label = f"{model_id}:{pattern}"
        sub = origin_subfolder(pattern)
        file_pattern = _from_root(pattern) + "*" if pattern.endswith("/") else _from_root(pattern)
        allow = [file_pattern, f"{sub}/*.json" if sub else "*.json"]
        looked = f"{self.base_path / model_id} ({BASE_PATH_VARIABLE})"
        cache = f"the modelscope cache {self.cache_dir}" if self.cache_dir else "the default modelscope cache"
        hint = (f"put the files at {self.base_path / model_id / (sub or '')} or pass --model_paths with the local folder")
        try:
            from modelscope import snapshot_download
        except ImportError as exc:  # pragma: no cover - modelscope is a backend dependency
            raise error(label, f"modelscope is not installed ({exc})") from None
        if not self.offline:
            unreachable = network_problem()
            if unreachable:  # the cache alone, at once, rather than modelscope's retries
                from dataclasses import replace

                return replace(self, offline=True, offline_reason=f"no network: {unreachable}").snapshot(
                    model_id, pattern, error)
        try:
            root = Path(snapshot_download(model_id, cache_dir=self.cache_dir, allow_patterns=allow,
                                          local_files_only=self.offline))
        except Exception as exc:  # modelscope raises several unrelated types here
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if self.offline:
                raise error(label, f"not found in {looked} nor in {cache} (offline: {self.offline_reason}); {hint}") from None
            raise error(label, f"not found in {looked} nor in {cache}, and the download failed ({type(exc).__name__}: "
                               f"{detail}); {hint}, or set DIFFSYNTH_SKIP_DOWNLOAD=True to never try the network") from None
        folder = root / sub if sub else root
        if not folder.is_dir():
            raise error(folder, f"modelscope:{label} has no folder {sub or '.'} in its snapshot")
        if not matches(root, folder, pattern):
            raise error(folder, f"modelscope:{label}: no file in the snapshot matches {file_pattern}")
        return folder


def network_problem() -> str:
    """Why modelscope cannot be reached from here ("" when a connection opened): the endpoint's host, or the
    HTTPS proxy's when one is set, is connected to for at most PROBE_SECONDS, once a process (a run that must
    download several model ids waits once). Asked only when no local copy was found."""
    from urllib.parse import urlsplit

    proxy = next((os.environ[name] for name in PROXY_VARIABLES if os.environ.get(name)), "")
    if proxy:
        target = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        default_port = 443 if target.scheme == "https" else 80
    else:
        try:
            from modelscope.hub.utils.utils import get_endpoint
            endpoint = get_endpoint()
        except Exception:  # pragma: no cover - an old or broken modelscope: let its download report
            return ""
        target = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
        default_port = 443 if target.scheme != "http" else 80
    return _unreachable(target.hostname or "", target.port or default_port)


@lru_cache(maxsize=8)
def _unreachable(host: str, port: int) -> str:
    if not host:
        return ""
    try:
        with socket.create_connection((host, port), timeout=PROBE_SECONDS):
            return ""
    except socket.gaierror:
        return f"cannot resolve {host}"
    except OSError as exc:
        return f"cannot connect to {host}:{port}: {exc.strerror or type(exc).__name__}"


def origin_subfolder(pattern: str) -> str:
    """'transformer/diffusion_pytorch_model*.safetensors' -> 'transformer'; 'x.safetensors' -> ''; a leading './'
    is the repository itself ('./': the whole repository, as DiffSynth's examples name a tokenizer kept at its root).

    >>> origin_subfolder("tokenizer/"), origin_subfolder("./"), origin_subfolder("./tokenizer/")
    ('tokenizer', '', 'tokenizer')
    """
    pattern = _from_root(pattern)
    head, sep, _ = pattern.partition("/")
    return head if sep else ""


def _from_root(pattern: str) -> str:
    while pattern.startswith("./"):
        pattern = pattern[2:]
    return pattern


def matches(root: Path, folder: Path, pattern: str) -> bool:
    pattern = _from_root(pattern)
    file_pattern = pattern + "*" if pattern.endswith("/") or not pattern else pattern
    return any(fnmatch.fnmatch(str(f.relative_to(root)), file_pattern) for f in folder.rglob("*") if f.is_file())


class _Missing(Exception):
    """A model found nowhere locally (found_locally's own signal)."""

    def __init__(self, where: Any, problem: str):
        super().__init__(f"{where}: {problem}")
