"""Pages of the KV pools: one allocator and one page table per request, shared by target and draft.

Page 0 is the dummy page (see `engine.kv_cache`), never handed out.
"""

from __future__ import annotations

from collections.abc import Iterable

from specstep.engine.errors import OutOfPagesError
from specstep.engine.kv_cache import DUMMY_PAGE


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError("need at least 2 pages (page 0 is the dummy page)")
        self.num_pages = num_pages
        self.page_size = page_size
        # LIFO free list: recently freed pages are reused first (warm in cache).
        self._free = [p for p in range(num_pages - 1, 0, -1)]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @staticmethod
    def step_tokens(num_tokens: int, num_draft: int = 0, lookahead: int = 0) -> int:
        """The one rule for what a step writes: positions a request's page table must hold for a step over its
        `num_tokens` known tokens (the last one fed by the step), `num_draft` drafts, the bonus token after them,
        and the proposer's `lookahead` past the verify window."""
        return num_tokens + num_draft + 1 + lookahead

    def max_prompt_tokens(self, lookahead: int = 0) -> int:
        """The longest prompt whose prefill and first decode step fit the whole cache (`step_tokens` over the
        prompt and its sampled token)."""
        return self.num_usable * self.page_size - self.step_tokens(1, 0, lookahead)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"need {n} KV pages, {len(self._free)} free of {self.num_usable}")
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        return pages[::-1]

    def ensure(self, page_table: list[int], num_tokens: int) -> None:
        """Grow `page_table` in place so it can hold `num_tokens` tokens."""
        need = self.pages_for(num_tokens) - len(page_table)
        if need > 0:
            page_table.extend(self.allocate(need))

    def can_fit(self, page_table: list[int], num_tokens: int) -> bool:
        return self.pages_for(num_tokens) - len(page_table) <= len(self._free)

    def reserve(self, page_tables: list[list[int]], num_tokens: list[int]) -> bool:
        """Grow every table to hold its `num_tokens`, or none of them if the free pages do not cover all."""
        short = sum(max(0, self.pages_for(n) - len(t)) for t, n in zip(page_tables, num_tokens))
        if short > len(self._free):
            return False
        for t, n in zip(page_tables, num_tokens):
            self.ensure(t, n)
        return True

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))
        pages.clear()

    def check_integrity(self, page_tables: Iterable[list[int]]) -> None:
        """Every page except the dummy is free or owned exactly once. Raises AssertionError otherwise."""
        seen: dict[int, str] = {}
        for p in self._free:
            if p in seen:
                raise AssertionError(f"page {p} is on the free list twice")
            seen[p] = "free"
        for i, table in enumerate(page_tables):
            for p in table:
                if p == DUMMY_PAGE or not 0 < p < self.num_pages:
                    raise AssertionError(f"request {i} owns invalid page {p}")
                if p in seen:
                    raise AssertionError(f"page {p} owned by request {i} is also {seen[p]}")
                seen[p] = f"owned by request {i}"
        lost = set(range(1, self.num_pages)) - seen.keys()
        if lost:
            raise AssertionError(f"pages neither free nor owned (leaked): {sorted(lost)[:10]}")
