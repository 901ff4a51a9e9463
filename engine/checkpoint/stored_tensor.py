"""One tensor of a checkpoint as the file stores it: a GGUF's quantised blocks or plain float values, read only
when asked. Its users take it in one of two forms: `to_float()` (the eager path, one tensor at a time) or
`blocks()` (the native packing, which repacks the file's own grid without a float copy)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class StoredTensor:
    shape: tuple[int, ...]  # torch order: [out_features, in_features] for a linear
    type_name: str  # a GGML type name ("Q4_K", "Q8_0", "F32", ...); folders give F32 / F16 / BF16
    _read: Callable[[], np.ndarray | torch.Tensor]  # [rows, bytes per row] uint8 blocks, or the float values
    _release: Callable[[], None] | None = None  # drops the file's pages of this tensor from our memory
    _read_rows: Callable[[int, int], np.ndarray | torch.Tensor] | None = None  # rows [start, end) alone

    @property
    def is_quantized(self) -> bool:
        return self.type_name not in FLOAT_TYPES

    @property
    def ggml_type(self) -> GGMLQuantizationType:
        return GGMLQuantizationType[self.type_name]

    @property
    def block_size(self) -> int:
        """Weights per block along the last dimension (1 for float tensors)."""
        return GGML_QUANT_SIZES[self.ggml_type][0] if self.is_quantized else 1

    def blocks(self) -> np.ndarray:
        """The quantised rows as stored: uint8 [rows, K / block_size * bytes per block] (a view of the file)."""
        if not self.is_quantized:
            raise ValueError(f"a {self.type_name} tensor has no blocks")
        return self._read()

    def row_slice(self, start: int, end: int) -> StoredTensor:
        """Rows [start, end) of a 2-D tensor, as a view (quantised blocks never span rows)."""
        if self._read_rows is not None:
            return StoredTensor((end - start, *self.shape[1:]), self.type_name, lambda: self._read_rows(start, end))
        return StoredTensor((end - start, *self.shape[1:]), self.type_name, lambda: self._read()[start:end])

    def release(self) -> None:
        """Done with this tensor: its pages of a mapped file leave this process's memory (the page cache keeps
        them), so a load holds at most one tensor of the file besides what it built."""
        if self._release is not None:
            self._release()

    def to_float(self) -> torch.Tensor:
        """The values as float32, dequantised by the gguf package for quantised tensors (a new tensor)."""
        data = self._read()
        if self.is_quantized:
            return torch.from_numpy(dequantize(data, self.ggml_type).reshape(self.shape))
        if isinstance(data, np.ndarray):
            if self.type_name == "BF16":
                return torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16).float().reshape(self.shape)
            return torch.from_numpy(np.array(data, dtype=np.float32)).reshape(self.shape)
        return data.float().reshape(self.shape)


def permuted_rows(tensor: StoredTensor, order: np.ndarray) -> StoredTensor:
    """The same tensor with its rows (dim 0) taken in `order`: exact in any format, since a quantised block never
    spans two rows."""

    def read() -> np.ndarray | torch.Tensor:
        data = tensor._read()
        rows = data.reshape(tensor.shape[0], -1)
        return rows[order] if isinstance(rows, np.ndarray) else rows[torch.from_numpy(order)]

    return StoredTensor(tensor.shape, tensor.type_name, read, tensor._release)


def type_counts(tensors: Mapping[str, StoredTensor]) -> Counter[str]:
    """How many tensors of each stored type a checkpoint holds."""
    return Counter(t.type_name for t in tensors.values())
