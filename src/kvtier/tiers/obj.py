"""``obj``: chunks shared and kept durably in an S3-compatible object store
(AWS S3, MinIO, Ceph RGW), one object per chunk, through boto3.

See docs/shared-tiers.md for its behaviour, outages and why boto3.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

from pydantic import ByteSize, Field, SecretStr, field_validator, model_validator

from kvtier import integrity
from kvtier.errors import (
    BackendUnavailableError,
    CorruptChunkError,
    MissingDependencyError,
    describe_error,
)
from kvtier.keys import ChunkKey
from kvtier.tiers.addresses import host_problem, split_url
from kvtier.tiers.base import TierOptions
from kvtier.tiers.remote import (
    MAX_WAIT_S,
    Exists,
    Fetched,
    PutErrors,
    RemoteTier,
    RemoteTierOptions,
    ValueBuffer,
)

#: Error codes of a GET on an object the bucket does not hold. A missing
#: bucket (``NoSuchBucket``) is not among them: that is an outage.
_ABSENT = frozenset({"NoSuchKey"})
#: Error codes of a PUT the store refuses while serving reads: not permitted,
#: or over a quota or out of space (MinIO's codes for the last two).
_REFUSED_WRITES = frozenset(
    {"AccessDenied", "QuotaExceeded", "XMinioStorageFull", "XMinioAdminBucketQuotaExceeded"}
)

_BUCKET_NAME = re.compile(r"[A-Za-z0-9._-]+")


class ObjectStoreTierOptions(RemoteTierOptions):
    bucket: str = Field(min_length=3, max_length=63)
    """The bucket holding the chunks; it must exist."""

    prefix: str = "kvtier/"
    """Prepended to every object name, before the namespace and chunk digests."""

    endpoint_url: str | None = None
    """S3 endpoint (``http://minio:9000``); AWS S3 when unset."""

    region: str | None = None
    """Region of the bucket; from the standard AWS configuration when unset."""

    profile: str | None = None
    """A named profile of the shared AWS configuration to take credentials from."""

    access_key_id: SecretStr | None = None
    """Access key; when unset, the standard AWS credential chain is used."""

    secret_access_key: SecretStr | None = None
    """Secret key, together with ``access_key_id``."""

    session_token: SecretStr | None = None
    """Session token of temporary credentials, with the two keys."""

    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    """``path`` for endpoints without per-bucket host names (most MinIO setups)."""

    io_threads: int = Field(default=16, ge=1, le=256)
    """Maximum concurrent requests: worker threads and pooled HTTP connections."""

    connect_timeout_s: float = Field(default=2.0, gt=0, le=MAX_WAIT_S)
    """Seconds to wait for a connection to open."""

    read_timeout_s: float = Field(default=10.0, gt=0, le=MAX_WAIT_S)
    """Seconds to wait for any read on an open connection."""

    retries: int = Field(default=2, ge=0, le=10)
    """Further attempts after a throttled, failed or timed-out request."""

    prefetch_bytes: ByteSize = Field(default=ByteSize(256 << 20), ge=0)
    """Most bytes of objects that existence checks read whole and hold for
    the promotion that follows (a cold chunk then costs one request, not
    two). Checks past it only ask whether the object is there; ``0``: always."""

    @field_validator("bucket")
    @classmethod
    def _check_bucket_name(cls, bucket: str) -> str:
        # The characters any S3 client accepts; a server may ask for fewer
        # (AWS and MinIO: lowercase letters, digits, '.' and '-').
        if not _BUCKET_NAME.fullmatch(bucket):
            raise ValueError(
                "a bucket name holds letters, digits, '.', '-' and '_' only "
                "(S3 rules: lowercase letters, digits, '.' and '-', for example kv-cache)"
            )
        return bucket

    @field_validator("endpoint_url")
    @classmethod
    def _check_endpoint(cls, url: str | None) -> str | None:
        if url is not None:
            problem = _endpoint_problem(url)
            if problem:
                raise ValueError(
                    f"{problem}; write it as http://host:port or https://host "
                    "(for example http://minio:9000), or leave it unset for AWS S3"
                )
        return url

    @model_validator(mode="after")
    def _check_credentials(self) -> ObjectStoreTierOptions:
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError("set both 'access_key_id' and 'secret_access_key', or neither")
        if self.session_token is not None and self.access_key_id is None:
            raise ValueError("'session_token' needs 'access_key_id' and 'secret_access_key'")
        if self.profile is not None and self.access_key_id is not None:
            raise ValueError("set either 'profile' or explicit keys, not both")
        return self


class ObjectStoreTier(RemoteTier[ObjectStoreTierOptions]):
    """Chunks as framed objects, one request per chunk, requests in parallel."""

    Options: ClassVar[type[TierOptions]] = ObjectStoreTierOptions
    name_separator: ClassVar[str] = "/"
    #: Most chunks of one task; :meth:`_split` spreads a job over the workers.
    io_batch: ClassVar[int] = 64
    #: Objects per existence-check task: small, so a step's checks run in parallel.
    check_batch: ClassVar[int] = 4
    #: An object is as long as its value: any length up to the largest is read.
    variable_payloads: ClassVar[bool] = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        options = self.options
        self._bucket = options.bucket
        self._set_name_prefix(options.prefix)
        where = f" at {options.endpoint_url}" if options.endpoint_url else ""
        self._target = f"bucket {options.bucket!r}{where}"
        self._client: Any = None
        try:
            self._client_error, self._client = _connect(options)
            self._check_bucket()
            if options.prefetch_bytes:
                # Each check is a GET already, and _get_many's values are fresh bytes.
                self._hold_checked_values(int(options.prefetch_bytes))
        except BaseException:
            self.shutdown()
            raise

    def _split(self, pending: list[tuple[ChunkKey, int]]) -> list[list[tuple[ChunkKey, int]]]:
        # One request per chunk, so a task per worker: a job's chunks run in
        # parallel, and once the backend is known down each task stops
        # sending instead of a queue of one-chunk tasks each paying a timeout.
        options = self.options
        size = min(self.io_batch, max(1, math.ceil(len(pending) / options.io_threads)))
        return [pending[i : i + size] for i in range(0, len(pending), size)]

    def _check_bucket(self) -> None:
        from botocore.exceptions import ClientError, NoCredentialsError

        try:
            self._start(self._ping, lambda _: None, self._target)
        except NoCredentialsError as exc:
            raise BackendUnavailableError(
                self.tier_type,
                self._target,
                "no credentials: set access_key_id and secret_access_key, or a profile, "
                "or configure the standard AWS credential chain",
            ) from exc
        except BackendUnavailableError:
            raise
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            reason = {
                "404": "the bucket does not exist",
                "NoSuchBucket": "the bucket does not exist",
                "403": "access denied: check the credentials and the bucket policy",
            }.get(code, describe_error(exc))
            raise BackendUnavailableError(self.tier_type, self._target, reason) from exc
        except Exception as exc:
            raise BackendUnavailableError(
                self.tier_type, self._target, f"endpoint unreachable: {describe_error(exc)}"
            ) from exc

    def _error_code(self, exc: Exception) -> str | None:
        """The S3 error code of a client error, ``None`` for any other failure."""
        if not isinstance(exc, self._client_error):
            return None
        response: dict[str, Any] = getattr(exc, "response", {})  # botocore's ClientError has it
        return str(response.get("Error", {}).get("Code", ""))

    def _is_absent(self, exc: Exception) -> bool:
        return self._error_code(exc) in _ABSENT

    def _refuses_write(self, error: BaseException) -> bool:
        return isinstance(error, Exception) and self._error_code(error) in _REFUSED_WRITES

    def _exists_many(self, names: Sequence[str]) -> list[Exists]:
        found: list[Exists] = []
        for name in names:
            self._check_sending()
            try:
                reply = self._client.get_object(Bucket=self._bucket, Key=name, Range="bytes=0-0")
                reply["Body"].close()
                found.append(True)
            except Exception as exc:
                code = self._error_code(exc)
                if code == "InvalidRange":  # an empty object: there, and corrupt when loaded
                    found.append(True)
                elif code in _ABSENT:
                    found.append(False)
                else:
                    raise
            self._answered()
        return found

    def _put_many(self, names: Sequence[str], values: Sequence[ValueBuffer]) -> PutErrors:
        errors: PutErrors = []
        for name, value in zip(names, values, strict=True):
            self._check_sending()
            try:
                # botocore takes bytes-like bodies but not a memoryview (a
                # variable-size value is a view of the start of its buffer).
                body = bytes(value) if isinstance(value, memoryview) else value
                self._client.put_object(Bucket=self._bucket, Key=name, Body=body)
                errors.append(None)
                self._answered()
            except self._client_error as exc:
                errors.append(exc)
        return errors

    def _get_many(self, names: Sequence[str]) -> list[Fetched]:
        values: list[Fetched] = []
        for name in names:
            self._check_sending()
            try:
                reply = self._client.get_object(Bucket=self._bucket, Key=name)
            except Exception as exc:
                if not self._is_absent(exc):
                    raise
                values.append(None)
                self._answered()
                continue
            body = reply["Body"]
            try:
                # Never pull a foreign object of another size into memory.
                if not self._sized_as_a_value(reply.get("ContentLength")):
                    values.append(
                        CorruptChunkError(
                            f"object holds {reply.get('ContentLength')} bytes, "
                            f"a chunk is {self.value_bytes}"
                        )
                    )
                else:
                    values.append(body.read())
            finally:
                body.close()
            self._answered()
        return values

    def _sized_as_a_value(self, length: object) -> bool:
        """Whether an object of ``length`` bytes may hold one of this tier's
        values: exactly :attr:`value_bytes`, or under a variable-size codec
        a header and at most a chunk's largest payload (its header's length
        and checksum then decide)."""
        if type(length) is not int:
            return False
        if self.codec_stage.fixed_size:
            return length == self.value_bytes
        return integrity.HEADER_BYTES < length <= self.value_bytes

    def _delete(self, name: str) -> None:
        self._client.delete_object(Bucket=self._bucket, Key=name)

    def _ping(self) -> None:
        self._client.head_bucket(Bucket=self._bucket)

    def _close(self) -> None:
        super()._close()
        if self._client is not None:
            self._client.close()

    def describe(self) -> dict[str, object]:
        options = self.options
        return {
            **super().describe(),
            "bucket": options.bucket,
            "prefix": options.prefix,
            "endpoint_url": options.endpoint_url,
            "region": self._client.meta.region_name if self._client is not None else None,
        }


def _endpoint_problem(url: str) -> str | None:
    """What is wrong with an S3 endpoint URL, or ``None``."""
    try:
        parts = split_url(url, ("http", "https"))
    except ValueError as exc:
        return str(exc)
    # botocore refuses host names with '_' when it builds the client.
    return host_problem(parts.hostname or "", underscores=False)


def _connect(options: ObjectStoreTierOptions) -> tuple[type[Exception], Any]:
    """botocore's ``ClientError`` and an S3 client configured from ``options``."""
    try:
        import boto3.session
        from botocore.config import Config
        from botocore.exceptions import ClientError
    except ImportError as exc:
        raise MissingDependencyError("boto3", "obj") from exc

    def secret(value: SecretStr | None) -> str | None:
        return None if value is None else value.get_secret_value()

    session = boto3.session.Session(
        aws_access_key_id=secret(options.access_key_id),
        aws_secret_access_key=secret(options.secret_access_key),
        aws_session_token=secret(options.session_token),
        region_name=options.region,
        profile_name=options.profile,
    )
    config = Config(
        connect_timeout=options.connect_timeout_s,
        read_timeout=options.read_timeout_s,
        retries={"total_max_attempts": options.retries + 1, "mode": "standard"},
        max_pool_connections=options.io_threads,
        s3={"addressing_style": options.addressing_style},
        tcp_keepalive=True,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    client = session.client("s3", endpoint_url=options.endpoint_url, config=config)
    return ClientError, client
