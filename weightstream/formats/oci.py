"""OCI artifacts as checkpoints: references, manifests and tar member headers, parsed from bytes (no I/O).

A reference ``oci://registry[:port]/repository:tag`` (or ``@sha256:...``) names an artifact; a path after it
(``oci://host/repo:tag/model.safetensors``) names a file inside. An artifact's files come from its manifest's
layers: a raw layer (the ModelPack ``application/vnd.cncf.model.*.v1.raw`` types, the older
``application/vnd.cnai.model.*`` ones) is one file, named by its ``org.cncf.model.filepath`` (or
``org.opencontainers.image.title``) annotation; an uncompressed tar layer (KitOps ModelKits, ModelPack
``.v1.tar``) holds its files in place, each found by its member header and read from its offset in the
blob. A compressed layer cannot be read in place: it is refused, naming its media type.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re

from weightstream.errors import FormatError, UnsupportedInputError
from weightstream.formats.strict_json import parse_json

SCHEME = "oci://"
MANIFEST_TYPES = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
"""What a manifest request accepts (an index is resolved to the manifest it lists)."""
INDEX_TYPES = frozenset(MANIFEST_TYPES[1::2])
PATH_ANNOTATIONS = ("org.cncf.model.filepath", "org.cnai.model.filepath", "org.opencontainers.image.title")
"""Where a layer names the file it holds, first found wins."""
COMPRESSED = re.compile(r"\+(gzip|zstd)$|\.(gzip|zstd)$|tar\.gz$")
TAR_BLOCK = 512
MAX_MANIFEST_BYTES = 4 << 20
"""Registries refuse manifests over 4 MiB: none larger is read."""
MAX_PAX_BYTES = 1 << 20
"""A PAX extended header longer than this is refused (it only names a path and a size here)."""
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
REPOSITORY = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*")
TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
REGISTRY = re.compile(r"[A-Za-z0-9.-]+(?::[0-9]{1,5})?|\[[0-9A-Fa-f:.]+\](?::[0-9]{1,5})?")


@dataclasses.dataclass(frozen=True)
class Reference:
    """One artifact in one registry, by tag or by digest, and a path inside it (``""``: the whole artifact)."""

    registry: str
    repository: str
    tag: str | None
    digest: str | None
    path: str = ""

    @property
    def artifact(self) -> str:
        """The artifact's URI, without a path: ``oci://registry/repository:tag`` (or ``@digest``)."""
        pin = f"@{self.digest}" if self.digest else f":{self.tag}"
        return f"{SCHEME}{self.registry}/{self.repository}{pin}"

    @property
    def selector(self) -> str:
        """What a manifest request names: the digest if pinned, else the tag."""
        return self.digest or self.tag  # type: ignore[return-value]


def parse_reference(uri: str) -> Reference:
    """The artifact (and the path inside it) ``uri`` names.

    Raises:
        UnsupportedInputError: not an ``oci://`` reference with a tag or a digest.

    Example:
        >>> parse_reference("oci://127.0.0.1:5000/models/llama:v1/model.safetensors")
        Reference(registry='127.0.0.1:5000', repository='models/llama', tag='v1', digest=None, path='model.safetensors')
        >>> parse_reference("oci://r.io/m@sha256:" + "0" * 64).digest[:10]
        'sha256:000'
    """
    if not uri.startswith(SCHEME):
        raise UnsupportedInputError(f"{uri[:200]}: not an oci:// reference")
    rest = uri[len(SCHEME) :]
    registry, slash, remainder = rest.partition("/")
    if not slash or not REGISTRY.fullmatch(registry):
        raise UnsupportedInputError(f"{uri[:200]}: an oci:// reference starts with a registry host[:port]")
    marker = min((index for index in (remainder.find(":"), remainder.find("@")) if index >= 0), default=-1)
    if marker < 0:
        raise UnsupportedInputError(
            f"{uri[:200]}: name the artifact's version: oci://{registry}/REPOSITORY:TAG or @sha256:DIGEST"
        )
    repository = remainder[:marker]
    version, _, path = remainder[marker + 1 :].partition("/")
    if remainder[marker] == "@":
        if not DIGEST.fullmatch(version):
            raise UnsupportedInputError(f"{uri[:200]}: a digest is sha256: and 64 lowercase hex digits")
        tag, digest = None, version
    else:
        tag, _, pinned = version.partition("@")
        if pinned:
            raise UnsupportedInputError(f"{uri[:200]}: name a tag or a digest, not both")
        if not TAG.fullmatch(tag):
            raise UnsupportedInputError(f"{uri[:200]}: {tag[:140]!r} is not a valid tag")
        digest = None
    if not REPOSITORY.fullmatch(repository):
        raise UnsupportedInputError(f"{uri[:200]}: {repository[:140]!r} is not a valid repository name")
    return Reference(registry, repository, tag, digest, _clean_path(path.strip("/"), uri))


@dataclasses.dataclass(frozen=True)
class Layer:
    """A manifest's layer: a blob, what it holds and the file it names."""

    digest: str
    size: int
    media_type: str
    path: str | None

    @property
    def is_tar(self) -> bool:
        return ".tar" in self.media_type or self.media_type.endswith(".tar")


@dataclasses.dataclass(frozen=True)
class ArtifactFile:
    """A file of an artifact: ``size`` bytes at ``offset`` in blob ``digest`` (of ``blob_size`` bytes)."""

    path: str
    digest: str
    blob_size: int
    offset: int
    size: int


def parse_manifest(body: bytes, what: str) -> tuple[str, list[Layer] | list[str]]:
    """A manifest's kind and content: ``("manifest", layers)`` or, for an index, ``("index", manifest digests)``.

    Raises:
        FormatError: not a manifest or an index, or a layer without a valid digest and size.

    Example:
        >>> import json
        >>> layer = {"mediaType": "application/vnd.cncf.model.weight.v1.raw", "digest": "sha256:" + "a" * 64,
        ...          "size": 8, "annotations": {"org.cncf.model.filepath": "model.safetensors"}}
        >>> kind, layers = parse_manifest(json.dumps({"schemaVersion": 2, "layers": [layer]}).encode(), "m")
        >>> kind, layers[0].path
        ('manifest', 'model.safetensors')
    """
    if len(body) > MAX_MANIFEST_BYTES:
        raise FormatError(f"{what}: a manifest of {len(body)} bytes; registries keep them under {MAX_MANIFEST_BYTES}")
    try:
        document = parse_json(body.decode("utf-8"), FormatError, what)
    except UnicodeDecodeError as error:
        raise FormatError(f"{what}: the manifest is not UTF-8: {error}") from None
    if not isinstance(document, dict) or document.get("schemaVersion") != 2:
        raise FormatError(f"{what}: not an OCI or Docker v2 manifest (schemaVersion 2)")
    if document.get("mediaType") in INDEX_TYPES or "manifests" in document:
        manifests = document.get("manifests")
        if not isinstance(manifests, list) or not manifests:
            raise FormatError(f"{what}: an index that lists no manifest")
        return "index", [_digest_of(entry, what) for entry in manifests]
    layers = document.get("layers")
    if not isinstance(layers, list):
        raise FormatError(f"{what}: a manifest without a list of layers")
    return "manifest", [_layer(entry, what, number) for number, entry in enumerate(layers)]


def _layer(entry: object, what: str, number: int) -> Layer:
    if not isinstance(entry, dict):
        raise FormatError(f"{what}: layer {number} is not an object")
    size = entry.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise FormatError(f"{what}: layer {number} has no valid size ({size!r:.40})")
    media_type = entry.get("mediaType")
    if not isinstance(media_type, str):
        raise FormatError(f"{what}: layer {number} has no mediaType")
    annotations = entry.get("annotations") or {}
    if not isinstance(annotations, dict):
        raise FormatError(f"{what}: layer {number}'s annotations are not an object")
    named = next((annotations[key] for key in PATH_ANNOTATIONS if isinstance(annotations.get(key), str)), None)
    return Layer(_digest_of(entry, what), size, media_type, None if named is None else _clean_path(named, what))


def _digest_of(entry: object, what: str) -> str:
    digest = entry.get("digest") if isinstance(entry, dict) else None
    if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
        raise FormatError(f"{what}: a descriptor without a sha256 digest ({digest!r:.80})")
    return digest


def raw_file(layer: Layer, what: str) -> ArtifactFile:
    """The one file a raw layer holds.

    Raises:
        FormatError: the layer names no file.
    """
    if layer.path is None:
        raise FormatError(f"{what}: layer {layer.digest} names no file (annotation {PATH_ANNOTATIONS[0]})")
    return ArtifactFile(layer.path, layer.digest, layer.size, 0, layer.size)


def check_readable(layer: Layer, what: str) -> None:
    """Refuse a layer that cannot be read in place (compressed).

    Example:
        >>> gzipped = Layer("sha256:" + "a" * 64, 1, "application/vnd.cncf.model.weight.v1.tar+gzip", None)
        >>> check_readable(gzipped, "m")
        Traceback (most recent call last):
        ...
        weightstream.errors.UnsupportedInputError: m: layer sha256:aaaa... is application/vnd...tar+gzip: ...
    """
    if COMPRESSED.search(layer.media_type):
        raise UnsupportedInputError(
            f"{what}: layer {layer.digest[:11]}... is {layer.media_type}: a compressed layer cannot be read in place "
            "(push the checkpoint with raw or uncompressed tar layers: weightstream push)"
        )


@dataclasses.dataclass(frozen=True)
class TarMember:
    """One member header of a tar stream: what it is, and where its data is."""

    name: str
    size: int
    kind: str
    """``file``, ``directory``, ``pax`` (an extended header for the next member), ``longname`` (GNU), ``other``."""
    data_offset: int
    """Where the member's data starts, from the start of the header."""

    @property
    def next_offset(self) -> int:
        """Where the next header starts, from the start of this one."""
        return self.data_offset + -(-self.size // TAR_BLOCK) * TAR_BLOCK


def parse_tar_header(block: bytes, what: str) -> TarMember | None:
    """The member a 512-byte tar header describes, or None for an end-of-archive (zero) block.

    Raises:
        FormatError: a bad checksum or a size that is not octal.

    Example:
        >>> import io, tarfile
        >>> stream = io.BytesIO()
        >>> with tarfile.open(fileobj=stream, mode="w", format=tarfile.USTAR_FORMAT) as archive:
        ...     info = tarfile.TarInfo("model.safetensors"); info.size = 3
        ...     archive.addfile(info, io.BytesIO(b"abc"))
        >>> parse_tar_header(stream.getvalue()[:512], "layer")
        TarMember(name='model.safetensors', size=3, kind='file', data_offset=512)
    """
    if len(block) != TAR_BLOCK:
        raise FormatError(f"{what}: a tar header of {len(block)} bytes, not {TAR_BLOCK}")
    if block == bytes(TAR_BLOCK):
        return None
    stored = _octal(block[148:156], what, "checksum")
    computed = sum(block[:148]) + 8 * 32 + sum(block[156:])
    if stored != computed:
        raise FormatError(f"{what}: a tar header's checksum is {stored}, its bytes sum to {computed}")
    size = _octal(block[124:136], what, "size")
    name = block[0:100].split(b"\0", 1)[0]
    if block[257:262] == b"ustar":
        prefix = block[345:500].split(b"\0", 1)[0]
        name = prefix + b"/" + name if prefix else name
    kind = {b"0": "file", b"\0": "file", b"7": "file", b"5": "directory", b"x": "pax", b"L": "longname"}.get(
        block[156:157], "other"
    )
    return TarMember(name.decode("utf-8", "replace"), size, kind, TAR_BLOCK)


def parse_pax(data: bytes, what: str) -> dict[str, str]:
    """A PAX extended header's records (``LENGTH key=value\\n``).

    Example:
        >>> parse_pax(b"34 path=weights/model.safetensors\\n", "layer")
        {'path': 'weights/model.safetensors'}
    """
    records: dict[str, str] = {}
    at = 0
    while at < len(data):
        length_text, space, _ = data[at : at + 21].partition(b" ")
        if not space or not length_text.isdigit():
            raise FormatError(f"{what}: a PAX record at byte {at} has no length")
        length = int(length_text)
        record = data[at : at + length]
        if length < len(length_text) + 3 or len(record) != length or not record.endswith(b"\n"):
            raise FormatError(f"{what}: a PAX record at byte {at} claims {length} bytes")
        key, equals, value = record[len(length_text) + 1 : -1].partition(b"=")
        if not equals:
            raise FormatError(f"{what}: a PAX record at byte {at} has no key=value")
        records[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
        at += length
    return records


MAX_SIZE_DIGITS = 19
"""A PAX size of more digits than this is refused (19 decimal digits hold every size below 2**63)."""


def pax_size(records: dict[str, str], stored: int, what: str) -> int:
    """The size of the member the PAX ``records`` precede: their ``size`` if given, else ``stored`` (the ustar
    header's).

    Raises:
        FormatError: a ``size`` record that is not a non-negative decimal number of at most 19 digits.

    Example:
        >>> pax_size({"size": "8589934592"}, 0, "layer"), pax_size({}, 3, "layer")
        (8589934592, 3)
    """
    text = records.get("size")
    if text is None:
        return stored
    if not text.isascii() or not text.isdigit() or len(text) > MAX_SIZE_DIGITS:
        raise FormatError(f"{what}: a PAX size record is {text[:40]!r}, not a size in bytes")
    return int(text)


def member_path(name: str, what: str) -> str:
    """A tar member's name as an artifact path (``./`` dropped; absolute paths and ``..`` refused)."""
    return _clean_path(name.removeprefix("./"), what)


def _clean_path(path: str, what: str) -> str:
    if not path:
        return ""
    normal = posixpath.normpath(path)
    if path.startswith("/") or normal == ".." or normal.startswith("../") or "\\" in path or "\0" in path:
        raise FormatError(f"{what}: the path {path[:120]!r} leaves the artifact")
    return normal


def _octal(field: bytes, what: str, name: str) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256 (sizes of 8 GiB and more)
        return int.from_bytes(field[1:], "big") | ((field[0] & 0x7F) << (8 * (len(field) - 1)))
    text = field.split(b"\0", 1)[0].strip()
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        raise FormatError(f"{what}: a tar header's {name} is not octal: {text[:20]!r}") from None
