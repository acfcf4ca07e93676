"""Store locations: local paths and TensorStore kvstore URLs, and small-key I/O."""

from __future__ import annotations

import json
import os
from typing import Any

import tensorstore as ts


def _retries() -> dict[str, Any]:
    """Bounded retries for remote kvstores: ``$TRAINTAPE_REMOTE_RETRIES`` attempts (default
    4) with 0.2-2 s backoff, so an unreachable endpoint is an error naming the URL in
    seconds instead of TensorStore's default of 32 attempts (about 15 minutes)."""
    try:
        n = max(1, int(os.environ.get("TRAINTAPE_REMOTE_RETRIES", "4")))
    except ValueError:
        n = 4
    policy = {"max_retries": n, "initial_delay": "200ms", "max_delay": "2s"}
    return {"gcs_request_retries": policy, "s3_request_retries": policy}


def _request_timeouts() -> None:
    """Request timeouts for remote (HTTP) kvstores: TensorStore's curl transport sets no
    deadline on a transfer by default, so an endpoint that accepts a connection and stops
    answering (a frozen server, a network partition) would hold a request for as long as
    TCP keeps the socket (tens of minutes). A transfer slower than 1 byte/s for
    ``$TRAINTAPE_REMOTE_TIMEOUT`` seconds (default 30) fails and is retried
    (:func:`_retries`), and a connection not established in that time fails too. Set in
    the environment before TensorStore's transport starts; explicit ``TENSORSTORE_CURL_*``
    settings win. The writer's own deadline (``Recorder(write_timeout=...)``) bounds
    what training waits for, whatever the kvstore."""
    try:
        t = float(os.environ.get("TRAINTAPE_REMOTE_TIMEOUT", "30"))
    except ValueError:
        t = 30.0
    seconds = str(max(1, round(t)))
    os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", seconds)
    os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES", "1")
    os.environ.setdefault("TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS", seconds)


_request_timeouts()

CONTEXT = ts.Context(_retries())
"""One TensorStore context for the process, so ``memory://`` stores are shared between a
Recorder and a reader opened in the same process, caches/thread pools are reused, and
remote operations give up after a few retries (:func:`_retries`)."""


SPEC_PREFIX = "tsspec:"
"""Prefix of a location given as a TensorStore kvstore spec (see :func:`normalize_url`)."""

Location = str | os.PathLike[str] | dict[str, Any]
"""Where a store is: a local path, a kvstore URL, or a TensorStore kvstore spec (a dict,
or its JSON text)."""


def normalize_url(url: Location) -> str:
    """Return the location as a URL string ending in ``/``.

    Local paths become ``file://<abs path>/``. A TensorStore kvstore spec — a dict such as
    ``{"driver": "s3", "bucket": "b", "path": "runs/a", "endpoint": "http://..."}`` or
    its JSON text — becomes ``tsspec:<canonical JSON>/`` (a ``file`` spec becomes its
    ``file://`` URL), so it goes wherever a URL goes; keys inside the store are appended
    after the JSON and join the spec's ``path`` when the kvstore is opened
    (:func:`kvstore_spec`). Raises ValueError naming a malformed spec.
    """
    if isinstance(url, dict):
        return _spec_url(url)
    s = os.fspath(url)
    if s.lstrip().startswith("{"):
        try:
            spec = json.loads(s)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"store location {s!r} is neither a path nor a URL nor JSON: {e}"
            ) from None
        return _spec_url(spec)
    if "://" not in s and not s.startswith(SPEC_PREFIX):
        s = "file://" + os.path.abspath(os.path.expanduser(s))
    return s if s.endswith("/") else s + "/"


def _spec_url(spec: Any) -> str:
    if not isinstance(spec, dict) or not isinstance(spec.get("driver"), str):
        raise ValueError(f"a kvstore spec is a JSON object with a 'driver': got {spec!r}")
    if spec["driver"] == "file" and set(spec) <= {"driver", "path"}:
        return normalize_url(str(spec.get("path", ".")))
    try:
        ts.KvStore.Spec(spec)  # TensorStore's own check of the spec
    except Exception as e:
        raise ValueError(f"invalid kvstore spec {spec!r}: {e}") from None
    text = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return f"{SPEC_PREFIX}{text}/"


def is_local(url: Location) -> bool:
    """True for a location on the local filesystem (a path or ``file://``)."""
    return local_path(normalize_url(url)) is not None


def local_path(url: str) -> str | None:
    """The filesystem path of a ``file://`` URL, else None."""
    u = normalize_url(url)
    return u[len("file://") : -1] or "/" if u.startswith("file://") else None


def join(url: str, key: str) -> str:
    return normalize_url(url) + key.strip("/") + "/"


def kvstore_spec(url: str, key: str = "") -> str | dict[str, Any]:
    """The TensorStore kvstore of ``url`` (+ ``key``, a path inside it): the one place a
    location becomes a kvstore.

    ``s3://bucket/prefix`` takes the standard AWS settings from the environment:
    endpoint ``$AWS_ENDPOINT_URL_S3`` or ``$AWS_ENDPOINT_URL`` (MinIO, a local test
    server, any S3-compatible store), region ``$AWS_REGION`` or ``$AWS_DEFAULT_REGION``;
    credentials come from TensorStore's AWS credential chain (``AWS_ACCESS_KEY_ID`` /
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, instance metadata). A spec location
    (``tsspec:``, :func:`normalize_url`) is the spec with the key joined to its ``path``
    (an S3 spec takes the environment's endpoint/region only where it sets none). Every
    other URL (``file://``, ``gs://``, ``memory://``) is TensorStore's own URL syntax.
    """
    full = join(url, key) if key else normalize_url(url)
    if full.startswith(SPEC_PREFIX):
        spec, end = json.JSONDecoder().raw_decode(full, len(SPEC_PREFIX))
        base = str(spec.get("path", ""))
        sub = full[end:].strip("/")
        if sub:
            spec["path"] = f"{base.rstrip('/')}/{sub}/" if base else f"{sub}/"
        elif base and not base.endswith("/"):
            spec["path"] = base + "/"
        return _s3_defaults(spec) if spec["driver"] == "s3" else spec
    if not full.startswith("s3://"):
        return full
    bucket, _, path = full[len("s3://") :].partition("/")
    return _s3_defaults({"driver": "s3", "bucket": bucket, "path": path})


def _s3_defaults(spec: dict[str, Any]) -> dict[str, Any]:
    """Endpoint and region from the AWS environment where the spec does not set them."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and "endpoint" not in spec:
        spec["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region and "aws_region" not in spec:
        spec["aws_region"] = region
    if (
        "aws_credentials" not in spec
        and os.environ.get("AWS_ACCESS_KEY_ID")
        and os.environ.get("AWS_SECRET_ACCESS_KEY")
    ):
        # the credentials are in the environment: take them from there. TensorStore's
        # default chain would find the same ones, but first builds every other provider
        # (profile files, web identity), and the AWS SDK logs a missing ~/.aws/config —
        # the normal case here — as an error line on stderr.
        spec["aws_credentials"] = {"type": "environment"}
    return spec


KEY_SUFFIX = 64
"""Characters kept free after an array's path for its longest key: ``/c/<index>/0/...``
chunk keys of up to 16 dimensions and temporary files (``<key>.<n>.__lock``)."""

REMOTE_KEY_BYTES = 1024
"""The object-key limit of S3 and GCS (UTF-8 bytes)."""


def check_key_length(url: str, array_path: str, ndim: int = 1) -> str | None:
    """Why the keys of the array at ``array_path`` of the store at ``url`` would exceed
    the storage's limits (a local file system's component and path lengths, an object
    store's key length), or None when they fit."""
    path = local_path(url)
    extra = KEY_SUFFIX + 2 * ndim
    if path is not None:
        probe = path
        while probe and not os.path.isdir(probe):
            probe = os.path.dirname(probe) or "/"
        try:
            name_max = os.pathconf(probe or "/", "PC_NAME_MAX")
            path_max = os.pathconf(probe or "/", "PC_PATH_MAX")
        except (OSError, ValueError):
            name_max, path_max = 255, 4096
        for seg in array_path.split("/"):
            if len(os.fsencode(seg)) > name_max:
                return (
                    f"its path segment {seg[:40]!r}... has {len(os.fsencode(seg))} bytes, "
                    f"more than the file system's {name_max}"
                )
        full = len(os.fsencode(os.path.join(path, array_path))) + extra
        if full > path_max:
            return (
                f"its files' paths would have about {full} bytes, more than the file "
                f"system's {path_max}"
            )
        return None
    spec = kvstore_spec(url, array_path)
    if isinstance(spec, dict) and spec.get("driver") in ("s3", "gcs"):
        key = len(str(spec.get("path", "")).encode()) + extra
    elif url.startswith(("s3://", "gs://")):
        key = len(url.split("://", 1)[1].partition("/")[2].encode()) + len(array_path) + extra
    else:
        return None
    if key > REMOTE_KEY_BYTES:
        return f"its object keys would have about {key} bytes, more than the {REMOTE_KEY_BYTES} allowed"
    return None


class KvStore:
    """Small-object access (JSON documents, listings) to a store's kvstore."""

    def __init__(self, url: str) -> None:
        self.url = normalize_url(url)
        self._kv = ts.KvStore.open(kvstore_spec(self.url), context=CONTEXT).result()

    @property
    def kv(self) -> ts.KvStore:
        """The TensorStore kvstore (for conditional writes: :mod:`traintape.core.claim`)."""
        return self._kv

    def delete(self, key: str) -> None:
        self._kv.write(key, None).result()

    def read_bytes(self, key: str) -> bytes | None:
        r = self._kv.read(key).result()
        return None if r.state == "missing" else bytes(r.value)

    def read_json(self, key: str) -> Any | None:
        raw = self.read_bytes(key)
        return None if raw is None else json.loads(raw)

    def write_json(self, key: str, obj: Any) -> None:
        """Write a JSON document atomically (a single kvstore write, durable on return)."""
        self._kv.write(key, json.dumps(obj, indent=1, sort_keys=True).encode()).result()

    def write_bytes(self, key: str, data: bytes) -> None:
        self._kv.write(key, data).result()

    def list(self, prefix: str = "") -> list[str]:
        keys = (
            self._kv.list(ts.KvStore.KeyRange(prefix, "")).result()
            if prefix
            else self._kv.list().result()
        )
        out = [k.decode() for k in keys]
        return [k for k in out if k.startswith(prefix)]

    def delete_all(self) -> None:
        self._kv.delete_range(ts.KvStore.KeyRange()).result()
