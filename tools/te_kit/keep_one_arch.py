"""Zero every CUDA binary in a shared library's fatbin except those for one GPU architecture.

Transformer Engine's core library (``libtransformer_engine.so``, 463 MB) carries SASS and
PTX for sm_75 ... sm_120; 349 MB of that is for GPUs the H200 test machine is not. Zeroing
those payloads keeps the ELF and every fatbin header intact (same offsets, same sizes, the
driver still sees each entry), but the file then compresses from 179 MB to ~20 MB, which
fits one device call's 64 MiB carry next to the rest of the kit.

The CUDA driver loads, per module, only the entry whose architecture matches the device, so
the zeroed entries are never read on that GPU. On any other GPU the stripped library fails
to load kernels: it is a test-machine artefact, never a release.

Fatbin layout (little endian), as written by nvcc / fatbinary:
    container header  u32 magic 0xBA55ED50, u16 version, u16 header_size, u64 body_size
    entry header      u16 kind (1 PTX, 2 ELF), u16, u32 header_size, u64 payload_size,
                      u32, u32, u16 minor, u16 major, u32 arch (e.g. 90), ...
    payload           payload_size bytes, right after the entry header
"""

from __future__ import annotations

import argparse
import struct
import subprocess
from collections import Counter

FATBIN_MAGIC = 0xBA55ED50
_CONTAINER = struct.Struct("<IHHQ")
_ENTRY = struct.Struct("<HHIQIIHHI")


def fatbin_section(path: str) -> tuple[int, int]:
    """(file offset, size) of the ``.nv_fatbin`` section, read with binutils' readelf."""
    table = subprocess.run(["readelf", "-S", "-W", path], check=True, capture_output=True,
                           text=True).stdout
    for line in table.splitlines():
        if ".nv_fatbin" in line:
            fields = line.split("]", 1)[1].split()
            return int(fields[3], 16), int(fields[4], 16)
    raise ValueError(f"{path} has no .nv_fatbin section")


def keep_one_arch(image: bytearray, start: int, size: int, arch: int) -> Counter:
    """Zero, in place, the payload of every fatbin entry in image[start:start+size] whose
    architecture is not ``arch``. Refuses (ValueError) when a container has no ELF entry for
    ``arch``: that code would then have nothing to run on the target GPU. Returns the bytes
    kept and zeroed per (kind, arch)."""
    stats: Counter = Counter()
    pos, end = start, start + size
    while pos + _CONTAINER.size <= end:
        magic, _, header_size, body_size = _CONTAINER.unpack_from(image, pos)
        if magic != FATBIN_MAGIC:  # containers are 8-byte aligned with zero padding
            pos += 8
            continue
        entry, body_end = pos + header_size, pos + header_size + body_size
        entries = []
        while entry < body_end:
            kind, _, entry_header, payload, *_, entry_arch = _ENTRY.unpack_from(image, entry)
            entries.append((kind, entry_arch, entry + entry_header, payload))
            entry += entry_header + payload
        if not any(kind == 2 and a == arch for kind, a, _, _ in entries):
            raise ValueError(f"fatbin container at offset {pos:#x} has no sm_{arch} ELF; "
                             "stripping would leave its kernels unrunnable")
        for kind, entry_arch, payload_at, payload in entries:
            if entry_arch == arch:
                stats["kept"] += payload
            else:
                image[payload_at:payload_at + payload] = bytes(payload)
                stats["zeroed"] += payload
        pos = body_end
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--arch", type=int, default=90, help="SM version to keep (90 = Hopper)")
    args = parser.parse_args()
    start, size = fatbin_section(args.src)
    with open(args.src, "rb") as f:
        image = bytearray(f.read())
    stats = keep_one_arch(image, start, size, args.arch)
    with open(args.dst, "wb") as f:
        f.write(image)
    print(f"{args.dst}: kept {stats['kept'] >> 20} MiB for sm_{args.arch}, "
          f"zeroed {stats['zeroed'] >> 20} MiB")


if __name__ == "__main__":
    main()
