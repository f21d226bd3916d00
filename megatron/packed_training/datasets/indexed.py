"""Megatron-LM's indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``) as a packer's document source.

The files are what Megatron-LM's ``tools/preprocess_data.py`` and megatron-core's
``IndexedDatasetBuilder`` write; megatron-core's ``IndexedDataset`` reads them: the index
memory-mapped (12 bytes per sequence), the tokens by file reads of what a row needs, so a
rank's memory does not grow as it reads on. A document is
Megatron's: the sequences between two entries of the document index, back to back (one
sequence per document unless the data was split into sentences).

`check_indexed_prefix` reads the index header before megatron-core does, so a missing half, a
truncated or corrupt ``.idx`` or a ``.bin`` shorter than the index says is one ValueError naming
the file and the fix, not an assertion deep in the reader.
"""

import os
import struct

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
HEADER_BYTES = 34  # magic 9, version 8, dtype code 1, sequence count 8, document count 8
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
               6: np.float64, 7: np.float32, 8: np.uint16}  # megatron-core's DType
TOKEN_CODES = (1, 2, 3, 4, 5, 8)
REBUILD = ("Rebuild it with Megatron-LM's tools/preprocess_data.py (or megatron-core's "
           "IndexedDatasetBuilder)")


def check_indexed_prefix(prefix: str, flag: str = "--data-path") -> tuple[int, int, int]:
    """``(dtype code, sequences, documents)`` of the indexed dataset ``prefix``, after checking
    that both files exist and that their sizes agree with the index header; ValueError naming
    the file and the fix otherwise. Reads the 34-byte header and the file sizes only."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    for present, missing in ((idx, bin_), (bin_, idx)):
        if os.path.exists(present) and not os.path.exists(missing):
            raise ValueError(
                f"{flag} is wrong: {prefix!r} has {os.path.basename(present)} but no "
                f"{os.path.basename(missing)}. An indexed dataset is the pair PREFIX.bin + "
                f"PREFIX.idx: copy the missing file beside it. {REBUILD}.")
    size = os.path.getsize(idx)
    with open(idx, "rb") as stream:
        header = stream.read(HEADER_BYTES)
    if len(header) < HEADER_BYTES or header[:9] != INDEX_MAGIC:
        raise ValueError(f"{flag} is wrong: {idx} is not a Megatron-LM index (its header is "
                         f"{'cut short' if len(header) < HEADER_BYTES else 'not MMIDIDX'}). "
                         f"{REBUILD}.")
    version, code, sequences, documents = struct.unpack("<QBQQ", header[9:])
    if version != 1 or code not in TOKEN_CODES:
        raise ValueError(f"{flag} is wrong: {idx} has index version {version} and dtype code "
                         f"{code}; token ids need version 1 and an integer dtype. {REBUILD}.")
    expected = HEADER_BYTES + sequences * (4 + 8) + documents * 8
    if size not in (expected, expected + sequences):  # + one mode byte per sequence: multimodal
        raise ValueError(f"{flag} is wrong: {idx} is {size} bytes, but its header ({sequences} "
                         f"sequences, {documents - 1} documents) needs {expected}: the file is "
                         f"truncated or corrupt. {REBUILD}.")
    return code, sequences, documents


class IndexedSource:
    """Documents of one indexed dataset, read on demand through megatron-core's
    ``IndexedDataset`` (memory-mapped).

    Attributes:
        name: the prefix, as errors quote it.
        lengths: int64 ``[num_documents]``, tokens per document (host memory: 8 bytes each).
        loss_masks: a second indexed dataset of 0/1 ``uint8`` per token beside the tokens
            (the token cache's ``loss_mask`` files), or None: every token is a target.
        origins: ``(files, file_of, lines)``, the file (an index into ``files``) and line of
            each document (the token cache), or None; `origin` quotes them.
    """

    def __init__(self, prefix: str, flag: str = "--data-path", loss_mask_prefix: str | None = None,
                 origins: tuple | None = None):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        _, sequences, _ = check_indexed_prefix(prefix, flag)
        self.name = prefix
        self.origins = origins
        self.loss_masks = None
        self._files = {}  # (prefix, pid) -> descriptor of the .bin
        if sequences == 0:  # nothing to map (numpy cannot map an empty .bin)
            self.tokens, self.lengths = None, np.zeros(0, dtype=np.int64)
            return
        # The index only: tokens come by positioned reads (`_read`), not a mapping of the .bin
        # (rows gather documents from all over it; mapped pages, read-ahead included, would
        # count in every rank's memory as it reads on).
        self.tokens = IndexedDataset(prefix, mmap=False)
        bounds = np.asarray(self.tokens.document_indices, dtype=np.int64)
        sequence_lengths = np.asarray(self.tokens.sequence_lengths, dtype=np.int64)
        self._bounds = bounds
        self._one_sequence_each = bool(np.all(np.diff(bounds) == 1))
        if self._one_sequence_each:
            self.lengths = sequence_lengths
        else:
            ends = np.concatenate([[0], np.cumsum(sequence_lengths)])
            self.lengths = ends[bounds[1:]] - ends[bounds[:-1]]
        last = len(sequence_lengths) - 1
        if last >= 0:
            needed = int(self.tokens.index.sequence_pointers[last]) + int(
                sequence_lengths[last]) * np.dtype(self.tokens.index.dtype).itemsize
            if os.path.getsize(prefix + ".bin") < needed:
                raise ValueError(
                    f"{flag} is wrong: {prefix}.bin is {os.path.getsize(prefix + '.bin')} bytes, "
                    f"but its index points to {needed}: the file is truncated. {REBUILD}.")
        if loss_mask_prefix is not None:
            self.loss_masks = IndexedDataset(loss_mask_prefix, mmap=False)

    def __len__(self) -> int:
        return len(self.lengths)

    def origin(self, document: int) -> str:
        """How errors name ``document``: ``file:line`` for the token cache, else
        ``prefix document N``."""
        if self.origins is not None:
            files, file_of, lines = self.origins
            return f"{files[int(file_of[document])]}:{int(lines[document])}"
        return f"{self.name} document {document}"

    def _read(self, dataset, document: int, start: int, end: int) -> np.ndarray:
        """Tokens ``[start, end)`` of ``document``: one positioned read of the ``.bin`` (a
        document's sequences lie back to back there), on a descriptor kept per process."""
        index = dataset.index
        dtype = np.dtype(index.dtype)
        first = int(self._bounds[document]) if not self._one_sequence_each else document
        offset = int(index.sequence_pointers[first]) + start * dtype.itemsize
        key = (dataset.path_prefix, os.getpid())  # DataLoader workers fork: their own
        if key not in self._files:
            self._files[key] = os.open(dataset.path_prefix + ".bin", os.O_RDONLY)
        data = os.pread(self._files[key], (end - start) * dtype.itemsize, offset)
        return np.frombuffer(data, dtype=dtype)

    def read(self, document: int, start: int, end: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Tokens ``[start, end)`` of ``document`` (int64) and their loss mask (float32, or None:
        every token counts). Reads the files: no copy of the dataset is held."""
        ids = self._read(self.tokens, document, start, end).astype(np.int64)
        if self.loss_masks is None:
            return ids, None
        return ids, self._read(self.loss_masks, document, start, end).astype(np.float32)

    def check_token_ids(self, vocab_size: int, flag: str = "--data-path",
                        chunk: int = 1 << 26) -> None:
        """ValueError naming the first document holding a token id outside ``[0, vocab_size)``.
        Reads the ``.bin`` in chunks of ``chunk`` tokens (host memory: one chunk)."""
        if self.tokens is None:
            return
        dtype = np.dtype(self.tokens.index.dtype)
        with open(self.name + ".bin", "rb") as stream:
            start = 0
            while len(part := np.fromfile(stream, dtype=dtype, count=chunk)):
                if int(part.max()) >= vocab_size or int(part.min()) < 0:
                    break
                start += len(part)
            else:
                return
        bad = int(np.flatnonzero((part >= vocab_size) | (part < 0))[0])
        sequence = int(np.searchsorted(self.tokens.index.sequence_pointers // dtype.itemsize,
                                       start + bad, side="right")) - 1
        document = int(np.searchsorted(self._bounds, sequence, side="right")) - 1
        raise ValueError(
            f"{flag} is wrong: {self.origin(document)} holds token id {int(part[bad])}, not "
            f"below the vocabulary size {vocab_size}. Set --vocab-size (or the tokenizer flags) "
            f"to the tokenizer the data was written with.")
