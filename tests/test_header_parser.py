"""The strict safetensors header parser, on bytes in memory."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError
from safetensors.torch import load, save

from weightstream.errors import HeaderError, TruncatedFileError
from weightstream.formats.safetensors import DTYPES, MAX_HEADER_BYTES, header_length, parse_header

FILE = "f.safetensors"


def parse(document: object, data_bytes: int = 0, raw: bytes | None = None):
    body = raw if raw is not None else json.dumps(document).encode()
    return parse_header(body, 8 + len(body) + data_bytes, FILE)


def entry(dtype: str = "F32", shape=(2,), offsets=(0, 8)) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def test_file_under_eight_bytes():
    with pytest.raises(HeaderError, match=r"f.safetensors: file is 5 bytes, shorter than the 8-byte header length"):
        header_length(b"\x00" * 5, 5, FILE)


def test_header_length_past_end_of_file():
    with pytest.raises(
        HeaderError,
        match=r"header length 100 runs past the end of the file \(header would end at byte 108, file has 50 bytes\)",
    ):
        header_length(struct.pack("<Q", 100), 50, FILE)


@pytest.mark.parametrize("length", [MAX_HEADER_BYTES + 1, 2**64 - 1])
def test_header_length_over_limit(length):
    with pytest.raises(HeaderError, match=rf"header length {length} exceeds the limit of 100000000 bytes"):
        header_length(struct.pack("<Q", length), 2**40, FILE)


def test_non_utf8():
    with pytest.raises(HeaderError, match=r"header is not valid UTF-8 at header byte 7"):
        parse(None, raw=b'{"a": "\xff\xfe"}')


def test_not_json():
    with pytest.raises(
        HeaderError, match=r"header is not valid JSON: Expecting property name enclosed in double quotes at byte 1"
    ):
        parse(None, raw=b"{nope}")


def test_json_array():
    with pytest.raises(HeaderError, match=r"header is a JSON array, expected a JSON object"):
        parse([1, 2])


def test_does_not_start_with_brace():
    with pytest.raises(
        HeaderError, match=r"header starts with 'x' after 2 bytes of whitespace, expected a JSON object"
    ):
        parse(None, raw=b" \tx{}")


def test_only_whitespace():
    with pytest.raises(HeaderError, match=r"header holds nothing after 4 bytes of whitespace, expected a JSON object"):
        parse(None, raw=b"    ")


def test_nul_padding():
    with pytest.raises(
        HeaderError,
        match=r"header contains a NUL byte at file offset 10 "
        r"\(padding must be JSON whitespace: spaces, tabs, CR or LF\)",
    ):
        parse(None, raw=b"{}\x00\x00\x00\x00\x00\x00")


@pytest.mark.parametrize("raw", [b"{}      ", b"  {}", b"\t\r\n{}\n\t\r "])
def test_json_whitespace_padding_is_accepted(raw):
    assert parse(None, raw=raw).entries == ()


PADDING = st.sampled_from([b" ", b"\t", b"\n", b"\r", b"\x0b", b"\x0c", b"\x00", b"x", "\u00a0".encode(), b"}", b"{"])


@settings(max_examples=300, deadline=None)
@given(before=st.lists(PADDING, max_size=4), after=st.lists(PADDING, max_size=4))
def test_padding_accepted_exactly_where_safetensors_accepts_it(before, after):
    """Differential: the same bytes around the object, read by safetensors' own parser and by ours."""
    body = b"".join(before) + json.dumps({"w": entry("U8", (2,), (0, 2))}).encode() + b"".join(after)
    try:
        theirs = load(struct.pack("<Q", len(body)) + body + b"ab")
    except SafetensorError:
        with pytest.raises(HeaderError):
            parse(None, raw=body, data_bytes=2)
    else:
        assert list(theirs) == [tensor.name for tensor in parse(None, raw=body, data_bytes=2).entries]


def test_duplicate_key():
    with pytest.raises(HeaderError, match=r"header has the key 'a' twice"):
        parse(None, raw=b'{"a": {}, "a": {}}')


def test_duplicate_key_inside_entry():
    raw = b'{"a": {"dtype": "U8", "dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}'
    with pytest.raises(HeaderError, match=r"header has the key 'dtype' twice"):
        parse(None, raw=raw, data_bytes=1)


@pytest.mark.parametrize("value, found", [(1, "int 1"), (None, "NoneType None"), (["x"], "list")])
def test_non_string_metadata_value(value, found):
    with pytest.raises(HeaderError, match=rf"__metadata__\['k'\] is {found}"):
        parse({"__metadata__": {"k": value}})


def test_metadata_not_an_object():
    with pytest.raises(HeaderError, match=r"__metadata__ is list, expected an object of strings"):
        parse({"__metadata__": ["a"]})


def test_unknown_dtype():
    with pytest.raises(HeaderError, match=r"tensor 'w' in f.safetensors: unknown dtype 'F128'; known: BOOL"):
        parse({"w": entry(dtype="F128")}, 8)


@pytest.mark.parametrize("shape", [[-1], [2.0], ["2"], [True], 4])
def test_bad_shape(shape):
    with pytest.raises(
        HeaderError, match=r"tensor 'w' in f.safetensors: shape .* is not a list of non-negative integers"
    ):
        parse({"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 8]}}, 8)


def test_shape_product_overflows():
    with pytest.raises(
        HeaderError,
        match=r"shape \[4294967296, 4294967296\] has more than 2\*\*63 - 1 elements, more than fit in 64 bits",
    ):
        parse({"w": entry(shape=(2**32, 2**32), offsets=(0, 8))}, 8)


def test_byte_count_mismatch():
    with pytest.raises(
        HeaderError, match=r"tensor 'w' in f.safetensors: data_offsets \[0, 6\] hold 6 bytes, expected 8 for F32 \[2\]"
    ):
        parse({"w": entry(offsets=(0, 6))}, 6)


def test_overlapping_offsets():
    header = {"a": entry(offsets=(0, 8)), "b": entry(offsets=(4, 12))}
    with pytest.raises(
        HeaderError,
        match=r"tensor 'b' in f.safetensors: data_offsets \[4, 12\] \(file bytes \d+\.\.\d+\) overlap the previous "
        r"tensor 'a', which ends at 8",
    ):
        parse(header, 12)


def test_gap():
    header = {"a": entry(offsets=(0, 8)), "b": entry(offsets=(12, 20))}
    with pytest.raises(
        HeaderError, match=r"tensor 'b' .* leave a gap of 4 bytes after tensor 'a' \(expected begin 8\)"
    ):
        parse(header, 20)


def test_gap_at_start():
    with pytest.raises(HeaderError, match=r"leave a gap of 4 bytes at the start of the data"):
        parse({"a": entry(offsets=(4, 12))}, 12)


def test_begin_after_end():
    with pytest.raises(HeaderError, match=r"data_offsets \[8, 0\] begin after they end"):
        parse({"a": entry(offsets=(8, 0))}, 8)


@pytest.mark.parametrize("offsets", [[0], [0, 1, 2], [-1, 7], "0,8", [0, 8.0]])
def test_malformed_offsets(offsets):
    with pytest.raises(HeaderError, match=r"data_offsets .* is not a pair of non-negative integers"):
        parse({"a": {"dtype": "F32", "shape": [2], "data_offsets": offsets}}, 8)


def test_trailing_bytes():
    with pytest.raises(HeaderError, match=r"f.safetensors: 3 trailing bytes after the last tensor"):
        parse({"a": entry()}, 11)


def test_truncated_body():
    with pytest.raises(
        TruncatedFileError,
        match=r"tensor 'a' in f.safetensors: data_offsets \[0, 8\] .* end past the end of the file \(data section has "
        r"5 bytes",
    ):
        parse({"a": entry()}, 5)


def test_entry_with_unknown_key():
    with pytest.raises(HeaderError, match=r"entry keys missing \[\], unexpected \['scale'\]"):
        parse({"a": {**entry(), "scale": 1}}, 8)


def test_entry_not_an_object():
    with pytest.raises(HeaderError, match=r"tensor 'a' in f.safetensors: entry is list"):
        parse({"a": [1]}, 0)


def test_nan_constant_rejected():
    with pytest.raises(HeaderError, match=r"non-JSON constant NaN"):
        parse(None, raw=b'{"__metadata__": {"a": NaN}}')


def test_deep_nesting_is_a_header_error():
    with pytest.raises(HeaderError, match=r"header is not acceptable JSON"):
        parse(None, raw=b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")


def test_packed_fp4_shape_must_be_even():
    with pytest.raises(HeaderError, match=r"F4 packs two values per byte; the last dimension of \[3\] must be even"):
        parse({"a": entry(dtype="F4", shape=(3,), offsets=(0, 2))}, 2)


def test_zero_size_tensors_share_an_offset():
    header = parse({"a": entry(shape=(0,), offsets=(0, 0)), "b": entry(), "c": entry(shape=(0, 3), offsets=(8, 8))}, 8)
    assert [(e.name, e.begin, e.end) for e in header.entries] == [("a", 0, 0), ("b", 0, 8), ("c", 8, 8)]


# -- property tests -------------------------------------------------------------------------

TORCH_DTYPES = [dtype for dtype in DTYPES.values() if dtype is not torch.float4_e2m1fn_x2]


@st.composite
def tensor_dicts(draw):
    names = draw(
        st.lists(st.text(min_size=1, max_size=12).filter(lambda n: n != "__metadata__"), unique=True, max_size=6)
    )
    result = {}
    for name in names:
        dtype = draw(st.sampled_from(TORCH_DTYPES))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        result[name] = torch.zeros(shape, dtype=dtype)
    metadata = draw(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3))
    return result, metadata or None


@settings(max_examples=150, deadline=None)
@given(tensor_dicts())
def test_parses_whatever_safetensors_writes(case):
    tensors, metadata = case
    blob = save(tensors, metadata=metadata)
    length = header_length(blob[:8], len(blob), FILE)
    header = parse_header(blob[8 : 8 + length], len(blob), FILE)
    assert {e.name: (e.dtype, e.shape) for e in header.entries} == {
        n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()
    }
    assert dict(header.metadata) == (metadata or {})


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 400))
def test_arbitrary_bytes_raise_only_typed_errors(raw, data_bytes):
    try:
        header = parse_header(raw, 8 + len(raw) + data_bytes, FILE)
    except (HeaderError, TruncatedFileError):
        return
    assert sum(e.end - e.begin for e in header.entries) == data_bytes


@pytest.mark.parametrize("where", ["name", "metadata key", "metadata value"])
def test_lone_surrogates_are_not_unicode_text(where):
    """JSON lets ``\\ud800`` stand alone; no UTF-8 can hold it, and safetensors' own parser refuses it."""
    names = {
        "name": ("\\ud800x", "k", "v"),
        "metadata key": ("w", "\\udfff", "v"),
        "metadata value": ("w", "k", "a\\ud800"),
    }[where]
    name, key, value = names
    raw = (
        '{"__metadata__": {"'
        + key
        + '": "'
        + value
        + '"}, "'
        + name
        + '": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}'
    ).encode()
    with pytest.raises(
        HeaderError,
        match=r"f.safetensors: header holds a string with a lone surrogate \(U\+D[8-9A-F][0-9A-F]{2}\) at character "
        r"\d+: not valid Unicode text",
    ):
        parse(None, 2, raw=raw)


def test_surrogate_pairs_are_text():
    raw = b'{"\\ud83d\\ude00": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}'
    assert parse(None, 2, raw=raw).entries[0].name == "\U0001f600"


@given(st.text(max_size=20), st.integers(0xD800, 0xDFFF), st.text(max_size=20))
@settings(max_examples=200, deadline=None)
def test_a_lone_surrogate_anywhere_in_a_name_is_refused(before, surrogate, after):
    name = json.dumps(before)[1:-1] + f"\\u{surrogate:04x}" + json.dumps(after)[1:-1]
    raw = ('{"' + name + '": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}').encode()
    try:
        parse(None, 2, raw=raw)
    except HeaderError as error:
        assert "lone surrogate" in str(error)
    else:
        # A high surrogate escape followed by a low one pairs up into one code point: text again.
        decoded = json.loads('"' + name + '"')
        decoded.encode("utf-8")


def test_a_shape_of_many_huge_dimensions_is_refused_with_a_short_message():
    shape = [2**62] * 40
    with pytest.raises(
        HeaderError,
        match=r"shape \[(4611686018427387904, ){7}4611686018427387904, \.\.\. \(40 dimensions\)\] has more than "
        r"2\*\*63 - 1 elements",
    ) as caught:
        parse({"w": entry(shape=shape, offsets=(0, 8))}, 8)
    assert len(str(caught.value)) < 400


def test_a_long_shape_list_is_refused_before_it_is_multiplied():
    import time

    start = time.monotonic()
    with pytest.raises(
        HeaderError,
        match=r"tensor 'w' in f.safetensors: shape has 400001 dimensions, more than the 64 weightstream accepts",
    ):
        parse({"w": entry(shape=[2] * 400_000 + [0], offsets=(0, 0))}, 0)
    assert time.monotonic() - start < 2


def _zero_size_checkpoint(directory, files: int, tensors: int):
    directory.mkdir()
    for index in range(files):
        header = json.dumps(
            {
                f"model.layers.{index}.{i}.empty": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
                for i in range(tensors)
            }
        ).encode()
        (directory / f"part-{index}.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return directory


def _plan_peak(uri) -> tuple[int, int]:
    """The peak of traced memory while ``uri`` is planned, and what its open checkpoint holds."""
    import gc
    import tracemalloc

    import weightstream

    gc.collect()
    tracemalloc.start()
    try:
        with weightstream.open(uri) as checkpoint:
            assert checkpoint.plan.tensors
            held, peak = tracemalloc.get_traced_memory()
        return peak, held
    finally:
        tracemalloc.stop()


def test_headers_parsed_at_once_stay_within_the_parse_budget(tmp_path, monkeypatch):
    """Eight hostile headers of zero-size tensors (each ~10x its size in objects while parsed): within a
    budget of one header they are parsed one after another, so the plan's peak is one header's, not eight."""
    from weightstream.planning import headers as headers_module

    directory = _zero_size_checkpoint(tmp_path / "many", files=8, tensors=6_000)
    one_header = (directory / "part-0.safetensors").stat().st_size
    single, held_by_one = _plan_peak(directory / "part-0.safetensors")
    monkeypatch.setattr(headers_module, "PARSE_BUDGET_BYTES", one_header)
    bounded, held = _plan_peak(directory)
    monkeypatch.setattr(headers_module, "PARSE_BUDGET_BYTES", 1 << 40)
    unbounded, _ = _plan_peak(directory)
    parsing = single - held_by_one  # what one header costs above what its plan keeps
    assert bounded - held <= 4 * parsing, (
        single,
        held_by_one,
        bounded,
        held,
        unbounded,
    )  # measured: 3.1 parses' worth (the plans built after each parse overlap)
    assert unbounded - held > bounded - held, (
        f"without the budget the headers overlap more: {unbounded} vs {bounded} (else the test proves nothing)"
    )


def test_a_header_larger_than_the_budget_is_parsed_alone():
    import threading

    from weightstream.planning.headers import ParseBudget

    budget = ParseBudget(100)
    entered, release = threading.Event(), threading.Event()

    def second_header() -> None:
        with budget.admit(10):
            entered.set()
            release.wait(5)

    worker = threading.Thread(target=second_header)
    with budget.admit(500):
        worker.start()
        assert not entered.wait(0.2), "admitted while a header over the budget was in parse"
    assert entered.wait(5) and budget.in_use == 10
    release.set()
    worker.join(5)
    assert budget.in_use == 0
