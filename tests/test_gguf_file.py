"""nanoserve.models.gguf_file against gguf-py's GGUFReader: the same fields and tensors, on
a small file written with gguf-py (every value kind, a custom alignment, typed and quantized
tensors) and on the embedded SmolLM2-135M file."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from nanoserve.models.gguf_file import ArrayInfo, GGUFFile
from nanoserve.models.registry import smollm2_gguf_path


def assert_same_as_reader(path, arrays=()) -> GGUFFile:
    ours, theirs = GGUFFile(path, arrays=arrays), gguf.GGUFReader(str(path))
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for key in keys:
        value, expected = ours.fields[key], theirs.fields[key].contents()
        if isinstance(value, ArrayInfo):
            assert key not in arrays and value.length == len(expected), key
        else:
            assert value == pytest.approx(expected) if isinstance(expected, float) else value == expected, key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(b.shape.tolist()), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name
    return ours


def test_every_value_kind_and_tensor_layout(tmp_path):
    path = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    writer.add_uint32("small.u32", 7)
    writer.add_int64("small.i64", -3)
    writer.add_float32("small.f32", 0.25)
    writer.add_float64("small.f64", 1e-6)
    writer.add_bool("small.flag", True)
    writer.add_string("small.name", "héllo")
    writer.add_array("small.words", ["a", "bc", ""])
    writer.add_array("small.ints", [1, 2, 3, 4])
    writer.add_array("small.kept", ["x", "yz"])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 4, 6)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = assert_same_as_reader(path, arrays=("small.kept",))
    assert ours.fields["small.kept"] == ["x", "yz"]
    assert ours.fields["small.words"] == ArrayInfo(8, 3) and ours.fields["small.name"] == "héllo"


def test_smollm2_file_reads_as_gguf_py_reads_it():
    ours = assert_same_as_reader(smollm2_gguf_path())
    assert ours.fields["tokenizer.ggml.tokens"].length == 49152


def test_not_a_gguf_file_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(path)
