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


CONTEXT = ts.Context(_retries())
"""One TensorStore context for the process, so ``memory://`` stores are shared between a
Recorder and a reader opened in the same process, caches/thread pools are reused, and
remote operations give up after a few retries (:func:`_retries`)."""


def normalize_url(url: str | os.PathLike[str]) -> str:
    """Return a kvstore URL ending in ``/``: local paths become ``file://<abs path>/``."""
    s = os.fspath(url)
    if "://" not in s:
        s = "file://" + os.path.abspath(os.path.expanduser(s))
    return s if s.endswith("/") else s + "/"


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
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, instance metadata). Every other URL
    (``file://``, ``gs://``, ``memory://``) is TensorStore's own URL syntax.
    """
    full = join(url, key) if key else normalize_url(url)
    if not full.startswith("s3://"):
        return full
    bucket, _, path = full[len("s3://") :].partition("/")
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": path}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        spec["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        spec["aws_region"] = region
    return spec


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
