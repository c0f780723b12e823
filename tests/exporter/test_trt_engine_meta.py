"""An engine is refused, with the reason named, on another SM or another TensorRT version (no GPU needed)."""

from __future__ import annotations

import json

import pytest

from k3x.exporter.engine import ENGINE_FILE, ENGINE_META, EngineBuildError
from k3x.runtime.engine_runner import check_engine_meta


@pytest.fixture()
def folder(tmp_path):
    meta = {"sm": 90, "runtime": "tensorrt", "tensorrt_version": "11.4.0.106", "plugin_paths": {"KDA": "aot"},
            "input_shapes": {}}
    (tmp_path / ENGINE_META).write_text(json.dumps(meta))
    return tmp_path


def test_matching_engine_is_accepted(folder):
    assert check_engine_meta(folder, tensorrt_version="11.4.0.106", sm=90)["plugin_paths"] == {"KDA": "aot"}


def test_other_sm_is_refused(folder):
    with pytest.raises(EngineBuildError, match=f"{ENGINE_FILE}: built for sm_90, this GPU is sm_100"):
        check_engine_meta(folder, tensorrt_version="11.4.0.106", sm=100)


def test_other_tensorrt_is_refused(folder):
    with pytest.raises(EngineBuildError, match="built with tensorrt 11.4.0.106, this process has 11.0.0"):
        check_engine_meta(folder, tensorrt_version="11.0.0", sm=90)


def test_missing_engine_names_the_command(tmp_path):
    with pytest.raises(EngineBuildError, match="k3x build-engine"):
        check_engine_meta(tmp_path, tensorrt_version="11.4.0.106", sm=90)


@pytest.mark.parametrize("text, field", [('{"runtime": "tensorrt"}', "'sm' missing"), ('{"sm": "90"}', "'sm' missing"),
                                         ("[1, 2]", "unreadable"), ("{not json", "unreadable")])
def test_crafted_record_is_refused_in_one_line(tmp_path, text, field):
    (tmp_path / ENGINE_META).write_text(text)
    with pytest.raises(EngineBuildError, match=field):
        check_engine_meta(tmp_path, tensorrt_version="11.4.0.106", sm=90)
