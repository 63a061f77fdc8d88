"""What object stores need beyond pyarrow.fs: opened from a URI with bounded waits (S3, GCS), and
the conditional create the run lock uses on S3 (pyarrow has no way to send `If-None-Match`)."""

from __future__ import annotations

import errno as errno_codes

from raytrain.errors import StorageError
from raytrain.rundir.faults import boto_token, cause_of

# S3 requests: connecting, a transfer that moves no byte (curl's low-speed limit: a long upload
# that keeps moving never times out), and pyarrow's own attempts per request.
S3_CONNECT_TIMEOUT_S, S3_STALL_TIMEOUT_S, S3_ATTEMPTS = 5.0, 10.0, 2
# gs:// without credentials retries inside google-cloud-cpp for about 15 minutes: bound it.
GCS_RETRY_LIMIT_S = 15


def open_store(uri: str, shown: str):
    """(file system, path inside it) of an object-store URI (`shown` in messages: no credentials);
    a StorageError naming the fix when pyarrow cannot open it."""
    import pyarrow.fs as pafs

    if uri.split("://", 1)[0] in ("gs", "gcs") and "retry_limit_seconds" not in uri:
        uri += ("&" if "?" in uri else "?") + f"retry_limit_seconds={GCS_RETRY_LIMIT_S}"
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except Exception as exc:  # ArrowInvalid for an unknown scheme or option
        raise StorageError(
            errno_codes.EINVAL,
            f"--storage {shown}: pyarrow cannot open it ({cause_of(exc)}); give a local path, s3://BUCKET/PREFIX, "
            "gs://BUCKET/PREFIX or another URI pyarrow.fs resolves",
        ) from None
    return (bounded(fs) if isinstance(fs, pafs.S3FileSystem) else fs), path


def bounded(fs):
    """The S3 file system with bounded waits: pyarrow's defaults leave a store that stopped
    answering blocking one write for 90 s; this `Store`'s own retries decide how long to wait."""
    import pyarrow.fs as pafs

    options = dict(fs.__reduce__()[1][0])
    options.update(
        connect_timeout=S3_CONNECT_TIMEOUT_S,
        request_timeout=S3_STALL_TIMEOUT_S,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=S3_ATTEMPTS),
    )
    return pafs.S3FileSystem(**options)


def put_if_absent(fs, path: str, data: bytes) -> bool:
    """Create the object at `path` (bucket/key) only if there is none: S3's conditional write
    (`If-None-Match: *`; False when one is there). pyarrow cannot send it: boto3, with the
    endpoint, region and keys of `fs`."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    options = fs.__reduce__()[1][0]
    endpoint = options.get("endpoint_override") or None
    if endpoint and "://" not in endpoint:
        endpoint = f"{options.get('scheme') or 'https'}://{endpoint}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=options.get("region") or None,
        aws_access_key_id=options.get("access_key"),
        aws_secret_access_key=options.get("secret_key"),
        aws_session_token=options.get("session_token") or None,
    )
    bucket, _, key = path.partition("/")
    try:
        client.put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in ("PreconditionFailed", "ConditionalRequestConflict") or "412" in str(code):
            return False
        raise OSError(f"AWS Error {boto_token(code)} during PutObject operation: {exc}") from None
    except BotoCoreError as exc:  # connection refused, timeouts, no credentials
        raise OSError(f"AWS Error NETWORK_CONNECTION during PutObject operation: {exc}") from None
    return True


__all__ = ["GCS_RETRY_LIMIT_S", "bounded", "open_store", "put_if_absent"]
