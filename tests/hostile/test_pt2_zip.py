"""A `.pt2` that Python's `zipfile` and torch's archive reader could read differently is refused before torch
loads it (folder/zip_check.py, folder/trust.py `checked_pt2`): one line, exit 1, on `k3x run --backend pt2`
and `k3x verify`, and the payload (a pickle that writes a marker file when unpickled) never runs.

Each archive is rebuilt from the session's real export by `_craft`, a minimal stored-zip writer that can list
a name twice, cut it with NUL, put a record inside another, or declare a size the file does not have; the
manifest is then rehashed, as an attacker who controls the folder would."""

from __future__ import annotations

import json
import os
import pickle
import struct
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from hostile_util import Payload, k3x, rehash

ROOT = b"archive/"
WEIGHTS_CONFIG = "data/weights/model_weights_config.json"
CONSTANTS_CONFIG = "data/constants/model_constants_config.json"
SAMPLE_INPUTS = "data/sample_inputs/model.pt"


def _records(pt2: Path) -> list[tuple[bytes, bytes]]:
    with zipfile.ZipFile(pt2) as z:
        return [(i.filename.encode(), z.read(i)) for i in z.infolist()]


def _craft(pt2: Path, entries: list, *, trailer: bytes = b"") -> None:
    """Write `entries` ((name, data) or (name, data, options)) as a stored zip. Options: `local` (the local
    header's name), `size` (declared size), `inside` (no record of its own: the central entry points at the
    data of entry number `inside`)."""
    out, central, data_at = bytearray(), bytearray(), []
    for name, data, *opt in entries:
        opt = opt[0] if opt else {}
        crc, size = zlib.crc32(data), opt.get("size", len(data))
        if "inside" in opt:
            offset = data_at[opt["inside"]]
        else:
            offset, local = len(out), opt.get("local", name)
            out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0x21, crc, size, size, len(local), 0)
            out += local + data
        data_at.append(offset + 30 + len(name))
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0x21, crc, size, size, len(name),
                               0, 0, 0, 0, 0, offset) + name
    start, n = len(out), len(entries)
    pt2.write_bytes(bytes(out + central + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, len(central), start, 0))
                    + trailer)


def _pickled_config(records: list, rel: str, marker: Path) -> tuple[bytes, list]:
    """A hostile copy of a payload config marking one entry pickled, and the record holding the pickle."""
    poison = pickle.dumps(Payload(marker))
    if rel == WEIGHTS_CONFIG:
        cfg = json.loads(dict(records)[ROOT + rel.encode()])
        cfg["config"][next(iter(cfg["config"]))].update(use_pickle=True, path_name="weight_9999")
        return json.dumps(cfg).encode(), [(ROOT + b"data/weights/weight_9999", poison)]
    cfg = {"config": {"evil": {"path_name": "tensor_9999", "is_param": False, "use_pickle": True, "tensor_meta": None}}}
    return json.dumps(cfg).encode(), [(ROOT + b"data/constants/tensor_9999", poison)]


def _refused(export_dir: Path, marker: Path, reason: str) -> None:
    rehash(export_dir, "pt2")  # the attacker rewrites the manifest too: the sha256 check alone cannot help
    for args in (("run", export_dir, "--backend", "pt2", "--max-new-tokens", "2"),
                 ("verify", export_dir, "--backends", "pt2", "--steps", "1")):
        code, out = k3x(*args)
        assert not marker.exists(), f"the payload ran: {out}"
        assert code == 1 and reason in out and "Traceback" not in out and len(out.strip().splitlines()) == 1, out


@pytest.mark.parametrize("rel", [WEIGHTS_CONFIG, SAMPLE_INPUTS, CONSTANTS_CONFIG])
def test_a_name_listed_twice_is_refused(export_dir, tmp_path, rel):
    """Benign copy last (zipfile's pick), hostile copies before it, as many as make torch's binary search of the
    sorted central directory land on one: shown below, then refused."""
    marker, pt2 = tmp_path / "marker", export_dir / "model.pt2"
    records = _records(pt2)
    name = ROOT + rel.encode()
    hostile, extra = (pickle.dumps(Payload(marker)), []) if rel == SAMPLE_INPUTS else \
        _pickled_config(records, rel, marker)
    for copies in range(1, 8):
        _craft(pt2, [r for r in records if r[0] != name] + extra + [(name, hostile)] * copies + [(name, dict(records)[name])])
        with zipfile.ZipFile(pt2) as z:
            zipfile_reads = z.read(name.decode())
        if zipfile_reads != hostile and torch._C.PyTorchFileReader(str(pt2)).get_record(rel) == hostile:
            break
    else:
        pytest.fail("no layout made the two readers disagree")
    _refused(export_dir, marker, "listed twice in the central directory")


def _nul(records, marker):  # zipfile cuts the name at NUL (and keeps the benign copy), torch reads the hostile one
    hostile, extra = _pickled_config(records, WEIGHTS_CONFIG, marker)
    name = ROOT + WEIGHTS_CONFIG.encode()
    return [r for r in records if r[0] != name] + extra + [(name, hostile), (name + b"\0x", dict(records)[name])]


def _non_utf8(records, marker):
    return records + [(ROOT + b"data/weights/mod\x82l_weights_config.json", dict(records)[ROOT + WEIGHTS_CONFIG.encode()])]


def _case(records, marker):  # torch finds names case-insensitively
    return records + [(ROOT + b"data/weights/MODEL_weights_config.json", dict(records)[ROOT + WEIGHTS_CONFIG.encode()])]


def _overlap(records, marker):  # a record hidden in the data of another, listed in the central directory only
    hidden = ROOT + b"data/weights/weight_9999"
    poison = pickle.dumps(Payload(marker))
    carrier = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0x21, zlib.crc32(poison), len(poison), len(poison),
                          len(hidden), 0) + hidden + poison
    return records + [(ROOT + b"data/weights/weight_9998", carrier), (hidden, poison, {"inside": len(records)})]


def _huge(records, marker):
    name = ROOT + WEIGHTS_CONFIG.encode()
    return [(n, d, {"size": 0xFFFFFF00}) if n == name else (n, d) for n, d in records]


def _mismatch(records, marker):
    name = ROOT + WEIGHTS_CONFIG.encode()
    return [(n, d, {"local": name[:-1] + b"N"}) if n == name else (n, d) for n, d in records]


@pytest.mark.parametrize("layout,reason", [
    (_nul, "not printable ASCII"),
    (_non_utf8, "not printable ASCII"),
    (_case, "only by case"),
    (_overlap, "records overlap"),
    (_huge, "declared size 4294967040 runs past the end of the records"),
    (_mismatch, "does not match the central directory"),
])
def test_layouts_two_readers_could_read_differently_are_refused(export_dir, tmp_path, layout, reason):
    marker, pt2 = tmp_path / "marker", export_dir / "model.pt2"
    _craft(pt2, layout(_records(pt2), marker))
    _refused(export_dir, marker, reason)


def test_bytes_after_the_end_record_are_refused(export_dir, tmp_path):
    pt2 = export_dir / "model.pt2"
    _craft(pt2, _records(pt2), trailer=b"PK\x05\x06 and more")
    _refused(export_dir, tmp_path / "marker", "not the last 22 bytes")


def test_the_checked_file_is_the_file_loaded(export_dir, tmp_path):
    """The path swapped for a hostile archive after the check: the load reads the open, checked file."""
    from k3x.exporter.trace import load_pt2
    from k3x.folder.trust import checked_pt2

    marker, pt2 = tmp_path / "marker", export_dir / "model.pt2"
    records = _records(pt2)
    hostile, extra = _pickled_config(records, WEIGHTS_CONFIG, marker)
    swap = tmp_path / "hostile.pt2"
    _craft(swap, [(n, hostile if n == ROOT + WEIGHTS_CONFIG.encode() else d) for n, d in records] + extra)
    with checked_pt2(pt2) as f:
        os.replace(swap, pt2)
        ep = load_pt2(f)
    assert not marker.exists() and len(ep.state_dict) > 0


def test_a_file_written_to_while_it_is_loaded_is_refused(export_dir):
    from k3x.folder.trust import UnsafeArtifactError, checked_pt2

    with pytest.raises(UnsafeArtifactError, match="changed while it was being loaded"):
        with checked_pt2(export_dir / "model.pt2"):
            with open(export_dir / "model.pt2", "ab") as f:
                f.write(b"x")


def test_a_valid_pt2_still_loads_and_runs(export_dir):
    code, out = k3x("run", export_dir, "--backend", "pt2", "--max-new-tokens", "2")
    assert code == 0, out


def _zipfile_bytes(write, *, prefix: bytes = b"") -> bytes:
    import io

    buf = io.BytesIO()
    buf.write(prefix)
    with zipfile.ZipFile(buf, "w") as z:
        write(z)
    return buf.getvalue()


def _entry() -> zipfile.ZipInfo:
    """a/x.json dated 1980-01-01 (ZipInfo's default): `writestr` with a bare name stamps the current time, and
    bytes that change with the clock made pytest-xdist's workers collect different test ids."""
    return zipfile.ZipInfo("a/x.json")


def _unknown_extra(z):
    info = _entry()
    info.extra = struct.pack("<HHB", 0x5455, 1, 0)  # an extended timestamp: other readers act on such fields
    z.writestr(info, b"{}")


CASES = [
    (_zipfile_bytes(lambda z: setattr(z, "comment", b"PK\x05\x06")), "not the last 22 bytes"),
    (_zipfile_bytes(lambda z: z.writestr(_entry(), b"{}" * 99, zipfile.ZIP_DEFLATED)), "compressed"),
    (_zipfile_bytes(_unknown_extra), "extra field 0x5455"),
    (_zipfile_bytes(lambda z: z.writestr(_entry(), b"{}"), prefix=b"junk"), "local header at byte 4, expected 0"),
    (_zipfile_bytes(lambda z: z.writestr(_entry(), b"{}"))[:-30], "end-of-central-directory"),
]


@pytest.mark.parametrize("data,reason", CASES, ids=[reason for _, reason in CASES])
def test_zip_structures_the_parser_refuses(data, reason):
    from k3x.folder.zip_check import ZipLayoutError, read_layout

    with pytest.raises(ZipLayoutError, match=reason):
        read_layout(lambda at, n: data[at:at + n], len(data))


def test_the_parser_finds_the_records_zipfile_finds(export_dir):
    """On the real export (zip64 end records, data descriptors, torch's padding fields) both agree exactly."""
    from k3x.folder.zip_check import read_layout

    data = (export_dir / "model.pt2").read_bytes()
    records = read_layout(lambda at, n: data[at:at + n], len(data))
    with zipfile.ZipFile(export_dir / "model.pt2") as z:
        assert [(r.name, r.header, r.size) for r in records] == \
            [(i.filename, i.header_offset, i.file_size) for i in z.infolist()]
