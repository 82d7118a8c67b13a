"""Weighted blending of several sample sources: every prefix of the sample stream holds each
dataset's share to within one sample, and any sample's dataset is found from its index alone.

The blend of a run is one of two orders, named by `data.blend_order` (recorded with the run):

* 'quota' (`Blend`, the default): at every prefix k, each dataset d has floor(w_d k) or
  ceil(w_d k) samples, i.e. |count_d - w_d k| < 1 for any number of datasets and any weights
  (Balinski and Young's quota property; Tijdeman, "The chairman assignment problem", 1980,
  proves such an order exists). Dataset d's j-th sample (1-based) is then due in the slots t
  (1-based) with ceil(w_d t) >= j and floor(w_d (t - 1)) < j: a window, and an order is quota
  exactly when each sample lies in its window. The stream is cut into chunks of CHUNK samples.
  The counts at each chunk boundary come from the one before by a few vectorised steps (below),
  and a chunk's order is earliest-deadline-first over its samples' windows (exact for unit jobs
  with integer windows). A lookup replays one chunk; the boundary counts are a table of
  8 x datasets bytes per CHUNK samples, grown once per process up to the highest sample asked
  for. Why the boundaries are always reachable and never a dead end: `Blend._next_boundary`.
* 'divisor' (`DivisorBlend`, the order of runs started before the quota order): dataset d's k-th
  sample (0-based) has the key (k + 1/2) / w_d (Sainte-Laguë's divisor sequence) and training
  takes them in key order, so counts are closed-form; its drift from the weights reaches 1.78
  samples on tr11's 28 weights and 2.56 on 50 Dirichlet(0.3) weights.

Both keep Megatron's blend semantics: a sample's index within its dataset is the count of that
dataset's samples before it, so each dataset is read in order, once per epoch of its own.
"""

from __future__ import annotations

import functools
import heapq
import threading
from collections.abc import Sequence

import numpy as np

# Samples per chunk of the quota order. Part of the order's definition: another value gives
# another (equally exact) order, so it never changes under a run.
CHUNK = 8192
# Deadlines beyond int64's comfortable range (a share so small that its next sample is due after
# 2^62 samples) are clipped: they only rank the samples, and never bind.
_FAR = 2**62


def shares(weights: Sequence[float]) -> np.ndarray:
  """The weights normalised to sum 1, float64 [D]; ValueError for weights no blend can take."""
  values = np.asarray(weights, dtype=np.float64)
  if values.ndim != 1 or len(values) < 1 or not np.all(np.isfinite(values)) or np.any(values <= 0):
    raise ValueError(f'blend weights must be positive and finite, got {values.tolist()}')
  with np.errstate(over='ignore', divide='ignore'):
    total = values.sum()
    normalised = values / total
    # An infinite sum makes every share 0 (and an overflowing 1/share an infinite key): the
    # searches of either order would then never end.
    if not np.isfinite(total) or not np.all(np.isfinite(1.0 / normalised)):
      raise ValueError(
        f'blend weights must have a finite sum and shares whose inverse is '
        f'finite, got {values.tolist()}; scale them to moderate values'
      )
  return normalised


class Blend:
  """The quota order: which dataset, and which of its samples, each global sample is."""

  name = 'quota'

  def __init__(self, weights: Sequence[float]):
    self.weights = shares(weights)
    # _boundaries[c]: each dataset's count among the first c * CHUNK samples.
    self._boundaries = [np.zeros(len(self.weights), np.int64)]
    self._chunks: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # a few recent chunk orders
    self._lock = threading.Lock()  # the table grows lazily; one writer at a time

  def _fewest(self, t, w=None) -> np.ndarray:
    """floor(w t): the fewest samples of each dataset that the first t may hold."""
    return np.floor((self.weights if w is None else w) * t).astype(np.int64)

  def _most(self, t, w=None) -> np.ndarray:
    """ceil(w t): the most samples of each dataset that the first t may hold."""
    return np.ceil((self.weights if w is None else w) * t).astype(np.int64)

  @staticmethod
  def _release(w: np.ndarray, j: np.ndarray) -> np.ndarray:
    """First slot t (1-based) that may hold a dataset's j-th sample: the first with
    ceil(w t) >= j, settled with the very products that _most computes."""
    t = np.minimum(np.floor((j - 1) / w), _FAR).astype(np.int64) + 1
    while True:
      down = (t > 1) & (w * (t - 1) > j - 1)
      up = (t <= _FAR) & ~(w * t > j - 1)
      if not (down.any() or up.any()):
        return t
      t = t - down + up

  @staticmethod
  def _deadline(w: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Last slot that may hold a dataset's j-th sample: the first t with floor(w t) >= j."""
    t = np.minimum(np.ceil(j / w), _FAR).astype(np.int64)
    while True:
      movable = t < _FAR
      down = movable & (w * (t - 1) >= j)
      up = movable & ~(w * t >= j)
      if not (down.any() or up.any()):
        return t
      t = t - down + up

  def _next_boundary(self, start: int, before: np.ndarray) -> np.ndarray:
    """The counts after slot start + CHUNK, given `before`, the counts after slot `start`.

    Each dataset's count at the next boundary is floor(w T) or ceil(w T) (T = start + CHUNK):
    the samples due by T are taken; of the datasets whose next sample is only released by T
    (`free`), exactly `wanted` take it. Which ones: the chunk's samples must fit its slots
    (Hall's condition; with windows, only the suffixes s..T of the chunk can overflow, since the
    samples due inside the chunk fit whenever `before` was reachable), and among the choices
    that fit, the greedy one by earliest deadline. Fitting choices are the independent sets of
    a matroid, so the greedy choice has, position by position, the earliest deadlines of any;
    it leaves out the latest-due samples, and any continuation of another choice maps onto it
    (each left-out sample takes the slot of one due no later). So if any quota order passes
    through `before`, one passes through the result: by induction from the empty start, which
    Tijdeman's theorem continues for ever, every boundary is reachable and never a dead end.
    The run raises rather than continue should float rounding ever break this.
    """
    stop = start + CHUNK
    w = self.weights
    lowest = np.maximum(before, self._fewest(stop))
    after = lowest.copy()
    free = np.flatnonzero(lowest < self._most(stop))
    wanted = stop - int(lowest.sum())
    if wanted == 0:
      return after
    next_samples = lowest[free] + 1
    at = np.maximum(self._release(w[free], next_samples), start + 1) - start - 1
    order = np.lexsort((free, self._deadline(w[free], next_samples)))
    # room[i]: the slots start+1+i..stop less the due samples released there or later. The free
    # samples released at offset i or later must number at most room[i], for every i: a free
    # sample released at offset a takes one of room[0..a]. Only the minimum of room between
    # consecutive release offsets of free samples matters.
    due = np.maximum(self._fewest(stop) - before, 0)
    owner = np.repeat(np.arange(len(w)), due)
    sample = np.arange(len(owner)) - np.repeat(np.cumsum(due) - due, due) + before[owner] + 1
    due_at = np.maximum(self._release(w[owner], sample), start + 1) - start - 1
    room = CHUNK - np.arange(CHUNK) - _suffix_sums(np.bincount(due_at, minlength=CHUNK))
    offsets, point = np.unique(at, return_inverse=True)
    least = np.minimum.reduceat(room[: offsets[-1] + 1], np.append(0, offsets[:-1] + 1))
    chosen: np.ndarray | list[int] = order[:wanted]
    if np.any(_suffix_sums(np.bincount(point[chosen], minlength=len(offsets))) > least):
      chosen = []
      for candidate in order:
        if least[: point[candidate] + 1].min() >= 1:
          least[: point[candidate] + 1] -= 1
          chosen.append(candidate)
          if len(chosen) == wanted:
            break
    if len(chosen) != wanted:
      raise RuntimeError(
        f'the quota blend of weights {w.tolist()} found no order for samples '
        f'{start}..{stop}: a bug (or float rounding) in blending.py'
      )
    after[free[np.asarray(chosen, np.int64)]] += 1
    return after

  def boundary(self, chunk: int) -> np.ndarray:
    """Each dataset's count among the first chunk * CHUNK samples: int64 [D]."""
    with self._lock:
      while len(self._boundaries) <= chunk:
        last = len(self._boundaries) - 1
        counts = self._next_boundary(last * CHUNK, self._boundaries[last])
        counts.flags.writeable = False  # returned to callers, kept for later lookups
        self._boundaries.append(counts)
      return self._boundaries[chunk]

  def chunk_order(self, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset, index within it) of samples chunk * CHUNK .. + CHUNK - 1: int64 [CHUNK] each.

    Earliest deadline first over the chunk's samples (ties: lower dataset first): it fills
    every slot whenever the samples fit their windows, as _next_boundary made sure."""
    with self._lock:
      if chunk in self._chunks:
        return self._chunks[chunk]
    before, after = self.boundary(chunk), self.boundary(chunk + 1)
    start, stop = chunk * CHUNK, (chunk + 1) * CHUNK
    owners = np.repeat(np.arange(len(self.weights)), after - before)
    counts = after - before
    samples = np.arange(CHUNK) - np.repeat(np.cumsum(counts) - counts, counts) + before[owners] + 1
    w = self.weights[owners]
    releases = np.maximum(self._release(w, samples), start + 1)
    deadlines = np.minimum(self._deadline(w, samples), stop)
    by_release = np.lexsort((owners, deadlines, releases))
    jobs = np.stack([releases, deadlines, owners], 1)[by_release].tolist()
    datasets = np.empty(CHUNK, np.int64)
    pending: list[tuple[int, int]] = []
    taken = 0
    for slot in range(start + 1, stop + 1):
      while taken < CHUNK and jobs[taken][0] <= slot:
        heapq.heappush(pending, (jobs[taken][1], jobs[taken][2]))
        taken += 1
      if not pending or pending[0][0] < slot:
        raise RuntimeError(
          f'the quota blend of weights {self.weights.tolist()} missed a '
          f'window at sample {slot - 1}: a bug in blending.py'
        )
      datasets[slot - start - 1] = heapq.heappop(pending)[1]
    # A dataset's samples within the chunk are its next ones, in order.
    by_dataset = np.argsort(datasets, kind='stable')
    firsts = np.cumsum(counts) - counts
    indices = np.empty(CHUNK, np.int64)
    indices[by_dataset] = (
      np.arange(CHUNK) - firsts[datasets[by_dataset]] + before[datasets[by_dataset]]
    )
    datasets.flags.writeable = indices.flags.writeable = False  # shared by later lookups
    with self._lock:
      if len(self._chunks) >= 8:
        self._chunks.pop(next(iter(self._chunks)))
      self._chunks[chunk] = (datasets, indices)
    return datasets, indices

  def assign(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset, index within that dataset) of global samples start..stop-1: int64 [stop-start]."""
    if not 0 <= start <= stop:
      raise ValueError(f'need 0 <= start <= stop, got start={start}, stop={stop}')
    datasets, indices = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for chunk in range(start // CHUNK, (stop - 1) // CHUNK + 1 if stop > start else 0):
      first = max(start - chunk * CHUNK, 0)
      last = min(stop - chunk * CHUNK, CHUNK)
      chunk_datasets, chunk_indices = self.chunk_order(chunk)
      datasets.append(chunk_datasets[first:last])
      indices.append(chunk_indices[first:last])
    return np.concatenate(datasets), np.concatenate(indices)

  def counts(self, n: int) -> np.ndarray:
    """How many samples of each dataset the first n global samples hold: int64 [D]."""
    chunk, within = divmod(n, CHUNK)
    counts = self.boundary(chunk).copy()
    if within:
      counts += np.bincount(self.chunk_order(chunk)[0][:within], minlength=len(self.weights))
    return counts


def _suffix_sums(values: np.ndarray) -> np.ndarray:
  return np.cumsum(values[::-1])[::-1]


class DivisorBlend:
  """The divisor order of runs started before the quota order (data.blend_order='divisor'):
  which dataset, and which of its samples, each global sample is."""

  name = 'divisor'

  def __init__(self, weights: Sequence[float]):
    self.weights = shares(weights)

  def keys_below(self, threshold: float) -> np.ndarray:
    """Per dataset, how many of its keys (k + 1/2) / w_d are <= threshold: int64 [D]."""
    w = self.weights
    counts = np.maximum(np.floor(threshold * w + 0.5), 0).astype(np.int64)
    # The estimate can be off by one where float rounding differs from the keys' own rounding;
    # settle it with the very comparisons that order the keys.
    counts += (counts + 0.5) / w <= threshold
    counts -= (counts > 0) & ((counts - 0.5) / w > threshold)
    return counts

  def _ordered_window(self, start: int, stop: int):
    """Every key between two thresholds around [start, stop), in training order.

    Returns (keys_before, datasets, indices): keys_before [D] counts each dataset's keys before
    the window, and the window's samples (datasets[i], indices[i]) hold global positions
    sum(keys_before) + i.
    """
    margin = len(self.weights) + 2.0
    # Keys <= low all precede global sample `start`; keys <= high reach past `stop`.
    low = start - margin
    while self.keys_below(low).sum() > start:
      low -= margin
    high = stop + margin
    while self.keys_below(high).sum() < stop:
      high += margin
    first, last = self.keys_below(low), self.keys_below(high)
    datasets = np.concatenate(
      [np.full(b - a, d, np.int64) for d, (a, b) in enumerate(zip(first, last))]
    )
    indices = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in zip(first, last)])
    order = np.lexsort((datasets, (indices + 0.5) / self.weights[datasets]))
    return first, datasets[order], indices[order]

  def assign(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset, index within that dataset) of global samples start..stop-1: int64 [stop-start]."""
    if not 0 <= start <= stop:
      raise ValueError(f'need 0 <= start <= stop, got start={start}, stop={stop}')
    before, datasets, indices = self._ordered_window(start, stop)
    offset = start - int(before.sum())
    return datasets[offset : offset + stop - start], indices[offset : offset + stop - start]

  def counts(self, n: int) -> np.ndarray:
    """How many samples of each dataset the first n global samples hold: int64 [D]."""
    before, datasets, _ = self._ordered_window(n, n)
    return before + np.bincount(datasets[: n - int(before.sum())], minlength=len(self.weights))


# data.blend_order's values; a run keeps the order it started with (docs/data.md).
ORDERS: dict[str, type[Blend] | type[DivisorBlend]] = {
  Blend.name: Blend,
  DivisorBlend.name: DivisorBlend,
}


class BlendedSource:
  """Samples of several sources mixed by weight; the same interface as `SampleSource`."""

  def __init__(
    self,
    sources: Sequence,
    weights: Sequence[float],
    names: Sequence[str] = (),
    order: str = Blend.name,
  ):
    if len(sources) != len(weights):
      raise ValueError(f'{len(sources)} sources but {len(weights)} weights')
    if order not in ORDERS:
      raise ValueError(f'unknown blend order {order!r}; known: {", ".join(ORDERS)}')
    self.sources = list(sources)
    self.names = list(names) or [str(i) for i in range(len(sources))]
    self.blend = ORDERS[order](weights)
    self.seq_len = self.sources[0].seq_len
    if any(s.seq_len != self.seq_len for s in self.sources):
      raise ValueError('blended sources must share one seq_len')

  @functools.cached_property
  def num_samples(self) -> int:
    """How many samples from the start of the blend come before any source repeats one of its
    own (as SampleSource.num_samples counts an epoch): the largest n whose counts(n) stay within
    every source's samples, found by bisection (counts grows with n)."""
    sizes = np.asarray([s.num_samples for s in self.sources])
    low, high = 0, int(sizes.sum())  # counts(high) must exceed some size, or equal all
    if isinstance(self.blend, Blend):
      # Past (size_d + 1) / w_d samples, floor(w_d n) alone exceeds size_d: no need to grow
      # the boundary table further.
      high = min(high, int(np.floor(np.min((sizes + 1) / self.blend.weights))))
    while low < high:
      middle = (low + high + 1) // 2
      if np.all(self.blend.counts(middle) <= sizes):
        low = middle
      else:
        high = middle - 1
    return low

  def rows(self, start: int, stop: int) -> np.ndarray:
    """Global samples start..stop-1 as int32 [stop - start, seq_len + 1]."""
    datasets, indices = self.blend.assign(start, stop)
    out = np.empty((stop - start, self.seq_len + 1), np.int32)
    for d, source in enumerate(self.sources):
      mine = datasets == d
      if mine.any():
        # A dataset's samples within a slice are consecutive: one contiguous read each.
        first = int(indices[mine][0])
        out[mine] = source.rows(first, first + int(mine.sum()))
    return out

  def sample(self, index: int) -> np.ndarray:
    return self.rows(index, index + 1)[0]

  def batch(self, consumed_samples: int, global_batch_size: int) -> np.ndarray:
    return self.rows(consumed_samples, consumed_samples + global_batch_size)
