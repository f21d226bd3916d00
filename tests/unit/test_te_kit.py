"""tools/te_kit/keep_one_arch.py on a synthetic fatbin (the real one is 440 MB)."""

import struct

import pytest

from tools.te_kit.keep_one_arch import FATBIN_MAGIC, keep_one_arch


def _entry(kind: int, arch: int, payload: bytes) -> bytes:
    header = struct.pack("<HHIQIIHHI", kind, 0, 64, len(payload), 0, 0, 0, 0, arch)
    return header.ljust(64, b"\0") + payload


def _container(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, len(body)) + body


def test_zeroes_other_architectures_and_keeps_layout():
    blob = (_container(_entry(2, 80, b"A" * 40), _entry(2, 90, b"B" * 24), _entry(1, 90, b"P" * 8))
            + b"\0" * 8  # alignment padding between containers
            + _container(_entry(2, 90, b"C" * 16), _entry(2, 100, b"D" * 32)))
    image = bytearray(b"ELF-prefix" + blob + b"suffix")
    stats = keep_one_arch(image, 10, len(blob), arch=90)
    assert len(image) == len(blob) + 16
    assert image.count(b"A") == 0 and image.count(b"D") == 0
    assert b"B" * 24 in image and b"C" * 16 in image and b"P" * 8 in image
    assert image.startswith(b"ELF-prefix") and image.endswith(b"suffix")
    assert stats == {"kept": 48, "zeroed": 72}


def test_refuses_a_container_without_the_architecture():
    blob = _container(_entry(2, 80, b"A" * 8))
    with pytest.raises(ValueError, match="no sm_90 ELF"):
        keep_one_arch(bytearray(blob), 0, len(blob), arch=90)
