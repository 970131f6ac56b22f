"""PageTable's room: reserve_all for many rows at once; room kept past a truncation; and room for work queued ahead
of the scheduler, all or nothing, rolled back by length like any other and freed with the row."""

from __future__ import annotations

from hyperdraft.kvcache.page_table import PageTable


def _table() -> PageTable:
    return PageTable(num_pages=17, page_size=2, max_rows=2, max_pages_per_row=8, device="cpu")


def test_queued_room_is_rolled_back_past_the_kept_room_and_release_frees_it():
    table = _table()
    row = table.acquire_row()
    assert table.reserve(row, 5)
    assert table.reserve_ahead([row], [11])  # work queued ahead writes up to token 10
    pages = table.row_pages(row)[:]
    assert len(pages) == 6
    table.truncate(row, 5, room=4)  # the commit after it keeps the next round's room: tokens 0 .. 8
    assert table.row_pages(row) == pages[:5]
    table.truncate(row, 5)  # rollback by length
    assert table.row_pages(row) == pages[:3]
    assert table.reserve_ahead([row], [11])
    table.release_row(row)  # finished or retracted: everything goes back
    assert table.num_free_slots == table.capacity_slots


def test_reserve_all_is_all_or_nothing_and_hands_out_pages_as_reserve_does():
    """reserve_all gives every row its room with the pages one reserve() per row would give, in row order, or changes
    nothing when the pool is short; a row past its width is an error before anything is taken."""
    bulk, single = (PageTable(num_pages=12, page_size=2, max_rows=2, max_pages_per_row=8, device="cpu")
                    for _ in range(2))
    rows = [t.acquire_row() for t in (bulk, single) for _ in range(2)]
    assert bulk.reserve_all(rows[:2], [3, 6])
    assert single.reserve(rows[2], 3) and single.reserve(rows[3], 6)
    assert [bulk.row_pages(r) for r in rows[:2]] == [single.row_pages(r) for r in rows[2:]]
    assert bulk.reserve_all(rows[:2], [2, 6])  # room already there: nothing taken
    assert bulk.num_free_slots == single.num_free_slots
    free_before, pages_before = bulk.num_free_slots, [bulk.row_pages(r) for r in rows[:2]]
    assert not bulk.reserve_all(rows[:2], [16, 16])  # 11 more pages, 6 free
    assert bulk.num_free_slots == free_before and [bulk.row_pages(r) for r in rows[:2]] == pages_before
    try:
        bulk.reserve_all(rows[:2], [4, 17])  # 9 pages > 8 per row
        raise AssertionError("no error for a row past its width")
    except ValueError as e:
        assert "page table row" in str(e)
    assert bulk.num_free_slots == free_before
    assert not bulk.reserve_ahead(rows[:2], [4, 17])  # queued work is refused instead
    for r in rows[:2]:
        bulk.release_row(r)
    assert bulk.num_free_slots == bulk.capacity_slots


def test_truncate_keeps_its_room():
    table = _table()
    row = table.acquire_row()
    assert table.reserve(row, 12)
    table.truncate(row, 5, room=4)  # tokens 0 .. 8: 5 pages of 2
    assert len(table.row_pages(row)) == 5
    table.truncate(row, 5, room=6)  # room is kept, never taken: still 5 pages
    assert len(table.row_pages(row)) == 5
    table.truncate(row, 5, room=1)  # tokens 0 .. 5: 3 pages
    assert len(table.row_pages(row)) == 3
    table.release_row(row)
    assert table.num_free_slots == table.capacity_slots
