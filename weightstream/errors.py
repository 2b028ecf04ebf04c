"""The one error hierarchy of weightstream.

Every error raised on purpose is a :class:`WeightstreamError`. Each leaf also
subclasses the built-in exception a caller would naturally catch, so
``except ValueError`` around a load of a corrupt file keeps working.
Messages name the file, the tensor, the byte offsets, and what was expected
against what was found, and never a secret: signatures, tokens and keys in the URLs
and connection strings they quote are redacted (:func:`redact`), in every message
and, through :func:`logger`, every log line.
"""

from __future__ import annotations

import logging
import re

REDACTED = "REDACTED"
SECRET_QUERY = re.compile(
    r"(?i)([?&](?:sig|signature|x-amz-signature|x-amz-security-token|x-amz-credential|x-goog-signature|"
    r"x-goog-credential|token|access_token|id_token|code|key|password)=)[^&#:\s'\"]+"
)
"""Query parameters that carry secrets: SAS signatures, presigned-URL signatures and credentials, tokens."""
SECRET_FIELDS = re.compile(
    r"(?i)(\b(?:AccountKey|SharedAccessSignature|SharedAccessKey|account_key|sas_token|client_secret|password)"
    r"['\"]?\s*[=:]\s*['\"]?)[^;&:\s'\",}]+"
)
"""Connection-string fields (``AccountKey=...;``) and option names (``'sas_token': '...'``) that hold secrets."""
CREDENTIAL_HEADER = re.compile(
    r"(?i)(\b(?:authorization|proxy-authorization)['\"]?\s*[=:]\s*['\"]?(?:\w+ )?)[^'\",}:\s]+"
)
"""An ``Authorization`` header's credentials (after its scheme: ``Bearer``, ``Basic``)."""
SAS_SIGNATURE = re.compile(r"(?i)(\bsig=)[^&#:\s'\"]+")
"""A SAS token's signature given without its URL (``sv=...&sig=...``)."""


def redact(text: str) -> str:
    """``text`` with every secret it quotes (signatures, tokens, keys, credentials) replaced by ``REDACTED``.

    Example:
        >>> redact("https://a.blob.core.windows.net/c/m.safetensors?sv=2022-11-02&sig=abc%2Bdef: HTTP 403")
        'https://a.blob.core.windows.net/c/m.safetensors?sv=2022-11-02&sig=REDACTED: HTTP 403'
        >>> redact("DefaultEndpointsProtocol=http;AccountName=dev;AccountKey=Eby8vdM02x==;BlobEndpoint=x")
        'DefaultEndpointsProtocol=http;AccountName=dev;AccountKey=REDACTED;BlobEndpoint=x'
    """
    for pattern in (SECRET_QUERY, SECRET_FIELDS, CREDENTIAL_HEADER, SAS_SIGNATURE):
        text = pattern.sub(lambda match: match.group(1) + REDACTED, text)
    return text


class _Redacting(logging.Filter):
    """Redacts every record of the logger it is on (its message with its arguments in)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


_REDACTING = _Redacting()


def logger(name: str) -> logging.Logger:
    """The logger ``name`` (a module's ``__name__``), with its lines redacted as error messages are.

    Example:
        >>> log = logger("weightstream.sources.objects.azure")
        >>> log.name
        'weightstream.sources.objects.azure'
    """
    named = logging.getLogger(name)
    if _REDACTING not in named.filters:
        named.addFilter(_REDACTING)
    return named


class WeightstreamError(Exception):
    """Root of every error weightstream raises on purpose. Its message is redacted (:func:`redact`)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(redact(arg) if isinstance(arg, str) else arg for arg in args))


class OptionError(WeightstreamError, TypeError):
    """An option name is unknown, or an option has a value of the wrong type."""


class InvalidOptionError(WeightstreamError, ValueError):
    """An option has a value outside what it accepts, or the loader cannot honour it."""


class UnknownFormatError(WeightstreamError, ValueError):
    """No loader is registered under the requested format name."""


class LoaderRegistrationError(WeightstreamError, ValueError):
    """A loader could not be registered or imported."""


class UnsupportedInputError(WeightstreamError, ValueError):
    """The input is of a kind weightstream refuses (pickle files, unknown URI schemes)."""


class MissingDependencyError(UnsupportedInputError, ImportError):
    """A library a source needs (s3's botocore, gs's gcsfs and fsspec) is missing or older than weightstream
    supports."""


class FormatError(WeightstreamError, ValueError):
    """The bytes of a checkpoint do not follow their format."""


class HeaderError(FormatError):
    """A safetensors header breaks a rule of the safetensors specification."""


class ShardIndexError(FormatError):
    """A ``model.safetensors.index.json`` file is malformed or inconsistent."""


class TruncatedFileError(FormatError, EOFError):
    """A file ends before the bytes its header declares."""


class NotFound(WeightstreamError, FileNotFoundError):
    """A file or directory named by the caller or by an index does not exist."""


class ManifestError(FormatError):
    """A sharded-state manifest is malformed, or the files on disk disagree with it (world size,
    missing or extra files, sizes, tensors)."""


class IncompleteSaveError(ManifestError):
    """A save of this rank was interrupted (or is still running): its files are not a state to load."""


class IntegrityError(FormatError):
    """Bytes read do not match the checksum the manifest recorded for them."""


class SaveError(WeightstreamError, OSError):
    """Writing a checkpoint failed (a full disk, a permission); nothing partial is left behind."""


class SourceError(WeightstreamError, OSError):
    """Reading from a source failed with an operating-system error."""


class AccessDeniedError(SourceError, PermissionError):
    """The store refused the credentials (HTTP 401 or 403). ``challenge`` holds its ``WWW-Authenticate`` header."""

    status: int = 0
    challenge: str = ""


class SourceTimeout(SourceError, TimeoutError):
    """A request stalled past its timeout on every attempt, or the load passed its deadline."""


class SourceChangedError(SourceError):
    """A file changed between reading its header and reading its tensors."""


class TensorNotFound(WeightstreamError, KeyError):
    """A tensor asked for by name is not in the checkpoint."""

    def __str__(self) -> str:
        # KeyError quotes its argument; a sentence reads better unquoted.
        return str(self.args[0]) if self.args else ""


class SliceIndexError(WeightstreamError, IndexError):
    """A ``get_slice`` index that torch refuses as an ``IndexError`` (out of range, too many indices), naming the
    tensor."""


class SliceTypeError(WeightstreamError, TypeError):
    """A ``get_slice`` index of a kind torch refuses as a ``TypeError`` (a slice bound that is not an integer)."""


class SliceValueError(WeightstreamError, ValueError):
    """A ``get_slice`` index torch refuses as a ``ValueError`` (a slice step of zero or below)."""


class CheckpointClosedError(WeightstreamError, ValueError):
    """A :class:`weightstream.Checkpoint` (or an iterator it returned) was used after ``close()``."""


class DeviceUnavailableError(WeightstreamError, RuntimeError):
    """The requested destination (a CUDA device, pinned memory) does not exist on this machine."""


class LayerInUseError(WeightstreamError, RuntimeError):
    """The ``layered`` loader needs a buffer back for the next layer, but the caller still references
    the tensors of the layers it holds (keep copies, or pass ``copy_layers=True``)."""


class PeerError(WeightstreamError, RuntimeError):
    """A distributed load lost a peer: another rank failed, stopped early, was killed, or planned another load."""


class HostMemoryError(WeightstreamError, MemoryError):
    """Host memory for the tensors could not be allocated."""


class DeviceMemoryError(WeightstreamError, MemoryError):
    """The device cannot hold the tensors asked for (no partial load is left behind)."""


class BenchmarkError(WeightstreamError, RuntimeError):
    """A benchmark run failed, or its conditions (a cold or warm page cache) could not be established."""


class EngineUnavailableError(WeightstreamError, ImportError):
    """An engine adapter was used, but its engine (vLLM, SGLang) is not installed."""


class WeightsMismatchError(WeightstreamError, ValueError):
    """An engine's model and the checkpoint disagree: parameters the checkpoint did not fill, or
    tensors the model has no parameter for."""


class CacheError(WeightstreamError):
    """The node weight cache failed: the root of its errors (see ``weightstream.nodecache``)."""


class CacheUnavailableError(CacheError, ConnectionError):
    """No cache daemon answers at the socket named (or it stopped answering mid-request)."""


class CacheRefusedError(CacheError, PermissionError):
    """The cache daemon refused the client: another user's process, or a request it does not accept."""


class CacheProtocolError(CacheError, ValueError):
    """A message on the cache's socket is malformed, too large or not what was asked for; or a segment
    the daemon handed over is not what it said (its size, its first bytes' checksum)."""


class CacheFullError(CacheError, MemoryError):
    """The cache cannot hold an entry: its budget, the memory available or the daemon's cgroup limit would be
    exceeded (refused before any byte is read, never left to the kernel's OOM killer)."""


class CacheInUseError(CacheError, RuntimeError):
    """The cache directory (or socket) is another running daemon's: two daemons never share one."""


class CacheConfigError(CacheError, ValueError):
    """An option of ``weightstream cache serve`` is invalid (a size, a group, a directory, a device, a timeout):
    refused before anything starts."""


class FleetUnavailableError(CacheError, ConnectionError):
    """The fleet's coordination service (etcd) does not answer, or answers what is not etcd's API."""


class FleetPeerError(CacheError, ConnectionError):
    """A peer did not serve a piece: it went away, stalled past the bound, or its bytes failed their check."""


class MemoryStillInUseError(CacheError, RuntimeError):
    """A transfer into a fill's memory could not be stopped, so it may still write there: that memory is kept out of
    use for the life of the process and the fill's segment abandoned (the segment store fills a fresh one)."""
