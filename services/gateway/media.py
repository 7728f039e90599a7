"""Images that requests send by URL, read as vLLM reads them: a ``data:`` URL holding the bytes (base64), an
``http(s)`` URL the gateway fetches (within a time and a size limit, only from --allowed-media-domains when
given, only a content type of image/*), or a ``file://`` URL only under --allowed-local-media-path. Every
failure is an InvalidParameter naming the request field that held the URL.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from shared.invalid_parameter import InvalidParameter

DEFAULT_LIMITS = {"image": 8}  # images a prompt may hold, unless --limit-mm-per-prompt says
MAX_IMAGE_PIXELS = 50_000_000  # a decoded image's pixels (PIL's own bomb limit is 3.5 times that)


@dataclass(frozen=True)
class MediaOptions:
    allowed_domains: tuple[str, ...] | None = None  # hosts (and their subdomains) URLs may name; None: any
    allowed_local_path: Path | None = None  # the folder file:// URLs may read under; None: no file:// URL
    fetch_timeout_s: float = 10.0
    max_image_bytes: int = 20 << 20
    max_images_per_prompt: int = DEFAULT_LIMITS["image"]

    @classmethod
    def from_args(cls, args) -> MediaOptions:
        limits = parse_limits(args.limit_mm_per_prompt)
        if not args.media_fetch_timeout > 0 or args.max_image_bytes < 1:
            raise ValueError("--media-fetch-timeout and --max-image-bytes must be positive")
        return cls(allowed_domains=tuple(d.lower().strip(".") for d in args.allowed_media_domains)
                   if args.allowed_media_domains else None,
                   allowed_local_path=Path(args.allowed_local_media_path).resolve()
                   if args.allowed_local_media_path else None,
                   fetch_timeout_s=args.media_fetch_timeout, max_image_bytes=args.max_image_bytes,
                   max_images_per_prompt=limits["image"])


def _bad(why: str, field: str) -> InvalidParameter:
    """An error of the request field holding the image, naming it."""
    return InvalidParameter(f"{field} {why}", field)


def parse_limits(text: str | None) -> dict[str, int]:
    """--limit-mm-per-prompt's JSON ('{"image": 4}'); ValueError for anything else."""
    if not text:
        return dict(DEFAULT_LIMITS)
    try:
        limits = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--limit-mm-per-prompt must be JSON such as '{{\"image\": 4}}': {exc}") from None
    if not isinstance(limits, dict) or set(limits) - set(DEFAULT_LIMITS) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in limits.values()):
        raise ValueError(f"--limit-mm-per-prompt takes {sorted(DEFAULT_LIMITS)} with counts >= 0, got {text!r}")
    return {**DEFAULT_LIMITS, **limits}


def load_image(url: str, options: MediaOptions, field: str):
    """The image at ``url`` as a PIL image, decoded (blocking: call it off the event loop)."""
    if not isinstance(url, str) or not url:
        raise _bad("must hold an image URL", field)
    try:
        scheme = urllib.parse.urlsplit(url).scheme.lower()
    except ValueError as exc:
        raise _bad(f"is not a URL that can be read: {exc}", field) from None
    if scheme == "data":
        data = _data_url_bytes(url, field)
    elif scheme in ("http", "https"):
        data = _fetch(url, options, field)
    elif scheme == "file":
        data = _local_file(url, options, field)
    else:
        raise _bad(f"has a URL of scheme {scheme or '(none)'!r}; images come as data:, https: or (where "
                               "the server allows) file: URLs", field)
    return decoded_image(data, options, field)


def decoded_image(data: bytes, options: MediaOptions, field: str):
    """An image file's bytes as a PIL image, decoded."""
    if len(data) > options.max_image_bytes:
        raise _bad(f"is an image of {len(data)} bytes, over the limit of {options.max_image_bytes}", field)
    return _decoded(data, field)


def _data_url_bytes(url: str, field: str) -> bytes:
    header, comma, payload = url[len("data:"):].partition(",")
    if not comma or not header.startswith("image/") or not header.endswith(";base64"):
        raise _bad("must be a data URL of an image in base64 (data:image/png;base64,...)", field)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _bad("has a data URL whose payload is not base64", field) from None


def _fetch(url: str, options: MediaOptions, field: str) -> bytes:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if options.allowed_domains is not None and not any(host == d or host.endswith("." + d)
                                                       for d in options.allowed_domains):
        raise _bad(f"names host {host!r}, outside the server's allowed media domains", field)
    request = urllib.request.Request(url, headers={"User-Agent": "pagedserve"})
    deadline = time.monotonic() + options.fetch_timeout_s
    try:
        with _NO_REDIRECTS.open(request, timeout=options.fetch_timeout_s) as response:
            kind = response.headers.get_content_type()
            if not kind.startswith("image/"):
                raise _bad(f"is served as {kind}, not an image", field)
            data = bytearray()
            while len(data) <= options.max_image_bytes:  # (a server that drips bytes gets the time limit too)
                if time.monotonic() > deadline:
                    raise _bad(f"took longer than {options.fetch_timeout_s:g} s to fetch", field)
                chunk = response.read(min(1 << 16, options.max_image_bytes + 1 - len(data)))
                if not chunk:
                    break
                data += chunk
    except InvalidParameter:
        raise
    except urllib.error.HTTPError as exc:
        raise _bad(f"could not be fetched: HTTP {exc.code}" + (" (redirects are not followed)"
                                                              if 300 <= exc.code < 400 else ""), field) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise _bad(f"could not be fetched: {reason}", field) from None
    return bytes(data)


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is not followed: it could lead outside --allowed-media-domains (to an internal address)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_NO_REDIRECTS = urllib.request.build_opener(_RefuseRedirects)


def _local_file(url: str, options: MediaOptions, field: str) -> bytes:
    if options.allowed_local_path is None:
        raise _bad("is a file URL, which this server does not take (--allowed-local-media-path)", field)
    try:
        path = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).resolve()
        if not path.is_relative_to(options.allowed_local_path):
            raise _bad("names a file outside the server's allowed local media path", field)
        with path.open("rb") as file:
            return file.read(options.max_image_bytes + 1)
    except InvalidParameter:
        raise
    except OSError as exc:
        raise _bad(f"names a file that cannot be read: {exc.strerror}", field) from None
    except ValueError as exc:  # (a NUL in the path)
        raise _bad(f"names a path that cannot be read: {exc}", field) from None


def _decoded(data: bytes, field: str):
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > MAX_IMAGE_PIXELS:  # (checked before decoding: a small file may hold a huge image)
            raise _bad(f"is an image of {image.width} by {image.height} pixels, over the limit of "
                       f"{MAX_IMAGE_PIXELS}", field)
        image.load()
    except InvalidParameter:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise _bad(f"is not an image that can be read: {exc}", field) from None
    return image
