"""The JSON writer of manifests and restore chains (``_format/jsontext.py``): orjson, with the standard library where
orjson would write something else; whatever it writes reads back through ``json`` as the same values."""

import json
import math
import random
import struct

import pytest

from ckptvault._format import jsontext
from ckptvault._format.manifest import decode_manifest, encode_manifest
from ckptvault._format.records import PredictInfo, PredictInput


def test_floats_read_back_as_the_same_doubles():
    rng = random.Random(0)
    values = [struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0] for _ in range(20000)]
    values = [v for v in values if math.isfinite(v)] + [0.0, -0.0, 5e-324, 1e-9, 1.7976931348623157e308, 0.1]
    back = json.loads(jsontext.dumps(values))
    assert [struct.pack("<d", v) for v in back] == [struct.pack("<d", v) for v in values]


def test_what_orjson_refuses_is_written_by_json():
    value = {"step": 99999999999999999999, "seed": -(1 << 70), "deep": [[[[[]]]]]}
    for _ in range(300):  # deeper than orjson writes
        value = {"a": value}
    text = jsontext.dumps(value)
    assert json.loads(text) == value


def test_compact_utf8_in_insertion_order():
    value = {"z": [1, 2, (3, 4)], "a": "grüße ✓", "t": True, "n": None}
    assert jsontext.dumps(value) == json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def test_a_prediction_with_a_non_finite_scalar_is_refused():
    info = PredictInfo("scale-1", (PredictInput("x0", 1, "a"),), {"c": math.nan}, "0" * 64, 1 << 20, 3)
    with pytest.raises(ValueError, match="prediction scalars must be finite"):
        info.to_json()


def test_a_hand_made_body_is_checked_as_strictly_as_before():
    with pytest.raises(ValueError):
        encode_manifest({"format": "ckptvault.manifest", "time": math.inf})


def test_a_body_and_its_manifest_encode_alike(tmp_path):
    import torch

    import ckptvault

    ckptvault.save({"w": torch.arange(10.0), "lr": 1e-9, "big": 1 << 80}, tmp_path / "v", step=3,
                   metadata={"huge": 1 << 70, "eps": 1e-09})
    data = (tmp_path / "v" / "manifests" / f"{3:020d}.json").read_bytes()
    manifest = decode_manifest(data, "m", 3)
    assert encode_manifest(manifest) == data == encode_manifest(manifest.to_json())
    assert manifest.metadata == {"huge": 1 << 70, "eps": 1e-9}
