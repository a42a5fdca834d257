"""Long-input policy: reject / truncate / chunk on the real MiniLM tokenizer; merge; dimensions."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import ValidationError

from embedfleet.deployments.common.errors import InputTooLong, InvalidParameterValue, UnsupportedParameter
from embedfleet.deployments.common.long_input import (
    LongInputPolicy,
    SpecialTokens,
    apply_dimensions,
    check_dimensions,
    merge,
    plan,
)

MAX_LEN = 256  # MiniLM's max_seq_length (sentence_bert_config.json)
CLS, SEP = 101, 102
# Words that are one WordPiece each in MiniLM's vocabulary, so the document length is exact.
WORDS = ("the court held that contract was void for lack of consideration and appeal "
         "dismissed with costs awarded to the party under law").split()


@pytest.fixture(scope="module")
def special(minilm_tokenizer) -> SpecialTokens:
    return SpecialTokens.from_tokenizer(minilm_tokenizer)


@pytest.fixture(scope="module")
def doc(minilm_tokenizer) -> tuple[str, list[int]]:
    """A 3,000-token document (2,998 content tokens + [CLS] + [SEP])."""
    text = " ".join(WORDS[(i * 7 + i // 13) % len(WORDS)] for i in range(2998))
    ids = minilm_tokenizer(text)["input_ids"]
    assert len(ids) == 3000
    return text, ids


def test_special_tokens_detected_from_the_tokenizer(special):
    assert special == SpecialTokens(prefix=[CLS], suffix=[SEP])
    assert special.count == 2


def test_special_tokens_from_probe_places_prefix_and_suffix():
    # Causal style: content then EOS; BOS-only style; and a wrapper that alters the content.
    assert SpecialTokens.from_probe([5, 6, 99], [5, 6]) == SpecialTokens((), (99,))
    assert SpecialTokens.from_probe([1, 5, 6], [5, 6]) == SpecialTokens((1,), ())
    with pytest.raises(ValueError, match="not found"):
        SpecialTokens.from_probe([1, 7, 2], [5, 6])


def test_chunk_windows_carry_special_tokens_and_overlap(doc, special):
    _, ids = doc
    policy = LongInputPolicy(mode="chunk", chunk_tokens=256, chunk_overlap=50)
    p = plan(ids, MAX_LEN, policy, special)
    content = ids[1:-1]
    room, stride = 256 - 2, 256 - 2 - 50
    assert p.chunks == len(p.pieces) == math.ceil((len(content) - 50) / stride) == 15
    assert p.truncated is False and p.dropped_tokens == 0 and p.input_tokens == 3000
    assert p.weights == [len(piece) for piece in p.pieces]
    for k, piece in enumerate(p.pieces):
        assert len(piece) <= 256
        assert piece[0] == CLS and piece[-1] == SEP, f"chunk {k} lost its special tokens"
        assert piece.count(CLS) == 1 and piece.count(SEP) == 1
        # Window k covers content[k*stride : k*stride + room]: nothing skipped, nothing invented.
        assert piece[1:-1] == content[k * stride:k * stride + room]
    for a, b in zip(p.pieces, p.pieces[1:]):
        assert a[1:-1][-50:] == b[1:-1][:50], "consecutive chunks must share 50 content tokens"
    assert p.pieces[-1][-2] == content[-1], "the last chunk must reach the end of the document"
    assert all(len(piece) == 256 for piece in p.pieces[:-1])


def test_chunk_tokens_default_to_model_length_and_are_capped(doc, special):
    _, ids = doc
    default = plan(ids, MAX_LEN, LongInputPolicy(mode="chunk"), special)
    capped = plan(ids, MAX_LEN, LongInputPolicy(mode="chunk", chunk_tokens=4096), special)
    assert max(map(len, default.pieces)) == 256 and default.pieces == capped.pieces
    small = plan(ids, MAX_LEN, LongInputPolicy(mode="chunk", chunk_tokens=100, chunk_overlap=10),
                 special)
    assert max(map(len, small.pieces)) == 100 and small.chunks == math.ceil((2998 - 10) / 88)


@pytest.mark.parametrize("direction,side", [("right", "right"), ("left", "left")])
def test_truncation_matches_the_tokenizers_own(doc, special, minilm_tokenizer, direction, side):
    text, ids = doc
    p = plan(ids, MAX_LEN, LongInputPolicy(mode="truncate", truncation_direction=direction),
             special)
    assert len(p.pieces) == 1 and len(p.pieces[0]) == 256
    assert p.truncated is True and p.chunks == 1 and p.dropped_tokens == 2998 - 254
    # Independent reference: HF's truncation keeps [CLS]/[SEP] and cuts the chosen side.
    minilm_tokenizer.truncation_side = side
    try:
        expected = minilm_tokenizer(text, truncation=True, max_length=256)["input_ids"]
    finally:
        minilm_tokenizer.truncation_side = "right"
    assert p.pieces[0] == expected
    kept = ids[1:255] if direction == "right" else ids[-255:-1]
    assert p.pieces[0] == [CLS, *kept, SEP]


def test_reject_names_both_lengths(doc, special):
    _, ids = doc
    with pytest.raises(InputTooLong) as err:
        plan(ids, MAX_LEN, LongInputPolicy(mode="reject"), special, what="input[3]")
    msg = err.value.message
    assert "input[3]" in msg and "3000" in msg and "256" in msg
    assert err.value.status == 400 and err.value.param == "input"
    with pytest.raises(InputTooLong) as err:
        plan(ids, MAX_LEN, LongInputPolicy(mode="reject"), special, param="inputs")
    assert err.value.param == "inputs"


@pytest.mark.parametrize("mode", ["reject", "truncate", "chunk"])
def test_max_total_tokens_bounds_every_mode(doc, special, mode):
    _, ids = doc
    policy = LongInputPolicy(mode=mode, max_total_tokens=2999)
    with pytest.raises(InputTooLong) as err:
        plan(ids, MAX_LEN, policy, special)
    assert "3000" in err.value.message and "2999" in err.value.message
    chunking = policy.model_copy(update={"mode": "chunk"})
    assert plan(ids[:2999], MAX_LEN, chunking, special).chunks > 1


@pytest.mark.parametrize("mode", ["reject", "truncate", "chunk"])
def test_inputs_that_fit_are_untouched(minilm_tokenizer, special, mode):
    ids = minilm_tokenizer("a short query about contracts")["input_ids"]
    policy = LongInputPolicy(mode=mode, chunk_tokens=5, chunk_overlap=1)
    p = plan(ids, MAX_LEN, policy, special)
    assert p.pieces == [ids] and p.weights == [len(ids)] and p.chunks == 1 and not p.truncated
    exact = list(range(1000, 1254))
    assert plan([CLS, *exact, SEP], MAX_LEN, policy, special).pieces == [[CLS, *exact, SEP]]


def test_causal_suffix_is_kept_on_every_piece():
    eos = 7
    special = SpecialTokens(prefix=[], suffix=[eos])
    ids = [*range(100, 130), eos]
    chunked = plan(ids, 10, LongInputPolicy(mode="chunk", chunk_overlap=3), special)
    assert all(p[-1] == eos and p.count(eos) == 1 and len(p) <= 10 for p in chunked.pieces)
    assert chunked.pieces[0] == [*range(100, 109), eos]
    assert chunked.pieces[1][:3] == [106, 107, 108]
    left = plan(ids, 10, LongInputPolicy(mode="truncate", truncation_direction="left"), special)
    assert left.pieces == [[*range(121, 130), eos]] and left.dropped_tokens == 21


def test_raw_token_ids_without_specials_stay_without():
    special = SpecialTokens([CLS], [SEP])
    ids = list(range(1000, 1600))
    p = plan(ids, 256, LongInputPolicy(mode="truncate"), special)
    assert p.pieces == [ids[:256]]
    c = plan(ids, 256, LongInputPolicy(mode="chunk"), special)
    assert all(CLS not in piece and SEP not in piece for piece in c.pieces)
    assert c.pieces[0] == ids[:256]


def test_policy_validation_names_values():
    with pytest.raises(ValidationError, match=r"chunk_overlap \(300\).*chunk_tokens \(256\)"):
        LongInputPolicy(mode="chunk", chunk_tokens=256, chunk_overlap=300)
    with pytest.raises(ValidationError, match="extra"):
        LongInputPolicy(mode="chunk", overlap=10)
    with pytest.raises(ValidationError):
        LongInputPolicy(mode="split")
    p = LongInputPolicy(mode="chunk", chunk_tokens=52, chunk_overlap=50)
    with pytest.raises(ValueError, match="leaves 50 content tokens"):
        p.check_model(256, SpecialTokens([CLS], [SEP]))
    with pytest.raises(InvalidParameterValue, match="chunk_overlap"):
        plan([CLS, *range(1000, 1400), SEP], 256, p, SpecialTokens([CLS], [SEP]))
    LongInputPolicy(mode="chunk", chunk_tokens=256).check_model(256, SpecialTokens([CLS], [SEP]))


def test_merge_is_the_renormalised_token_weighted_mean(doc, special):
    _, ids = doc
    p = plan(ids, MAX_LEN, LongInputPolicy(mode="chunk", chunk_tokens=256, chunk_overlap=50),
             special)
    rng = np.random.default_rng(5)
    vecs = [v / np.linalg.norm(v) for v in rng.normal(size=(p.chunks, 384)).astype(np.float32)]
    merged = merge(vecs, p.weights, normalize=True)
    # Hand computation, written out independently of merge's vectorised form.
    acc = np.zeros(384)
    for v, w in zip(vecs, p.weights):
        acc += w * v.astype(np.float64)
    expected = acc / sum(p.weights)
    expected /= np.linalg.norm(expected)
    assert merged.dtype == np.float32
    assert abs(float(np.linalg.norm(merged)) - 1.0) < 1e-5
    assert float(np.dot(merged, expected)) >= 0.99999
    np.testing.assert_allclose(merged, expected, atol=1e-6)
    # The short last chunk weighs less than a full one: not a plain mean.
    plain = np.mean(vecs, axis=0)
    assert float(np.dot(merged, plain / np.linalg.norm(plain))) < 0.999999


def test_merge_without_normalisation_and_bad_weights():
    a, b = np.array([1.0, 0.0], np.float32), np.array([0.0, 1.0], np.float32)
    np.testing.assert_allclose(merge([a, b], [3, 1], normalize=False), [0.75, 0.25])
    np.testing.assert_allclose(merge([a, b], [3, 1], normalize=True), np.array([3, 1]) / 10**0.5,
                               rtol=1e-6)
    with pytest.raises(ValueError):
        merge([a, b], [1], normalize=True)
    with pytest.raises(ValueError):
        merge([a, b], [1, 0], normalize=True)


def test_apply_dimensions_truncates_and_renormalises():
    v = np.arange(1, 9, dtype=np.float32)
    out = apply_dimensions(v, 4, (2, 4, 8))
    np.testing.assert_allclose(out, v[:4] / np.linalg.norm(v[:4]), rtol=1e-6)
    assert abs(float(np.linalg.norm(out)) - 1) < 1e-6
    assert apply_dimensions(v, None, None) is v and apply_dimensions(v, 8, (4, 8)) is v
    np.testing.assert_allclose(apply_dimensions(v, 3, None, any_up_to_hidden=True),
                               v[:3] / np.linalg.norm(v[:3]), rtol=1e-6)
    np.testing.assert_allclose(apply_dimensions(v, 2, (2,), normalize=False), v[:2])


def test_dimensions_errors_name_the_problem():
    v = np.ones(8, np.float32)
    with pytest.raises(UnsupportedParameter) as err:
        apply_dimensions(v, 4, None, model="all-minilm-l6-v2")
    assert err.value.status == 400 and err.value.param == "dimensions"
    assert "all-minilm-l6-v2" in err.value.message and "8-d" in err.value.message
    with pytest.raises(InvalidParameterValue, match=r"not one of .*\[2, 4\]"):
        apply_dimensions(v, 3, (4, 2))
    with pytest.raises(InvalidParameterValue, match="larger"):
        check_dimensions(16, 8, (4, 8))
    with pytest.raises(UnsupportedParameter):
        check_dimensions(4, 8, ())


def test_flatten_and_merge_planned_keep_inputs_apart(doc, special):
    from embedfleet.deployments.common.long_input import flatten, merge_planned

    _, ids = doc
    policy = LongInputPolicy(mode="chunk")
    plans = [plan([CLS, 2000, SEP], MAX_LEN, policy, special), plan(ids, MAX_LEN, policy, special),
             plan([CLS, 2001, 2002, SEP], MAX_LEN, policy, special)]
    pieces = flatten(plans)
    assert len(pieces) == 1 + plans[1].chunks + 1 and pieces[0] == [CLS, 2000, SEP]
    rng = np.random.default_rng(1)
    vecs = [v / np.linalg.norm(v) for v in rng.normal(size=(len(pieces), 8))]
    merged = merge_planned(plans, vecs, normalize=True)
    assert len(merged) == 3
    assert merged[0] is vecs[0] and merged[2] is vecs[-1]
    np.testing.assert_allclose(merged[1], merge(vecs[1:-1], plans[1].weights, True), rtol=1e-6)
    with pytest.raises(ValueError, match="pieces planned"):
        merge_planned(plans, vecs[:-1], normalize=True)


def test_chunk_above_always_splits_every_input_longer_than_one_window(minilm_tokenizer, special):
    # 150 content tokens: fits MiniLM's 256 whole, but not one 64-token window.
    ids = [CLS, *range(1000, 1150), SEP]
    whole = LongInputPolicy(mode="chunk", chunk_tokens=64, chunk_overlap=8)
    assert plan(ids, MAX_LEN, whole, special).pieces == [ids]  # max_model_len: untouched
    always = whole.model_copy(update={"chunk_above": "always"})
    p = plan(ids, MAX_LEN, always, special)
    room, stride = 64 - 2, 64 - 2 - 8
    assert p.chunks == math.ceil((150 - 8) / stride) == 3 and not p.truncated
    for k, piece in enumerate(p.pieces):
        assert piece[0] == CLS and piece[-1] == SEP and len(piece) <= 64
        assert piece[1:-1] == ids[1:-1][k * stride:k * stride + room]
    # An input no longer than one window is never altered, whatever chunk_above says.
    short = [CLS, *range(1000, 1062), SEP]
    assert plan(short, MAX_LEN, always, special).pieces == [short]
    # Other modes ignore chunk_above: the input fits the model, so it stays whole.
    for mode in ("reject", "truncate"):
        pol = always.model_copy(update={"mode": mode})
        assert plan(ids, MAX_LEN, pol, special).pieces == [ids]


def test_the_seeds_document_windows_400_and_50_on_a_long_context_model():
    # The 910B config's form: a model of 32,768 positions, a 3,000-token document, EOS suffix.
    eos = 151643
    special = SpecialTokens(prefix=[], suffix=[eos])
    doc = [*range(10, 3009), eos]
    seed = LongInputPolicy(mode="chunk", chunk_tokens=400, chunk_overlap=50, chunk_above="always")
    p = plan(doc, 32768, seed, special)
    assert p.chunks == math.ceil((2999 - 50) / (399 - 50)) == 9
    assert all(len(piece) <= 400 and piece[-1] == eos for piece in p.pieces)
    for a, b in zip(p.pieces, p.pieces[1:]):
        assert a[:-1][-50:] == b[:-1][:50]
    assert plan(doc, 32768, seed.model_copy(update={"chunk_above": "max_model_len"}),
                special).pieces == [doc]


def test_the_910b_config_chunks_documents_always():
    from embedfleet.deployments.config.schema import CONFIG_DIR, load_config

    (m,) = load_config(CONFIG_DIR / "ascend-910b-qwen3-embedding-8b.yaml").models
    assert (m.long_input.mode, m.long_input.chunk_tokens, m.long_input.chunk_overlap,
            m.long_input.chunk_above) == ("chunk", 400, 50, "always")
    with pytest.raises(ValidationError):
        LongInputPolicy(mode="chunk", chunk_above="sometimes")
