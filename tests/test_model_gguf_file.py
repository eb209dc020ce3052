"""rngd_pd.model.gguf_file against gguf's own GGUFReader and dequantize (the references) on the embedded
model: every metadata value, every tensor's type, shape, dtype and bytes, every dequantized value;
bad files refused."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from rngd_pd.model import embedded_model_path, gguf_file
from rngd_pd.model.gguf_file import GGUFFile, dequantize


@pytest.fixture(scope="module")
def pair() -> tuple[GGUFFile, gguf.GGUFReader]:
    path = embedded_model_path()
    return GGUFFile(path), gguf.GGUFReader(str(path))


def test_every_field_equals_the_readers(pair) -> None:
    ours, ref = pair
    expected = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(expected)  # the file's order
    assert {k for k in expected if ours.fields[k] != expected[k]} == set()
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152 and ours.fields["tokenizer.ggml.merges"]


def test_every_tensor_equals_the_readers(pair) -> None:
    ours, ref = pair
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        same = (a.tensor_type, a.data.shape, a.data.dtype) == (b.tensor_type, b.data.shape, b.data.dtype)
        assert same, a.name
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name
    quantized = [t for t in ours.tensors if t.tensor_type not in (gguf.GGMLQuantizationType.F32,)]
    assert quantized  # the embedded file mixes Q4_1, Q8_0 and F32: both layouts are covered
    t = quantized[0]
    assert np.array_equal(gguf.quants.dequantize(t.data, t.tensor_type),
                          gguf.quants.dequantize(ref.tensors[0].data, ref.tensors[0].tensor_type))


def test_bad_files_are_refused(tmp_path) -> None:
    with embedded_model_path().open("rb") as f:
        data = f.read(2 << 20)  # the metadata and index end at 1.7 MB; the first tensor is 30 MB
    (tmp_path / "magic.gguf").write_bytes(b"GGUX" + data[4:])
    with pytest.raises(ValueError, match="magic"):
        GGUFFile(tmp_path / "magic.gguf")
    (tmp_path / "version.gguf").write_bytes(data[:4] + (9).to_bytes(4, "little") + data[8:])
    with pytest.raises(ValueError, match="version 9"):
        GGUFFile(tmp_path / "version.gguf")
    (tmp_path / "short.gguf").write_bytes(data)  # the index is whole, the tensors are cut off
    with pytest.raises(ValueError, match="runs past the end of the file"):
        GGUFFile(tmp_path / "short.gguf")
    (tmp_path / "cut.gguf").write_bytes(data[:1 << 20])  # cut inside the vocabulary
    with pytest.raises(ValueError, match="ends inside its metadata"):
        GGUFFile(tmp_path / "cut.gguf")


def test_dequantize_gives_ggufs_bits(pair) -> None:
    """Every tensor of the embedded model (Q4_1, Q8_0, F32), and formats it lacks quantized here, in
    steps small enough that a tensor takes several."""
    ours, _ = pair
    for t in ours.tensors:
        want = gguf.quants.dequantize(t.data, t.tensor_type)
        assert np.array_equal(dequantize(t.data, t.tensor_type), want, equal_nan=True), t.name
    values = np.random.default_rng(0).standard_normal((300, 256), dtype=np.float32)
    for kind in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q5_1,
                 gguf.GGMLQuantizationType.BF16):
        data = gguf.quants.quantize(values, kind)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(gguf_file, "DEQUANT_VALUES", 1000)  # 3 rows a step: 100 steps
            got = dequantize(data, kind)
        assert got.shape == values.shape and np.array_equal(got, gguf.quants.dequantize(data, kind)), kind
