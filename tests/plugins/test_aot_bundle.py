"""The kernels a plugin serialises into an engine are compressed (every plugin instance carries its own copy):
the bundle is smaller than its cubins and still unpacks to the same kernels; a raw bundle (engines built
before) still unpacks."""

from __future__ import annotations

import json
import struct

import pytest

from k3x.custom_ops.trt_plugins import specs
from k3x.plugins import aot
from k3x.plugins.adapter import compile_plan
from k3x.plugins.core import PluginError



def test_bundle_is_compressed_and_old_bundles_still_read():
    spec = specs()["AttnRes"]
    dims = dict(R=4, N=2, d=32)
    ks = compile_plan(spec, spec.plan(dims, ["fp32"] * 5, {"eps": 1e-5}), ["fp32"] * 5, 89, [dims])
    blob = aot.pack(ks, {"plugin": "k3::AttnRes"})
    cubins = sum(len(k.cubin) for k in ks)
    assert len(blob) < 0.6 * cubins, (len(blob), cubins)
    _, back = aot.unpack(blob)
    assert [b.cubin for b in back.values()] == [k.cubin for k in ks]
    (n,) = struct.unpack("<I", blob[8:12])
    raw = b"K3AOT1\0\0" + blob[8:12 + n] + b"".join(k.cubin for k in ks)  # the format before compression
    meta, old = aot.unpack(raw)
    assert meta == json.loads(blob[12:12 + n])["meta"] and [b.cubin for b in old.values()] == [k.cubin for k in ks]
    with pytest.raises(PluginError, match="corrupt cubin section"):
        aot.unpack(blob[:-10])
