"""``obj``: chunks shared and kept durably in an S3-compatible object store
(AWS S3, MinIO, Ceph RGW), one object per chunk, through boto3.

See docs/shared-tiers.md for its behaviour, outages and why boto3.
"""

from __future__ import annotations

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
from kvtier.tiers.addresses import host_problem, split_url
from kvtier.tiers.backend import (
    MAX_WAIT_S,
    Backend,
    BackendRuntime,
    Exists,
    Fetched,
    PutErrors,
    RemoteTierOptions,
    ValueBuffer,
)
from kvtier.tiers.remote import RemoteTier

#: Error codes of a GET on an object the bucket does not hold. A missing
#: bucket (``NoSuchBucket``) is not among them: that is an outage.
_ABSENT = frozenset({"NoSuchKey"})
#: Error codes of a PUT the store refuses while serving reads: not permitted,
#: or over a quota or out of space (MinIO's codes for the last two).
_REFUSED_WRITES = frozenset(
    {"AccessDenied", "QuotaExceeded", "XMinioStorageFull", "XMinioAdminBucketQuotaExceeded"}
)

_BUCKET_NAME = re.compile(r"[A-Za-z0-9._-]+")
#: What botocore accepts as a region name when it builds a client.
_REGION_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


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

    @field_validator("region")
    @classmethod
    def _check_region(cls, region: str | None) -> str | None:
        if region is not None and not _REGION_NAME.fullmatch(region):
            raise ValueError(
                "a region name is 1 to 63 letters, digits and '-', neither first nor last "
                "(for example us-east-1), or leave it unset for the standard AWS configuration"
            )
        return region

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

    def store_location(self) -> str | None:
        endpoint = self.endpoint_url or f"region {self.region or 'default'}"
        return f"bucket {self.bucket!r} at {endpoint}, prefix {self.prefix!r}"


class ObjectStoreBackend(Backend[ObjectStoreTierOptions]):
    """Chunks as objects, one request per chunk, requests in parallel."""

    Options: ClassVar[type[RemoteTierOptions]] = ObjectStoreTierOptions
    name_separator: ClassVar[str] = "/"
    #: Most chunks of one task; a job is spread over the workers.
    io_batch: ClassVar[int] = 64
    spreads_batches: ClassVar[bool] = True
    #: Objects per existence-check task: small, so a step's checks run in parallel.
    check_batch: ClassVar[int] = 4
    #: A check holds the objects it read until it answers: large ones are
    #: checked one a task, each promoted (and its memory reused) as it comes.
    check_bytes: ClassVar[int] = 1 << 20
    #: An object is as long as its value: any length up to the largest is read.
    variable_payloads: ClassVar[bool] = True

    def __init__(self, options: ObjectStoreTierOptions, runtime: BackendRuntime) -> None:
        super().__init__(options, runtime)
        self._bucket = options.bucket
        where = f" at {options.endpoint_url}" if options.endpoint_url else ""
        self._target = f"bucket {options.bucket!r}{where}"
        # An error building the client (a profile the AWS configuration
        # lacks, say) names the tier and its target, as a failed connection's
        # does. Unbounded: it sends nothing, and startup_timeout_s is the
        # endpoint's (_check_bucket's) to spend.
        with self.starting(self._target):
            self._client_error, self.client = _connect(options)
        try:
            self._check_bucket()
        except BaseException:
            self.client.close()
            raise

    @classmethod
    def name_prefix(cls, options: ObjectStoreTierOptions) -> str:
        return options.prefix

    @property
    def prefetch_bytes(self) -> int:
        # Each check is a GET already, and get_many's values are fresh bytes.
        return int(self.options.prefetch_bytes)

    def _check_bucket(self) -> None:
        from botocore.exceptions import ClientError, NoCredentialsError

        tier_type = self.runtime.tier_type
        try:
            self.runtime.start_backend(self.ping, lambda _: None, self._target)
        except NoCredentialsError as exc:
            raise BackendUnavailableError(
                tier_type,
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
            raise BackendUnavailableError(tier_type, self._target, reason) from exc
        except Exception as exc:
            raise BackendUnavailableError(
                tier_type, self._target, f"endpoint unreachable: {describe_error(exc)}"
            ) from exc

    def _error_code(self, exc: Exception) -> str | None:
        """The S3 error code of a client error, ``None`` for any other failure."""
        if not isinstance(exc, self._client_error):
            return None
        response: dict[str, Any] = getattr(exc, "response", {})  # botocore's ClientError has it
        return str(response.get("Error", {}).get("Code", ""))

    def _is_absent(self, exc: Exception) -> bool:
        return self._error_code(exc) in _ABSENT

    def refuses(self, error: BaseException) -> bool:
        return isinstance(error, Exception) and self._error_code(error) in _REFUSED_WRITES

    def exists_many(self, names: Sequence[str]) -> list[Exists]:
        found: list[Exists] = []
        for name in names:
            self.runtime.check_sending()
            try:
                reply = self.client.get_object(Bucket=self._bucket, Key=name, Range="bytes=0-0")
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
            self.runtime.answered()
        return found

    def put_many(self, names: Sequence[str], values: Sequence[ValueBuffer]) -> PutErrors:
        errors: PutErrors = []
        for name, value in zip(names, values, strict=True):
            self.runtime.check_sending()
            try:
                # botocore takes bytes-like bodies but not a memoryview (a
                # variable-size value is a view of the start of its buffer).
                body = bytes(value) if isinstance(value, memoryview) else value
                self.client.put_object(Bucket=self._bucket, Key=name, Body=body)
                errors.append(None)
                self.runtime.answered()
            except self._client_error as exc:
                errors.append(exc)
        return errors

    def get_many(self, names: Sequence[str]) -> list[Fetched]:
        values: list[Fetched] = []
        for name in names:
            self.runtime.check_sending()
            try:
                reply = self.client.get_object(Bucket=self._bucket, Key=name)
            except Exception as exc:
                if not self._is_absent(exc):
                    raise
                values.append(None)
                self.runtime.answered()
                continue
            body = reply["Body"]
            try:
                # Never pull a foreign object of another size into memory.
                if not self._sized_as_a_value(reply.get("ContentLength")):
                    values.append(
                        CorruptChunkError(
                            f"object holds {reply.get('ContentLength')} bytes, "
                            f"a chunk is {self.runtime.value_bytes}"
                        )
                    )
                else:
                    values.append(body.read())
            finally:
                body.close()
            self.runtime.answered()
        return values

    def _sized_as_a_value(self, length: object) -> bool:
        """Whether an object of ``length`` bytes may hold one of this tier's
        values: exactly the runtime's value size, or under a variable-size
        codec a header and at most a chunk's largest payload (its header's
        length and checksum then decide)."""
        if type(length) is not int:
            return False
        if self.runtime.fixed_value_size:
            return length == self.runtime.value_bytes
        return integrity.HEADER_BYTES < length <= self.runtime.value_bytes

    def delete(self, name: str) -> None:
        self.client.delete_object(Bucket=self._bucket, Key=name)

    def ping(self) -> None:
        self.client.head_bucket(Bucket=self._bucket)

    def close(self) -> None:
        self.client.close()

    def describe(self) -> dict[str, object]:
        options = self.options
        return {
            "bucket": options.bucket,
            "prefix": options.prefix,
            "endpoint_url": options.endpoint_url,
            "region": self.client.meta.region_name,
        }


class ObjectStoreTier(RemoteTier[ObjectStoreTierOptions]):
    """The ``obj`` tier: the remote-tier runtime over :class:`ObjectStoreBackend`."""

    backend_class = ObjectStoreBackend


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
        import botocore.session
        from botocore.config import Config
        from botocore.exceptions import ClientError
    except ImportError as exc:
        raise MissingDependencyError("boto3", "obj") from exc

    def secret(value: SecretStr | None) -> str | None:
        return None if value is None else value.get_secret_value()

    # The tier reads no date of an object, and botocore parses each reply's
    # Last-Modified with dateutil: about a tenth of a GET's CPU on the client,
    # which moves every chunk. A session of its own keeps them text, and
    # leaves the process's other boto3 clients as they were.
    core = botocore.session.get_session()
    core.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=str)
    session = boto3.session.Session(
        botocore_session=core,
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
