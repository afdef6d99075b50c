"""The one page-run copier: pages of one page-major pool into pages of another.

Used by the host tier (device <-> host copies), the transport's shared-memory path (a
prefill's pool into a mapped decode pool) and its frame path (a received frame into the
destination pages). A pool is a torch tensor or a numpy array whose first axis is the
page; with head slices it must be ``[pages, layers, 2, page_size, heads, ...]``.

    runs: maximal (src_start, dst_start, length) runs consecutive on both sides
    src pages  3 4 5 9 | 12     ->  (3, 7, 3), (9, 2, 1), (12, 3, 1)
    dst pages  7 8 9 2 | 3

How each run moves (measured on a 2-core CPU; one frame or copy per run, never per page):
- CPU to CPU: numpy calls that each release the GIL for many pages (a gather into each
  run of destination pages, or a scatter from each run of source pages), the pages
  shared out over ``copy_threads()`` threads once a copy moves ``SPLIT_ABOVE_BYTES`` - as
  torch's ``copy_`` shares a big block over its OpenMP team (``_run_shared`` has the
  figures). The transport lands frames with ``split=False``: helper threads left ZMQ's
  next receive buffers fresh, so every byte page-faulted again (docs/benchmarks.md).
  Torch copies of single runs are no substitute: 0.2-0.6 GB/s.
  One run of one big block stays with torch when both sides are tensors.
- Scattered small pages on one device: ``index_select(out=...)`` gathers at near memcpy
  speed on an int64 view; ``index_copy_`` (a scatter) only when the destination is
  scattered too. Index ops on narrow dtypes run several times slower.
- Otherwise (CUDA <-> host): one ``copy_`` per run.

``copy_pages_fed`` is the CPU-to-CPU copy of whole pages for a caller that also digests
the source (the shared-memory path): on one thread, each ``FEED_CHUNK_BYTES`` handed to
the digest right after its copy, while it is in cache, instead of a second pass over
memory (the split copy is faster alone but leaves the digest a pass from memory).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from common.kv.copy_threads import copy_threads, run_pieces

Pool = torch.Tensor | np.ndarray
# Runs shorter than this on average on both sides are gathered and scattered in one
# pass; longer ones are copied run by run. Measured on a 2-core CPU: per-slice copies of
# 16 KiB pages ran at about 2 GB/s, of 64-512 KiB pages at 4-11 GB/s, while gather/scatter on
# an int64 view stayed near 2-3 GB/s whatever the page size.
GATHER_BELOW_BYTES = 32 << 10
# A CPU copy of at least this many bytes is shared out over ``copy_threads()`` threads;
# below it, handing work to another thread (tens of microseconds) costs more than it saves.
SPLIT_ABOVE_BYTES = 2 << 20
# The smallest share of a split copy: below it, taking a share (a few microseconds of
# Python under the GIL) costs more than the memcpy it hands out.
MIN_SHARE_BYTES = 1 << 20
# ``copy_pages_fed`` copies and hands on the source in chunks of this many bytes: small
# enough that a chunk is still in the core's cache (2 MiB of L2 on the 2-core box) when it
# is handed on, large enough that Python's few microseconds per chunk stay small.
FEED_CHUNK_BYTES = 256 << 10


def page_runs(src_pages: np.ndarray, dst_pages: np.ndarray | None = None,
              max_len: int | None = None) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` of maximal runs consecutive in both page lists
    (``dst_pages`` defaults to ``src_pages``), each cut to at most ``max_len`` pages."""
    src = np.asarray(src_pages, dtype=np.int64)
    dst = src if dst_pages is None else np.asarray(dst_pages, dtype=np.int64)
    cuts = _run_cuts(src, dst)
    starts, lengths = cuts[:-1], np.diff(cuts)
    if max_len is None:
        return [(int(src[s]), int(dst[s]), int(n)) for s, n in zip(starts, lengths)]
    return [(int(src[s]) + k, int(dst[s]) + k, int(min(max_len, n - k)))
            for s, n in zip(starts, lengths) for k in range(0, int(n), max_len)]


def _run_cuts(src_pages: np.ndarray, dst_pages: np.ndarray | None = None) -> np.ndarray:
    """Offsets ``[0, ..., len]`` where a run consecutive in both page lists starts
    (``[0]`` for no pages); ``dst_pages`` defaults to ``src_pages``."""
    dst = src_pages if dst_pages is None else dst_pages
    _check_lengths(src_pages, dst)
    if not len(src_pages):
        return np.zeros(1, np.int64)
    breaks = _breaks(src_pages)
    if dst_pages is not None:
        breaks |= _breaks(dst)
    return _cuts(breaks)


def _check_lengths(src_pages: np.ndarray, dst_pages: np.ndarray) -> None:
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destination "
                         "pages")


def _breaks(pages: np.ndarray) -> np.ndarray:
    """``breaks[i]``: a new run starts at ``pages[i + 1]``."""
    return pages[1:] - pages[:-1] != 1


def _cuts(breaks: np.ndarray) -> np.ndarray:
    return np.concatenate(([0], np.flatnonzero(breaks) + 1, [len(breaks) + 1]))


def check_pages(pages: np.ndarray, num_pages: int, what: str = "page") -> None:
    """Raise ``IndexError`` unless every id is in ``[0, num_pages)``: slicing past the end
    copies nothing and a negative id wraps around, silently."""
    if len(pages) and not 0 <= int(pages.min()) <= int(pages.max()) < num_pages:
        raise IndexError(f"{what} ids {int(pages.min())}..{int(pages.max())} outside "
                         f"a pool of {num_pages} pages")


def _checked(src: Pool, src_pages: np.ndarray, dst: Pool, dst_pages: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray]:
    """Both page lists as int64, each id inside its pool, the lists of one length."""
    src_pages = np.asarray(src_pages, np.int64)
    dst_pages = np.asarray(dst_pages, np.int64)
    check_pages(src_pages, src.shape[0], "source page")
    check_pages(dst_pages, dst.shape[0], "destination page")
    _check_lengths(src_pages, dst_pages)
    return src_pages, dst_pages


def copy_pages(src: Pool, src_pages: np.ndarray, dst: Pool, dst_pages: np.ndarray,
               non_blocking: bool = False, src_heads: slice | None = None,
               dst_heads: slice | None = None, split: bool = True) -> int:
    """``dst[dst_pages] = src[src_pages]`` (restricted to head slices when given),
    coalesced into runs; page ids are checked first. Returns the number of runs. Within
    one pool, the source and destination pages must not overlap (shares run at once).
    ``split=False`` keeps a CPU copy on the calling thread (no helper shares).

    Raises:
        IndexError: a page id outside its pool.
        ValueError: the page lists differ in length.
    """
    src_pages, dst_pages = _checked(src, src_pages, dst, dst_pages)
    if not len(src_pages):
        return 0
    # each side's breaks are found once per copy; the runs are counted, not built (the
    # run tuples took 0.17 ms of a 256-page copy, before any byte)
    breaks = _breaks(src_pages), _breaks(dst_pages)
    num_runs = 1 + int(np.count_nonzero(breaks[0] | breaks[1]))
    if not (_all_heads(src, src_heads) and _all_heads(dst, dst_heads)):
        sh = slice(None) if src_heads is None else src_heads
        dh = slice(None) if dst_heads is None else dst_heads
        for s, d, n in page_runs(src_pages, dst_pages):
            _assign(dst[d:d + n, :, :, :, dh], src[s:s + n, :, :, :, sh], non_blocking)
        return num_runs
    small = _small_runs(src, len(src_pages), num_runs)
    numpy_pool = isinstance(src, np.ndarray) or isinstance(dst, np.ndarray)
    if _both_cpu(src, dst) and (numpy_pool or (num_runs > 1 and not small)):
        _run_shared(_byte_rows(src), src_pages, _byte_rows(dst), dst_pages, small, split,
                    breaks)
        return num_runs
    if num_runs > 1 and src.device == dst.device and _int64_viewable(src) and (
            small or (1 + np.count_nonzero(breaks[1])) * 4 <= len(dst_pages)):
        _gather_copy(src, src_pages, dst, dst_pages)
        return num_runs
    for s, d, n in page_runs(src_pages, dst_pages):
        dst[d:d + n].copy_(src[s:s + n], non_blocking=non_blocking)
    return num_runs


def copy_pages_fed(src: Pool, src_pages: np.ndarray, dst: Pool, dst_pages: np.ndarray,
                   feed: Callable[[np.ndarray], object],
                   chunk_bytes: int = FEED_CHUNK_BYTES) -> int:
    """``dst[dst_pages] = src[src_pages]`` between two CPU pools, whole pages, on this
    thread, handing every chunk of at most ``chunk_bytes`` of the source to ``feed`` in
    page-list order right after copying it (a digest of the source's bytes, computed while
    they are in cache instead of in a second pass over memory). Returns the number of runs.

    Raises:
        IndexError: a page id outside its pool.
        ValueError: the page lists differ in length.
    """
    src_pages, dst_pages = _checked(src, src_pages, dst, dst_pages)
    src_rows, dst_rows = _byte_rows(src), _byte_rows(dst)
    runs = page_runs(src_pages, dst_pages)
    for s, d, n in runs:
        _copy_fed(src_rows[s:s + n].reshape(-1), dst_rows[d:d + n].reshape(-1), feed,
                 chunk_bytes)
    return len(runs)


def _copy_fed(src: np.ndarray, dst: np.ndarray, feed: Callable[[np.ndarray], object],
             chunk_bytes: int = FEED_CHUNK_BYTES) -> None:
    """``dst[:] = src`` (1-D uint8, equal lengths) chunk by chunk, each chunk of ``src``
    handed to ``feed`` right after it was copied."""
    for at in range(0, len(src), chunk_bytes):
        part = src[at:at + chunk_bytes]
        np.copyto(dst[at:at + chunk_bytes], part)
        feed(part)


def _all_heads(pool: Pool, heads: slice | None) -> bool:
    return heads is None or range(pool.shape[4])[heads] == range(pool.shape[4])


def _assign(dst: Pool, src: Pool, non_blocking: bool) -> None:
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src if isinstance(src, np.ndarray) else src.numpy())
    else:
        dst.copy_(torch.from_numpy(src) if isinstance(src, np.ndarray) else src,
                  non_blocking=non_blocking)


def _both_cpu(src: Pool, dst: Pool) -> bool:
    return all(isinstance(t, np.ndarray) or (t.device.type == "cpu" and t.is_contiguous())
               for t in (src, dst))


def _small_runs(src: Pool, num_pages: int, num_runs: int) -> bool:
    """Runs shorter than ``GATHER_BELOW_BYTES`` on average."""
    page_bytes = (src[0].nbytes if isinstance(src, np.ndarray)
                  else src[0].numel() * src.element_size()) if src.shape[0] else 0
    return num_pages * page_bytes < GATHER_BELOW_BYTES * num_runs


def _gather_copy(src: torch.Tensor, src_pages: np.ndarray, dst: torch.Tensor,
                 dst_pages: np.ndarray) -> None:
    """Scattered pages on one device: gather straight into each run of destination pages
    (``index_select(out=...)``), or gather-then-scatter when the destination is scattered
    too. Both on an int64 view."""
    src64 = src.view(src.shape[0], -1).view(torch.int64)
    dst64 = dst.view(dst.shape[0], -1).view(torch.int64)
    src_idx = torch.from_numpy(src_pages).to(src.device)
    dst_runs = page_runs(dst_pages)
    if len(dst_runs) * 4 <= len(dst_pages):  # destination runs of 4 pages or more
        offset = 0
        for d, _, n in dst_runs:
            torch.index_select(src64, 0, src_idx[offset:offset + n], out=dst64[d:d + n])
            offset += n
        return
    dst_idx = torch.from_numpy(dst_pages).to(dst.device)
    dst64.index_copy_(0, dst_idx, src64.index_select(0, src_idx))


def _byte_rows(t: Pool) -> np.ndarray:
    """A contiguous CPU page-major pool as a numpy ``[num_pages, page_bytes]`` uint8 view."""
    if isinstance(t, np.ndarray):
        return t.reshape(t.shape[0], -1).view(np.uint8) if t.shape[0] else t.reshape(0, 0)
    return t.view(t.shape[0], -1).view(torch.uint8).numpy()


def _int64_viewable(t: torch.Tensor) -> bool:
    return t.is_contiguous() and (t[0].numel() * t.element_size()) % 8 == 0


def _run_shared(src: np.ndarray, src_pages: np.ndarray, dst: np.ndarray,
                dst_pages: np.ndarray, small: bool, split: bool,
                breaks: tuple[np.ndarray, np.ndarray]) -> None:
    """Copy byte-row pages ``dst[dst_pages] = src[src_pages]``, shared out over
    ``copy_threads()`` threads by whole pages, each share a list of segments that
    ``_copy_segments`` moves.

    In as few numpy calls as the runs allow, each releasing the GIL for all the pages it
    moves (one slice assignment per page took the GIL back after every page): a gather
    (``np.take(..., out=)``) straight into each run of destination pages, or, where the
    source has fewer runs, a scatter (fancy assignment) from each run of source pages;
    short runs on both sides (``small``): one gather-and-scatter per share. The runs are
    found once per copy, not per share. Measured on the 2-core box (256 scattered 512 KiB
    pages over 2 threads, interleaved with the slices they replaced, medians of 15-21
    rounds): gathers 12.0-13.9 GB/s against 10.5-11.4, scatters 11.6-13.3 against 10.5-11.6.

    Shares shrink as they are taken (guided, like OpenMP's ``schedule(guided)``): each is
    about a ``2 * copy_threads()``-th of what is left, at least ``MIN_SHARE_BYTES``, and
    threads take the next as they come free. A helper that the machine schedules late
    then only takes fewer shares, where with one half each the copy waited for its whole
    half after the caller's was done; one not started when nothing is left is taken back
    (a busy machine's unscheduled thread holds nothing up).

    ``breaks``: each side's run breaks (``_breaks`` of ``src_pages``, of ``dst_pages``).
    A copy that stays on this thread and is one run on both sides (a frame landing in
    consecutive pages) is one slice copy, without the shares' bookkeeping (a frame's
    landing took 75 us of Python besides its bytes, 27 us now, in a loop on the 2-core box)."""
    n = len(src_pages)
    if not split or copy_threads() < 2 or n * src.shape[1] < SPLIT_ABOVE_BYTES:
        if not (breaks[0].any() or breaks[1].any()):
            s, d = int(src_pages[0]), int(dst_pages[0])
            np.copyto(dst[d:d + n], src[s:s + n])
            return
        share_cuts = [0, n]
    else:
        share_cuts = _guided_cuts(n, copy_threads(),
                                  max(1, -(-MIN_SHARE_BYTES // max(1, src.shape[1]))))
    src_cuts, dst_cuts = _cuts(breaks[0]), _cuts(breaks[1])
    how = ("mixed" if small and min(len(dst_cuts), len(src_cuts)) > 2
           else "gather" if len(dst_cuts) <= len(src_cuts) else "scatter")
    run_cuts = [] if how == "mixed" else (dst_cuts if how == "gather" else src_cuts).tolist()
    pieces = _segments(share_cuts, run_cuts)
    run_pieces(pieces, lambda segs: _copy_segments(src, src_pages, dst, dst_pages, segs, how))


def _segments(share_cuts: list[int], run_cuts: list[int]) -> list[list[tuple[int, int]]]:
    """Per share (``share_cuts``), its ``(start, end)`` page offsets cut at ``run_cuts``:
    every segment lies in one share and one run."""
    cuts = sorted(set(share_cuts).union(run_cuts))
    pieces: list[list[tuple[int, int]]] = [[] for _ in share_cuts[1:]]
    share = 0
    for a, b in zip(cuts[:-1], cuts[1:]):
        while a >= share_cuts[share + 1]:
            share += 1
        pieces[share].append((a, b))
    return pieces


def _copy_segments(src: np.ndarray, src_pages: np.ndarray, dst: np.ndarray,
                   dst_pages: np.ndarray, segments: list[tuple[int, int]], how: str) -> None:
    """One share: per segment a gather into its destination run, a scatter from its
    source run, or (``mixed``) both sides fancy-indexed."""
    for a, b in segments:
        if how == "mixed":
            dst[dst_pages[a:b]] = src[src_pages[a:b]]
        elif how == "scatter":
            s = int(src_pages[a])
            dst[dst_pages[a:b]] = src[s:s + b - a]
        elif b - a == 1:
            dst[int(dst_pages[a])] = src[int(src_pages[a])]
        else:  # the ids were checked: "clip" skips numpy's buffered bounds check
            d = int(dst_pages[a])
            np.take(src, src_pages[a:b], axis=0, out=dst[d:d + b - a], mode="clip")


def _guided_cuts(num_pages: int, threads: int, min_pages: int) -> list[int]:
    """Page offsets ``[0, ..., num_pages]`` of guided shares: each about
    ``left / (2 * threads)`` pages, at least ``min_pages``, largest first."""
    cuts, at = [0], 0
    while at < num_pages:
        at += min(num_pages - at, max(min_pages, (num_pages - at) // (2 * threads)))
        cuts.append(at)
    return cuts
