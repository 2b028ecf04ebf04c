"""The OCI parsers on bytes (no registry): references, manifests, tar member headers and PAX records. Properties:
what a writer makes is read back exactly; anything else is a typed error, never another exception."""

from __future__ import annotations

import io
import json
import tarfile

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightstream.errors import FormatError, UnsupportedInputError
from weightstream.formats import oci

COMPONENT = st.from_regex(r"[a-z0-9]{1,8}([._-][a-z0-9]{1,8}){0,2}", fullmatch=True)
REGISTRY = st.from_regex(r"[a-z0-9]{1,10}(\.[a-z]{2,5}){0,2}(:[0-9]{2,5})?", fullmatch=True)
TAG = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}", fullmatch=True)
PATH = st.lists(st.from_regex(r"[A-Za-z0-9_-]{1,10}(\.[a-z]{1,11})?", fullmatch=True), max_size=3).map("/".join)
DIGEST = st.binary(min_size=32, max_size=32).map(lambda raw: "sha256:" + raw.hex())


@given(REGISTRY, st.lists(COMPONENT, min_size=1, max_size=3), st.one_of(TAG, DIGEST), PATH)
def test_a_reference_reads_back_what_it_was_made_of(registry, parts, version, path):
    repository = "/".join(parts)
    marker = "@" if version.startswith("sha256:") else ":"
    uri = f"oci://{registry}/{repository}{marker}{version}" + (f"/{path}" if path else "")
    reference = oci.parse_reference(uri)
    assert (reference.registry, reference.repository, reference.path) == (registry, repository, path)
    assert (reference.digest if marker == "@" else reference.tag) == version
    assert oci.parse_reference(reference.artifact + (f"/{path}" if path else "")) == reference


@given(st.text(max_size=80))
def test_any_text_is_a_reference_or_a_typed_refusal(text):
    try:
        oci.parse_reference("oci://" + text)
    except (UnsupportedInputError, FormatError):
        pass


@given(st.from_regex(r"[A-Za-z0-9_./-]{1,200}", fullmatch=True), st.integers(0, 1 << 40))
def test_a_tar_header_reads_back_its_member(name, size):
    info = tarfile.TarInfo(name)
    info.size = size
    block = info.tobuf(format=tarfile.GNU_FORMAT)
    members = []
    at = 0
    while at < len(block):
        member = oci.parse_tar_header(block[at : at + oci.TAR_BLOCK], "layer")
        members.append(member)
        if member.kind == "longname":
            assert oci._c_string(block[at + 512 : at + 512 + member.size]) == name
        at += member.next_offset if member.kind == "longname" else oci.TAR_BLOCK
    assert members[-1].kind == "file" and members[-1].size == size
    if len(members) == 1:
        assert members[0].name == name


@given(st.binary(min_size=512, max_size=512))
def test_any_block_is_a_member_an_end_or_a_typed_refusal(block):
    try:
        member = oci.parse_tar_header(block, "layer")
    except FormatError:
        return
    assert member is None or member.size >= 0


@given(st.dictionaries(st.from_regex(r"[a-z.]{1,12}", fullmatch=True), st.text(max_size=60), max_size=4))
def test_pax_records_read_back(records):
    data = tarfile.TarInfo("x")._create_pax_generic_header(records, tarfile.XHDTYPE, "utf-8")
    member = oci.parse_tar_header(data[: oci.TAR_BLOCK], "layer")
    assert member.kind == "pax"
    assert oci.parse_pax(data[oci.TAR_BLOCK : oci.TAR_BLOCK + member.size], "layer") == records


@given(st.binary(max_size=200))
def test_any_bytes_are_pax_records_or_a_typed_refusal(data):
    try:
        oci.parse_pax(data, "layer")
    except FormatError:
        pass


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=10), lambda inner: st.lists(
    inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3), max_leaves=12))  # fmt: skip
def test_any_json_is_a_manifest_or_a_typed_refusal(document):
    try:
        oci.parse_manifest(json.dumps(document).encode(), "manifest")
    except FormatError:
        pass


def test_a_tar_written_by_tarfile_is_walked_member_by_member():
    stream = io.BytesIO()
    with tarfile.open(fileobj=stream, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name, data in (("a.json", b"{}"), ("weights/" + "l" * 120 + ".safetensors", b"x" * 1000)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    blob, at, found, pending = stream.getvalue(), 0, [], {}
    while (member := oci.parse_tar_header(blob[at : at + 512], "layer")) is not None:
        if member.kind == "pax":
            pending = oci.parse_pax(blob[at + 512 : at + 512 + member.size], "layer")
        elif member.kind == "file":
            found.append((pending.get("path", member.name), blob[at + 512 : at + 512 + member.size]))
            pending = {}
        at += member.next_offset
    assert found == [("a.json", b"{}"), ("weights/" + "l" * 120 + ".safetensors", b"x" * 1000)]


@pytest.mark.parametrize(
    "layer, message",
    [
        ({"digest": "sha256:" + "a" * 64, "size": -1, "mediaType": "x"}, r"layer 0 has no valid size"),
        ({"digest": "md5:abc", "size": 1, "mediaType": "x"}, r"a descriptor without a sha256 digest"),
        ({"digest": "sha256:" + "a" * 64, "size": 1}, r"layer 0 has no mediaType"),
    ],
)
def test_bad_layers_are_refused_by_name(layer, message):
    with pytest.raises(FormatError, match=message):
        oci.parse_manifest(json.dumps({"schemaVersion": 2, "layers": [layer]}).encode(), "manifest")


@given(st.integers(min_value=0, max_value=10**19 - 1), st.integers(min_value=0, max_value=8**11))
def test_a_pax_size_reads_back_and_overrides_the_ustar_one(size, stored):
    assert oci.pax_size({"size": str(size)}, stored, "layer") == size
    assert oci.pax_size({"path": "x"}, stored, "layer") == stored


@given(st.text(max_size=40))
def test_any_pax_size_text_is_a_size_or_a_typed_refusal(text):
    try:
        size = oci.pax_size({"size": text}, 0, "layer")
    except FormatError as error:
        assert "a PAX size record is" in str(error)
    else:
        assert text.isascii() and text.isdigit() and size == int(text)
