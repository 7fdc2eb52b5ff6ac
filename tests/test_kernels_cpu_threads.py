"""The span copy's helper threads (``kernels/cpu_spans.c``): the calling thread's OpenMP team
where torch's libgomp is loaded, pthreads per call in a forked child; bit-exact on many calls,
from two Python threads at once and after fork, and no thread left behind."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvbridge.kernels import convert_blocks, cpu_plan, cpu_spans, gather_blocks
from kvbridge.proto import KVGroup
from kvbridge.proto.presets import PresetShape, make_layout
from tests.harness.kernels import (
    assert_cache_equals,
    bits,
    random_cache,
    reference_copy,
    reference_staging,
)

pytestmark = pytest.mark.skipif(
    not cpu_spans.available(), reason="the compiled span copy is not built here"
)

SHAPE = PresetShape("t", 4, 2, 32, "bfloat16")  # 64-byte runs NHD -> HND
THREADS = 3


def _layout(order: str, num_blocks: int = 8) -> Any:
    return make_layout(SHAPE, block_size=3, num_blocks=num_blocks, order=order)


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def _libgomp_loaded() -> bool:
    with open("/proc/self/maps") as maps:
        return "libgomp" in maps.read()


@pytest.fixture(autouse=True)
def split(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every call split into one-unit parts between THREADS threads."""
    monkeypatch.setattr(cpu_spans, "PART_BYTES", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: THREADS)
    cpu_plan.clear()
    yield
    cpu_plan.clear()


def _native() -> Any:
    native = cpu_spans.native_module()
    assert native is not None
    return native


def test_helpers_are_the_calling_threads_openmp_team_where_torch_loaded_libgomp() -> None:
    # torch's CPU wheels run their ops on libgomp; the span copy joins that runtime
    want = "openmp" if _libgomp_loaded() else "pthreads"
    assert _native().helper_threads() == want


def test_many_calls_are_exact_and_keep_the_same_threads() -> None:
    sl, dl = _layout("layer-nhd"), _layout("layer-hnd")
    src, dst = random_cache(sl, 1), random_cache(dl, 2)
    rng = random.Random(3)
    convert_blocks(src, sl, dst, dl, [(0, 0)])
    before = _tasks()
    for _ in range(200):
        pairs = list(zip(rng.sample(range(8), 5), rng.sample(range(8), 5), strict=True))
        want = reference_copy(src, sl, dst, pairs, KVGroup.SELF)
        convert_blocks(src, sl, dst, dl, pairs)
        assert_cache_equals(dst, want, dl)
    assert _tasks() <= before  # no thread made per call is left behind


def _settle(limit: int, deadline_s: float = 10.0) -> int:
    """The thread count once it is at most ``limit`` (threads that were told to exit take a
    moment to go), or the count at the deadline."""
    end = time.monotonic() + deadline_s
    while _tasks() > limit and time.monotonic() < end:
        time.sleep(0.02)
    return _tasks()


def test_two_python_threads_copy_at_once_exactly_and_leave_no_threads() -> None:
    sl, dl = _layout("layer-nhd"), _layout("layer-hnd")
    jobs = [(random_cache(sl, 10 + i), random_cache(dl, 20 + i)) for i in range(2)]
    pairs = [(7, 0), (1, 4), (2, 2), (5, 6)]
    wants = [reference_copy(src, sl, dst, pairs, KVGroup.SELF) for src, dst in jobs]
    staged = reference_staging(jobs[0][0], sl, [3, 1, 6], KVGroup.SELF)
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            staging = torch.empty(3 * sl.block_bytes(), dtype=torch.uint8)
            start.wait()
            for _ in range(40):
                convert_blocks(jobs[i][0], sl, jobs[i][1], dl, pairs)
                if i == 0:  # another op with its own plan, between the other thread's calls
                    gather_blocks(jobs[0][0], sl, [3, 1, 6], staging)
                    assert torch.equal(staging, staged)
        except BaseException as exc:
            errors.append(exc)

    convert_blocks(jobs[0][0], sl, random_cache(dl, 5), dl, pairs)  # this thread's team
    base = _tasks()
    for _ in range(3):  # each Python thread gets a team of its own, gone when it ends
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert _settle(base) <= base
    for (_, dst), want in zip(jobs, wants, strict=True):
        assert_cache_equals(dst, want, dl)


def test_a_forked_child_copies_exactly_on_the_forking_thread_and_on_new_threads() -> None:
    # libgomp's teams do not survive fork (the forking thread's first parallel region in the
    # child waits for its parent's threads); the parent has used its team on this thread:
    # in the child this thread copies on pthreads, a thread made there on a team of its own
    sl, dl = _layout("layer-nhd"), _layout("layer-hnd")
    src, dst = random_cache(sl, 30), random_cache(dl, 31)
    pairs = [(6, 1), (0, 3), (4, 7)]
    convert_blocks(src, sl, random_cache(dl, 32), dl, pairs)  # the parent's team is made
    want = {k: v.numpy() for k, v in reference_copy(src, sl, dst, pairs, KVGroup.SELF).items()}
    kind = _native().helper_threads()
    pid = os.fork()
    if pid == 0:  # the child: no torch op that could enter an OpenMP region, exit code only
        code = 1
        try:
            if _native().helper_threads() == "pthreads":
                code = 2
                for _ in range(20):
                    convert_blocks(src, sl, dst, dl, pairs)
                same = all(np.array_equal(bits(dst[k]).numpy(), w) for k, w in want.items())
                code = 3 if not same else 4
                kinds: list[str] = []
                other = random_cache(dl, 31)  # dst as it was before the copy

                def copy_on_a_new_thread() -> None:
                    kinds.append(_native().helper_threads())
                    for _ in range(20):
                        convert_blocks(src, sl, other, dl, pairs)

                worker = threading.Thread(target=copy_on_a_new_thread)
                worker.start()
                worker.join()
                same = all(np.array_equal(bits(other[k]).numpy(), w) for k, w in want.items())
                if kinds == [kind] and same:
                    code = 0
        finally:
            os._exit(code)
    end = time.monotonic() + 60
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's copy hung")
    code = os.waitstatus_to_exitcode(status)
    assert code == 0, "1: parent's team kept, 2: raised, 3: wrong bytes, 4: new thread's copy"
    assert _native().helper_threads() == kind  # the parent keeps its team
    convert_blocks(src, sl, dst, dl, pairs)
    assert_cache_equals(dst, {k: torch.from_numpy(w) for k, w in want.items()}, dl)
