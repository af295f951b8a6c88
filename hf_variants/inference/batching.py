"""Batches for decoding: sentences sorted by length (little padding), cut by sentence count or by tokens, and the
input read in buffers so a stream is translated as it arrives with bounded memory.

`length_sorted_batches` returns batches of input indices; the caller puts each result back at its index, so the
order of the input is restored whatever the batches. `max_tokens` counts a batch as fairseq and CTranslate2 do
(`batch_type="tokens"`): its sentences times its longest source (the padded size of the encoder input); a sentence
longer than `max_tokens` alone is a batch of its own.
"""

from __future__ import annotations

import os
import select
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")

DEFAULT_BATCH_SIZE = 64


def check_batching(batch_size: int | None, max_tokens: int | None) -> None:
    """Raise a ValueError naming the argument for a batch size or token budget that is not a positive integer."""
    for name, value in (("batch_size", batch_size), ("max_tokens", max_tokens)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name}={value!r}: expected an integer >= 1")


def length_sorted_batches(
    lengths: Sequence[int], batch_size: int | None = None, max_tokens: int | None = None
) -> list[list[int]]:
    """The indices of `lengths` (source lengths in tokens), longest first (ties in input order), in batches of at
    most `batch_size` sentences and at most `max_tokens` padded tokens (sentences x longest source); with neither,
    `DEFAULT_BATCH_SIZE` sentences."""
    check_batching(batch_size, max_tokens)
    if batch_size is None and max_tokens is None:
        batch_size = DEFAULT_BATCH_SIZE
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        # longest first: the batch's first sentence is its longest, so the padded size is len * that length
        longest = lengths[current[0]] if current else lengths[i]
        full = (batch_size is not None and len(current) >= batch_size) or (
            max_tokens is not None and current and (len(current) + 1) * longest > max_tokens
        )
        if full:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def buffered(items: Iterable[T], buffer_size: int, ready: Callable[[], bool] | None = None) -> Iterator[list[T]]:
    """`items` in lists of at most `buffer_size`, read lazily. With `ready` (a function telling whether the next
    item is available without waiting, e.g. `LineReader.ready` of a pipe), a list is also cut short when the next
    item would have to be waited for: a pipe that delivered one line and stays open gets that line handed on at once,
    while a file fills every list."""
    if not isinstance(buffer_size, int) or isinstance(buffer_size, bool) or buffer_size < 1:
        raise ValueError(f"buffer_size={buffer_size!r}: expected an integer >= 1")
    iterator = iter(items)
    while True:
        chunk: list[T] = []
        for item in iterator:
            chunk.append(item)
            if len(chunk) >= buffer_size or (ready is not None and not ready()):
                break
        if not chunk:
            return
        yield chunk


class LineReader:
    """The lines of a binary stream with a file descriptor (stdin, a pipe), decoded as UTF-8 without their
    terminators (a byte-order mark at the start dropped; invalid UTF-8 raises a ValueError naming `label` and the
    line), read with `os.read` so that `ready()` can tell whether a whole next line is at hand without blocking."""

    def __init__(self, stream, label: str = "stdin", chunk_size: int = 1 << 16):
        self.fd = stream.fileno()
        self.label, self.chunk_size = label, chunk_size
        self.pending = bytearray()
        self.eof = False
        self.count = 0

    def _fill(self) -> None:
        chunk = os.read(self.fd, self.chunk_size)
        if chunk:
            self.pending += chunk
        else:
            self.eof = True

    def ready(self) -> bool:
        """Whether the next line (or the end) can be read without waiting."""
        if b"\n" in self.pending or self.eof:
            return True
        readable, _, _ = select.select([self.fd], [], [], 0)
        return bool(readable)

    def __iter__(self) -> Iterator[str]:
        while True:
            while b"\n" not in self.pending and not self.eof:
                self._fill()
            if not self.pending:
                return
            end = self.pending.find(b"\n")
            end = len(self.pending) if end < 0 else end + 1
            raw = bytes(self.pending[:end])
            del self.pending[:end]
            self.count += 1
            try:
                text = raw.decode("utf-8-sig" if self.count == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{self.label}: line {self.count} is not valid UTF-8 ({err.reason}).") from err
            yield text.rstrip("\r\n")


__all__ = ["DEFAULT_BATCH_SIZE", "LineReader", "buffered", "check_batching", "length_sorted_batches"]
