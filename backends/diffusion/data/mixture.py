"""Several datasets read as one (--dataset_config): each sample's run-wide index, identity and dataset.

The datasets' rows are numbered one after the other in the config's order: the first dataset's rows keep their own
numbers, so a config of one dataset numbers its samples as `--dataset_base_path` does, and a dataset added at the
end leaves the others' numbers (and with them their samples' seeded draws) as they were.

A sample's identity (`sample_id`) is its row and files, as in one dataset; for a dataset that gives its own value of
a setting that shapes its entries (a size, the frames of a clip, its file columns), that value is part of the
identity too: the same image in two datasets of different sizes is two samples with two cache entries, never one id
naming both.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from .dataset import DiffusionDataset


class DatasetMixture:
    """`DiffusionDataset`'s interface over several named datasets, by run-wide index."""

    def __init__(self, parts: list[tuple[Optional[str], DiffusionDataset, dict[str, Any]]], source: str,
                 held_out: bool = False):
        """`parts`: (name, dataset, what its samples' identity adds: its own shaping values, or {}) in the config's
        order (a name of None: the run's one dataset, --dataset_base_path); `source`: the config file, named by
        messages about the whole; `held_out`: the last part is --validation_dataset's, whose samples are cached
        apart from the training samples (from index `held_out_from` on)."""
        self.parts = parts
        self.names = [name for name, _, _ in parts]
        self.offsets: list[int] = []
        total = 0
        for _, dataset, _ in parts:
            self.offsets.append(total)
            total += len(dataset)
        self.total = total
        self.held_out_from = self.offsets[-1] if held_out else total
        self.metadata_path = Path(source)
        self._salts = [json.dumps(salt, sort_keys=True) if salt else "" for _, _, salt in parts]

    def __len__(self) -> int:
        return self.total

    def locate(self, index: int) -> tuple[int, int]:
        """(the dataset's position in the config, the sample's row in its metadata, from 0)."""
        if not 0 <= index < self.total:
            raise IndexError(index)
        k = bisect.bisect_right(self.offsets, index) - 1
        return k, index - self.offsets[k]

    def name_of(self, index: int) -> Optional[str]:
        return self.names[self.locate(index)[0]]

    def where(self, index: int) -> str:
        """The sample's place in words: its dataset and metadata row."""
        k, row = self.locate(index)
        return f"dataset {self.names[k]!r} metadata row {row + 1}" if self.names[k] else f"metadata row {row + 1}"

    def _part(self, index: int) -> tuple[DiffusionDataset, int]:
        k, row = self.locate(index)
        return self.parts[k][1], row

    def sample_id(self, index: int, file_digest: Optional[Callable[[Path], str]] = None) -> str:
        k, row = self.locate(index)
        base = self.parts[k][1].sample_id(row, file_digest)
        if not self._salts[k]:
            return base
        return hashlib.sha256(f"{base}\0{self._salts[k]}".encode("utf-8")).hexdigest()

    def key_inputs(self, index: int, params: Iterable[str], file_digest: Optional[Callable[[Path], str]] = None
                   ) -> dict[str, Any]:
        dataset, row = self._part(index)
        return dataset.key_inputs(row, params, file_digest)

    def files(self, index: int) -> dict[str, list[Path]]:
        dataset, row = self._part(index)
        return dataset.files(row)

    def check(self, index: int) -> None:
        dataset, row = self._part(index)
        dataset.check(row)

    def sample(self, index: int) -> dict[str, Any]:
        dataset, row = self._part(index)
        return dataset.sample(row)
