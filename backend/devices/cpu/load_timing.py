"""Which of two ways of computing the same thing is faster on this CPU, timed once at load.

The CPU fast paths give the same results either way; only their speed depends on the CPU (its FMA and
bfloat16 rates against its memory bandwidth), so where one pays is measured rather than assumed.
"""

from __future__ import annotations

import time
from typing import Callable


def faster(candidate: Callable[[], object], current: Callable[[], object], ratio: float) -> bool:
    """Whether `candidate` takes at most `ratio` of `current`'s time: the better of two alternated runs
    each, after one run of `candidate` that first touches its buffers."""
    candidate()
    times: tuple[list[float], list[float]] = ([], [])
    for i in (0, 1, 1, 0):
        started = time.perf_counter()
        (candidate, current)[i]()
        times[i].append(time.perf_counter() - started)
    return min(times[0]) <= ratio * min(times[1])
