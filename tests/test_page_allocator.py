"""The page allocator: allocation, growth, freeing, and an integrity check that catches every broken state."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specstep.engine.errors import OutOfPagesError
from specstep.engine.kv_cache import DUMMY_PAGE
from specstep.engine.sampling_params import SamplingParams
from specstep.scheduler.core.page_allocator import PageAllocator
from tests.helpers import make_core, run_to_completion


def test_allocate_hands_out_distinct_real_pages():
    a = PageAllocator(num_pages=9, page_size=4)
    assert a.num_usable == 8 and a.num_free == 8
    x, y = a.allocate(3), a.allocate(5)
    assert len(x) == 3 and len(y) == 5
    assert sorted(x + y) == list(range(1, 9))  # every page but the dummy, each once
    assert DUMMY_PAGE not in x + y
    assert a.num_free == 0
    assert a.allocate(0) == []
    a.check_integrity([x, y])


def test_reserve_grows_every_table_or_none():
    a = PageAllocator(num_pages=9, page_size=4)
    x, y = a.allocate(1), a.allocate(2)
    assert not a.reserve([x, y], [4 * 5, 4 * 5])  # 4 + 3 more pages, 5 free: nothing moves
    assert (len(x), len(y), a.num_free) == (1, 2, 5)
    assert a.reserve([x, y], [4 * 4 + 1, 3])  # 4 more for x, y already holds 3 tokens
    assert (len(x), len(y), a.num_free) == (5, 2, 1)
    a.check_integrity([x, y])


def test_fresh_allocations_are_contiguous_and_freed_pages_are_reused():
    a = PageAllocator(num_pages=10, page_size=2)
    x = a.allocate(4)
    assert x == [1, 2, 3, 4]
    a.free(x)
    assert x == []  # the caller's table is emptied, so it cannot be freed twice by accident
    assert a.num_free == 9
    assert sorted(a.allocate(9)) == list(range(1, 10))


def test_pages_for_and_ensure():
    a = PageAllocator(num_pages=20, page_size=16)
    assert [a.pages_for(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]
    table: list[int] = []
    a.ensure(table, 1)
    assert len(table) == 1
    a.ensure(table, 16)  # still fits in one page: no-op
    assert len(table) == 1
    a.ensure(table, 40)
    assert len(table) == 3
    first = list(table)
    a.ensure(table, 10)  # never shrinks
    assert table == first
    assert a.can_fit(table, 48) and a.can_fit(table, 16 * (3 + 16)) and not a.can_fit(table, 16 * (3 + 17) + 1)
    a.check_integrity([table])
    assert a.num_free == 16


def test_page_size_one():
    a = PageAllocator(num_pages=6, page_size=1)
    t: list[int] = []
    a.ensure(t, 5)
    assert sorted(t) == [1, 2, 3, 4, 5]
    with pytest.raises(OutOfPagesError):
        a.ensure(t, 6)
    assert len(t) == 5  # a failed ensure leaves the table as it was
    a.check_integrity([t])


def test_out_of_pages_is_a_clear_error():
    a = PageAllocator(num_pages=5, page_size=16)
    t = a.allocate(3)
    with pytest.raises(OutOfPagesError, match=r"need 2 KV pages, 1 free of 4"):
        a.allocate(2)
    a.check_integrity([t])  # nothing was taken by the failed call
    assert a.num_free == 1


def test_too_few_pages_is_rejected():
    with pytest.raises(ValueError, match="at least 2 pages"):
        PageAllocator(num_pages=1, page_size=16)


def test_integrity_catches_double_free():
    a = PageAllocator(num_pages=8, page_size=4)
    t = a.allocate(2)
    copy = list(t)
    a.free(t)
    a.free(copy)  # the same pages again
    with pytest.raises(AssertionError, match="free list twice"):
        a.check_integrity([])


def test_integrity_catches_double_ownership():
    a = PageAllocator(num_pages=8, page_size=4)
    t = a.allocate(3)
    u = a.allocate(1)
    u.append(t[1])
    with pytest.raises(AssertionError, match=rf"page {t[1]} owned by request 1 is also owned by request 0"):
        a.check_integrity([t, u])


def test_integrity_catches_page_both_free_and_owned():
    a = PageAllocator(num_pages=8, page_size=4)
    t = a.allocate(2)
    stale = list(t)
    a.free(t)  # freed, but a stale table still lists the pages
    with pytest.raises(AssertionError, match="is also free"):
        a.check_integrity([stale])


def test_integrity_catches_leaks():
    a = PageAllocator(num_pages=8, page_size=4)
    t = a.allocate(3)
    lost = t.pop()
    with pytest.raises(AssertionError, match=rf"leaked\): \[{lost}\]"):
        a.check_integrity([t])


@pytest.mark.parametrize("bad", [DUMMY_PAGE, 8, -1])
def test_integrity_catches_invalid_pages(bad):
    a = PageAllocator(num_pages=8, page_size=4)
    t = a.allocate(2) + [bad]
    with pytest.raises(AssertionError, match=rf"invalid page {bad}"):
        a.check_integrity([t])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["ensure", "free", "alloc"]), st.integers(0, 5), st.integers(0, 40)),
                max_size=40), st.integers(1, 4))
def test_random_operation_sequences_keep_integrity(ops, page_size):
    """Any sequence of ensure/free/allocate (including failures) keeps every page free or owned exactly once."""
    a = PageAllocator(num_pages=24, page_size=page_size)
    tables: list[list[int]] = [[] for _ in range(6)]
    for op, i, n in ops:
        before = (list(tables[i]), a.num_free)
        try:
            if op == "ensure":
                a.ensure(tables[i], n)
                assert len(tables[i]) == max(len(before[0]), a.pages_for(n))
            elif op == "alloc":
                tables[i].extend(a.allocate(n % 8))
            else:
                a.free(tables[i])
        except OutOfPagesError:
            assert (tables[i], a.num_free) == before, "a failed allocation must change nothing"
        a.check_integrity(tables)
        assert a.num_free + sum(map(len, tables)) == a.num_usable


def test_engine_scenarios_keep_integrity_and_survive_preemption(tiny_target):
    """A KV cache too small for the whole batch: requests are preempted and recomputed, pages stay consistent
    after every step (run_to_completion checks), nothing leaks, and greedy outputs equal an uncramped run."""
    rng = random.Random(0)
    prompts = [[rng.randrange(320) for _ in range(n)] for n in (3, 9, 17, 30, 5, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    roomy = run_to_completion(make_core(tiny_target, page_size=4), prompts, params)
    cramped_core = make_core(tiny_target, page_size=4, num_pages=30)  # 116 token slots for ~190 tokens
    cramped = run_to_completion(cramped_core, prompts, params)
    assert cramped_core.num_preemptions > 0
    assert [r.output_token_ids for r in cramped] == [r.output_token_ids for r in roomy]


def test_prompt_larger_than_the_cache_is_rejected_not_hung(tiny_target):
    from specstep.engine.errors import InvalidRequestError
    from specstep.scheduler.core.request import Request

    core = make_core(tiny_target, page_size=4, num_pages=5)  # 16 token slots
    with pytest.raises(InvalidRequestError, match="does not fit the KV cache"):
        core.add_request(Request("big", list(range(20)), SamplingParams(), seed=0))
    core.check_integrity()
    assert core.allocator.num_free == core.allocator.num_usable
