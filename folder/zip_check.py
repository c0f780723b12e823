"""A `.pt2`'s zip structure read strictly, so that every zip reader resolves it alike, and the archive frozen as
checked for the one load that follows.

Python's `zipfile` and torch's reader (miniz, inside `PyTorchFileReader`) find a record differently: zipfile keeps
the last of two same-named central-directory entries and cuts a name at NUL; miniz binary-searches the sorted
central directory, case-insensitively, and reads names as C strings. An archive is accepted here only when no
such choice arises (`read_layout`):

- the end record sits at the very end (no comment), its zip64 record and locator (if any) right before it, and
  every field they share agrees; the central directory ends where they start, and holds exactly the declared
  entries;
- names are printable ASCII (no NUL, no non-UTF-8, no space), unique even ignoring case;
- records are stored (no compression, no encryption), only the zip64 and torch padding ("FB") extra fields,
  local header and central entry agree (name, flags, CRC, sizes), a data descriptor carries its signature;
- the local records lie back to back from offset 0 in central-directory order, the central directory right
  after the last one: nothing before, between, inside or after them that the directory does not list, and a
  declared size that runs past the records' area is refused.

Every refusal is a `ZipLayoutError` naming the entry and the reason.

`FrozenArchive` is the file as checked: it holds the open file (never re-opened by path) and serves every byte
from a copy taken when it was checked, except the ranges the caller marks "live" (raw tensor bytes, read from
the held file on demand, never parsed or unpickled), so what torch parses later is what was checked.
"""

from __future__ import annotations

import io
import os
import struct
from dataclasses import dataclass
from typing import Callable

_EOCD = struct.Struct("<IHHHHIIH")  # sig, disk, cd disk, entries on disk, entries, cd size, cd offset, comment
_LOCATOR = struct.Struct("<IIQI")  # sig, disk of the zip64 end record, its offset, disks
_EOCD64 = struct.Struct("<IQHHIIQQQQ")  # sig, record size, made by, needed, disk, cd disk, entries x2, size, offset
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_ZIP64, _PADDING = 0x0001, 0x4246  # the extra fields torch (and zipfile) write: zip64 sizes, "FB" alignment
_DESCRIPTOR = 0x08074B50
_M16, _M32 = 0xFFFF, 0xFFFFFFFF
_ENCRYPTED, _HAS_DESCRIPTOR = 0x1, 0x8


class ZipLayoutError(ValueError):
    """An archive two zip readers could read differently; the message names the entry and the reason."""


@dataclass(frozen=True)
class Record:
    """One stored record: its name, local header offset, data range and end (after any data descriptor)."""

    name: str
    header: int
    data: int
    size: int
    end: int


Pread = Callable[[int, int], bytes]


def _read(pread: Pread, offset: int, n: int, what: str) -> bytes:
    data = pread(offset, n)
    if len(data) != n:
        raise ZipLayoutError(f"{what}: truncated at byte {offset}")
    return data


def _extras(raw: bytes, where: str) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    pos = 0
    while pos < len(raw):
        if pos + 4 > len(raw):
            raise ZipLayoutError(f"{where}: extra field truncated")
        key, n = struct.unpack_from("<HH", raw, pos)
        if key not in (_ZIP64, _PADDING) or key in out or pos + 4 + n > len(raw):
            raise ZipLayoutError(f"{where}: extra field 0x{key:04x} unexpected, repeated or truncated")
        out[key] = raw[pos + 4:pos + 4 + n]
        pos += 4 + n
    return out


def _zip64(values: list[int], marks: list[int], extra: dict[int, bytes], where: str) -> list[int]:
    """`values` with each field equal to its mark taken, in order, from the zip64 extra field (exactly those)."""
    marked = [i for i, (v, m) in enumerate(zip(values, marks)) if v == m]
    got = extra.get(_ZIP64)
    if (got is None and marked) or (got is not None and len(got) != 8 * len(marked)):
        raise ZipLayoutError(f"{where}: zip64 extra field does not match the fields marked for it")
    out = list(values)
    for k, i in enumerate(marked):
        out[i] = struct.unpack_from("<Q", got, 8 * k)[0]
    return out


def _name(raw: bytes, seen: dict[str, str]) -> str:
    if not raw or any(b < 0x21 or b > 0x7E for b in raw):
        raise ZipLayoutError(f"entry {raw[:80]!r}: name is not printable ASCII (NUL, non-UTF-8, control or space "
                             "bytes are read differently by different zip readers)")
    name = raw.decode("ascii")
    other = seen.get(name.lower())
    if other == name:
        raise ZipLayoutError(f"entry {name!r}: listed twice in the central directory")
    if other is not None:
        raise ZipLayoutError(f"entry {name!r}: differs from entry {other!r} only by case (torch finds names "
                             "case-insensitively)")
    seen[name.lower()] = name
    return name


def _directory(pread: Pread, size: int) -> tuple[int, int, int]:
    """(entries, central directory offset, its end) from the end records, which must close the file."""
    if size < _EOCD.size:
        raise ZipLayoutError("not a zip archive: too short for an end-of-central-directory record")
    eocd = size - _EOCD.size
    sig, disk, cd_disk, n_disk, n, cd_size, cd_off, comment = _EOCD.unpack(_read(pread, eocd, _EOCD.size, "end record"))
    if sig != 0x06054B50 or comment:
        raise ZipLayoutError("end-of-central-directory record is not the last 22 bytes (an archive comment, "
                             "trailing data, or not a zip)")
    if disk or cd_disk or n_disk != n:
        raise ZipLayoutError("end-of-central-directory record: multi-disk archives are refused")
    end = eocd
    if eocd >= _LOCATOR.size and pread(eocd - _LOCATOR.size, 4) == struct.pack("<I", 0x07064B50):
        _, zdisk, at, disks = _LOCATOR.unpack(_read(pread, eocd - _LOCATOR.size, _LOCATOR.size, "zip64 locator"))
        end = eocd - _LOCATOR.size - _EOCD64.size
        if zdisk or disks != 1 or at != end or end < 0:
            raise ZipLayoutError("zip64 locator: the zip64 end record is not right before it")
        sig, rec, _, _, disk, cd_disk, n_disk, n64, size64, off64 = _EOCD64.unpack(
            _read(pread, end, _EOCD64.size, "zip64 end record"))
        if sig != 0x06064B50 or rec != _EOCD64.size - 12 or disk or cd_disk or n_disk != n64:
            raise ZipLayoutError("zip64 end record: malformed, multi-disk or with extensible data")
        for field, small, big, mark in (("entries", n, n64, _M16), ("size", cd_size, size64, _M32),
                                        ("offset", cd_off, off64, _M32)):
            if small not in (big, mark):
                raise ZipLayoutError(f"end records disagree on the central directory {field} ({small} != {big})")
        n, cd_size, cd_off = n64, size64, off64
    if cd_off + cd_size != end:
        raise ZipLayoutError(f"central directory at {cd_off} (+{cd_size} bytes) does not end where the end "
                             f"records start ({end}): data before, inside or after it")
    return n, cd_off, end


def _central(pread: Pread, n: int, cd_off: int, end: int) -> list[tuple[str, bytes, int, int, int, int]]:
    """(name, raw name, flags, crc, size, local header offset) per central entry, in order."""
    table = _read(pread, cd_off, end - cd_off, "central directory")
    out, seen, pos = [], {}, 0
    for i in range(n):
        if pos + _CENTRAL.size > len(table):
            raise ZipLayoutError(f"central directory: entry {i} runs past its end ({n} entries declared)")
        (sig, _, _, flags, method, _, _, crc, csize, usize, nlen, elen, clen, disk, _, _,
         offset) = _CENTRAL.unpack_from(table, pos)
        raw = table[pos + _CENTRAL.size:pos + _CENTRAL.size + nlen]
        if sig != 0x02014B50 or len(raw) != nlen:
            raise ZipLayoutError(f"central directory: entry {i} is malformed")
        name = _name(raw, seen)
        where = f"entry {name!r}"
        extra = _extras(table[pos + _CENTRAL.size + nlen:pos + _CENTRAL.size + nlen + elen], where)
        usize, csize, offset = _zip64([usize, csize, offset], [_M32] * 3, extra, where)
        if method or flags & _ENCRYPTED or csize != usize or clen or disk:
            raise ZipLayoutError(f"{where}: compressed, encrypted, commented or on another disk (k3x archives "
                                 "are stored records)")
        out.append((name, raw, flags, crc, usize, offset))
        pos += _CENTRAL.size + nlen + elen
    if pos != len(table):
        raise ZipLayoutError(f"central directory: {len(table) - pos} bytes after its {n} declared entries")
    return out


def _local(pread: Pread, entry: tuple[str, bytes, int, int, int, int], limit: int) -> Record:
    name, raw, flags, crc, size, header = entry
    where = f"entry {name!r}"
    sig, _, lflags, method, _, _, lcrc, lcsize, lusize, nlen, elen = _LOCAL.unpack(
        _read(pread, header, _LOCAL.size, where))
    lraw = pread(header + _LOCAL.size, nlen)
    if sig != 0x04034B50 or lraw != raw or lflags != flags or method:
        raise ZipLayoutError(f"{where}: its local header (name {lraw[:80]!r}) does not match the central directory")
    extra = _extras(_read(pread, header + _LOCAL.size + nlen, elen, where), where)
    if _ZIP64 in extra:  # a local zip64 field holds both sizes, both marked in the header
        if len(extra[_ZIP64]) != 16 or (lusize, lcsize) != (_M32, _M32):
            raise ZipLayoutError(f"{where}: local zip64 extra field malformed")
        lusize, lcsize = struct.unpack("<QQ", extra[_ZIP64])
    descriptor = bool(flags & _HAS_DESCRIPTOR)
    if (lcrc, lcsize, lusize) != (crc, size, size) and not (descriptor and (lcrc, lcsize, lusize) == (0, 0, 0)):
        raise ZipLayoutError(f"{where}: local header CRC/sizes differ from the central directory")
    data = header + _LOCAL.size + nlen + elen
    end = data + size
    if end > limit:
        raise ZipLayoutError(f"{where}: declared size {size} runs past the end of the records (byte {limit})")
    if descriptor:
        wide = _ZIP64 in extra
        fmt = "<IIQQ" if wide else "<IIII"
        got = struct.unpack(fmt, _read(pread, end, struct.calcsize(fmt), where))
        if got != (_DESCRIPTOR, crc, size, size):
            raise ZipLayoutError(f"{where}: data descriptor missing or differs from the central directory")
        end += struct.calcsize(fmt)
    return Record(name, header, data, size, end)


def read_layout(pread: Pread, size: int) -> list[Record]:
    """The archive's records, in file order, or a `ZipLayoutError` (module docstring for what is refused)."""
    n, cd_off, end = _directory(pread, size)
    records, cursor = [], 0
    for entry in _central(pread, n, cd_off, end):
        if entry[5] != cursor:
            raise ZipLayoutError(f"entry {entry[0]!r}: local header at byte {entry[5]}, expected {cursor} (records "
                                 "overlap, are out of order, or bytes between them are listed nowhere)")
        record = _local(pread, entry, cd_off)
        records.append(record)
        cursor = record.end
    if cursor != cd_off:
        raise ZipLayoutError(f"{cd_off - cursor} bytes between the last record and the central directory")
    return records


def _pread_all(fd: int, offset: int, n: int) -> bytes:
    """`n` bytes at `offset` of `fd` (fewer only at the end of the file)."""
    parts, done = [], 0
    while done < n:
        chunk = os.pread(fd, min(n - done, 1 << 30), offset + done)
        if not chunk:
            break
        parts.append(chunk)
        done += len(chunk)
    return b"".join(parts)


class FrozenArchive(io.RawIOBase):
    """A read-only, seekable view of the held file `fd`: bytes outside `live` ranges come from a copy taken now."""

    def __init__(self, fd: int, size: int, live: list[tuple[int, int]]) -> None:
        super().__init__()
        self.fd, self.size, self.pos = fd, size, 0
        self.parts: list[tuple[int, int, bytes | None]] = []  # (start, end, copy or None: live)
        cursor = 0
        for start, stop in sorted(live) + [(size, size)]:
            if start > cursor:
                self.parts.append((cursor, start, _pread_all(fd, cursor, start - cursor)))
            if stop > start:
                self.parts.append((start, stop, None))
            cursor = max(cursor, stop)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = max(0, {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + offset)
        return self.pos

    def pread(self, offset: int, n: int) -> bytes:
        buf = bytearray(max(0, min(n, self.size - offset)))
        return bytes(buf[:self._fill(memoryview(buf), offset)])

    def readinto(self, b) -> int:
        got = self._fill(memoryview(b).cast("B"), self.pos)
        self.pos += got
        return got

    def _fill(self, out: memoryview, offset: int) -> int:
        done = 0
        for start, stop, copy in self.parts:
            if done == len(out) or start >= offset + len(out):
                break
            if stop <= offset + done:
                continue
            at = offset + done
            n = min(stop, offset + len(out)) - at
            if copy is None:
                got = os.preadv(self.fd, [out[done:done + n]], at)
                done += got
                if got < n:  # the held file shrank: a short read, as a file gives
                    break
            else:
                out[done:done + n] = copy[at - start:at - start + n]
                done += n
        return done


def freeze(fd: int, size: int, live: Callable[[Record], bool]) -> tuple[FrozenArchive, list[Record]]:
    """The archive in `fd` checked (`read_layout`) and frozen: the data of records `live` selects is read from
    the file on demand, everything else (all the structure) from a copy that was checked again after copying."""
    records = read_layout(lambda at, n: _pread_all(fd, at, n), size)
    view = FrozenArchive(fd, size, [(r.data, r.data + r.size) for r in records if live(r)])
    if read_layout(view.pread, size) != records:
        raise ZipLayoutError("the archive changed while it was being read")
    return view, records
