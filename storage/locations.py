"""Where a store or cache lives: a local directory (a `pathlib.Path`) or an fsspec URL (a `UrlPath`).

`location` tells the two apart and refuses a scheme stores cannot be written to, so that a URL is never turned
into a local directory. S3 takes its credentials, region and endpoint from the usual AWS variables
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL)."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Union

import fsspec

from storage.errors import StoreAccessError, UnsupportedLocationError

# The URL schemes a store can be written to, with the install that provides each (None: always there).
SCHEMES = {"s3": "pip install 'preinfer[s3]'", "memory": None}
# Each scheme's package, imported to check that it is installed.
_PACKAGES = {"s3": "s3fs"}


def _scheme(text: str) -> str | None:
    """The URL scheme of `text`, or None for a local path (file:// included)."""
    scheme, sep, _ = text.partition("://")
    if not sep or scheme == "file" or not scheme.replace("+", "").replace("-", "").replace(".", "").isalnum():
        return None
    return scheme.lower()


def check_url(url: str) -> None:
    """Raise UnsupportedLocationError unless stores can be written under the fsspec URL `url`."""
    scheme = _scheme(url)
    if scheme not in SCHEMES:
        raise UnsupportedLocationError(
            f"{url}: stores cannot be written to {scheme}:// URLs; use a local path, s3://BUCKET/PATH or memory://NAME"
        )
    package = _PACKAGES.get(scheme)
    if package is not None:
        try:
            __import__(package)
        except ImportError:
            raise UnsupportedLocationError(f"{url}: {scheme}:// needs {package}: {SCHEMES[scheme]}") from None
    if not url.partition("://")[2].strip("/"):
        raise UnsupportedLocationError(f"{url}: the URL names no bucket or path")


def storage_options(url: str) -> dict[str, Any]:
    """The fsspec options for `url`: for s3://, the endpoint from AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL (if set)
    and no listings cache (other processes write the same store)."""
    if _scheme(url) != "s3":
        return {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return {"use_listings_cache": False, **({"endpoint_url": endpoint} if endpoint else {})}


def filesystem(url: str) -> tuple[RemoteFilesystem, str]:
    """The fsspec filesystem of a checked URL (its refusals translated, `RemoteFilesystem`) and the path inside it."""
    check_url(url)
    fs, path = fsspec.core.url_to_fs(url, **storage_options(url))
    return RemoteFilesystem(fs, url), path


def access_refusal(err: BaseException, url: str) -> StoreAccessError | None:
    """The one-line StoreAccessError of an object store's refusal `err` at `url` (botocore's: no credentials, an
    endpoint that does not answer), or None for any other error."""
    botocore = sys.modules.get("botocore.exceptions")  # loaded by s3fs; an error of its can come from nowhere else
    if botocore is None:
        return None
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if isinstance(err, (botocore.NoCredentialsError, botocore.PartialCredentialsError)):
        return StoreAccessError(f"{url}: no usable AWS credentials (botocore: {text}); set AWS_ACCESS_KEY_ID and "
                                f"AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), then run the same command again")
    if isinstance(err, botocore.ConnectionError):
        return StoreAccessError(f"{url}: the S3 endpoint does not answer (botocore: {text}); check --s3-endpoint "
                                f"(AWS_ENDPOINT_URL_S3) and the network, then run the same command again")
    return None


@contextlib.contextmanager
def refusals_translated(url: str) -> Iterator[None]:
    """Turn an object store's refusal inside the block into its StoreAccessError (`access_refusal`)."""
    try:
        yield
    except Exception as err:
        refusal = access_refusal(err, url)
        if refusal is None:
            raise
        raise refusal from None


class RemoteFilesystem:
    """An fsspec filesystem whose every call turns an object store's refusal into a StoreAccessError naming the
    location (`access_refusal`); any other error, and every attribute, as the filesystem's own."""

    def __init__(self, fs: fsspec.AbstractFileSystem, url: str) -> None:
        self._fs, self._url = fs, url

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._fs, name)
        return self._translated(attribute) if callable(attribute) else attribute

    def _translated(self, method: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            with refusals_translated(self._url):
                return method(*args, **kwargs)
        return call


class UrlPath:
    """A directory or file behind an fsspec URL, with the part of pathlib.Path's interface that cache
    directories use (no os.fspath: a URL must never be opened as a local path)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.fs, self.fs_path = filesystem(self.url)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"UrlPath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UrlPath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __truediv__(self, name: str) -> UrlPath:
        return UrlPath(f"{self.url}/{name}")

    @property
    def name(self) -> str:
        """The last part of the URL."""
        return self.url.rsplit("/", 1)[-1]

    @property
    def parent(self) -> UrlPath:
        """The URL one level up (the bucket's root stays itself)."""
        scheme, _, rest = self.url.partition("://")
        return UrlPath(f"{scheme}://{rest.rsplit('/', 1)[0]}") if "/" in rest.strip("/") else self

    def resolve(self) -> UrlPath:
        """Itself: a URL is already absolute."""
        return self

    def exists(self) -> bool:
        return self.fs.exists(self.fs_path)

    def is_dir(self) -> bool:
        return self.fs.isdir(self.fs_path)

    def is_file(self) -> bool:
        return self.fs.isfile(self.fs_path)

    def iterdir(self) -> Iterator[UrlPath]:
        for entry in self.fs.ls(self.fs_path, detail=False):
            yield self / entry.rstrip("/").rsplit("/", 1)[-1]

    def read_bytes(self) -> bytes:
        return self.fs.cat_file(self.fs_path)

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def unlink(self, missing_ok: bool = False) -> None:
        if missing_ok and not self.fs.exists(self.fs_path):
            return
        self.fs.rm_file(self.fs_path)


Location = Union[Path, UrlPath]


def location(path: str | os.PathLike | UrlPath) -> Location:
    """A local path as a Path (file:// stripped), an fsspec URL as a UrlPath; refuses a scheme stores cannot be
    written to (UnsupportedLocationError) instead of taking it for a local directory."""
    if isinstance(path, (Path, UrlPath)):
        return path
    text = os.fspath(path)
    if _scheme(text) is None:
        return Path(text.removeprefix("file://"))
    return UrlPath(text)


def remove_tree(path: Location) -> None:
    """Delete the directory `path` and everything under it (nothing if it is not there)."""
    if isinstance(path, UrlPath):
        if path.exists():
            path.fs.rm(path.fs_path, recursive=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def disk_bytes(path: Location) -> int:
    """Bytes of every file under the directory `path` (objects under the prefix, for a URL)."""
    if isinstance(path, UrlPath):
        return sum(info["size"] for info in path.fs.find(path.fs_path, detail=True).values()) if path.exists() else 0
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def free_bytes(path: Location) -> int | None:
    """Free bytes on the disk that holds (or would hold) `path`; None for object storage (no such limit)."""
    if isinstance(path, UrlPath):
        return None
    return shutil.disk_usage(next(p for p in (path, *path.absolute().parents) if p.exists())).free
