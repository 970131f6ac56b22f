"""PageTable's room: reserve_all for many rows at once; room kept past a truncation; and room for work queued ahead
of the scheduler: a held reservation survives the row's next truncate (the commit right after the queuing) and no
later one; releasing the row frees it."""

from __future__ import annotations

from hyperdraft.kvcache.page_table import PageTable


def _table() -> PageTable:
    return PageTable(num_pages=17, page_size=2, max_rows=2, max_pages_per_row=8, device="cpu")


def test_held_room_survives_the_next_truncate_only():
    table = _table()
    row = table.acquire_row()
    assert table.reserve(row, 5)
    assert table.reserve_ahead([row], [11], hold=4)
    pages = table.row_pages(row)[:]
    assert len(pages) == 6
    table.truncate(row, 5)  # the commit after the queuing keeps 4 tokens past its 5: the pages of tokens 0 .. 8
    assert table.row_pages(row) == pages[:5]
    table.truncate(row, 5)  # a later commit rolls back by length as always
    assert table.row_pages(row) == pages[:3]
    table.release_row(row)
    assert table.num_free_slots == table.capacity_slots


def test_room_without_hold_is_rolled_back_and_release_clears_a_hold():
    table = _table()
    row = table.acquire_row()
    assert table.reserve_ahead([row], [11])
    table.truncate(row, 5)
    assert len(table.row_pages(row)) == 3
    assert table.reserve_ahead([row], [11], hold=4)
    table.release_row(row)  # finished or retracted: everything goes back, held or not
    assert table.num_free_slots == table.capacity_slots
    row = table.acquire_row()
    assert table.reserve(row, 3)
    table.truncate(row, 1)  # no hold left over from the row's previous owner
    assert len(table.row_pages(row)) == 1
    table.release_row(row)


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


def test_truncate_keeps_room_or_the_hold_whichever_is_larger():
    table = _table()
    row = table.acquire_row()
    assert table.reserve(row, 12)
    table.truncate(row, 5, room=4)  # tokens 0 .. 8: 5 pages of 2
    assert len(table.row_pages(row)) == 5
    assert table.reserve_ahead([row], [12], hold=2)
    table.truncate(row, 5, room=4)  # the hold (2) is within the room: not added to it
    assert len(table.row_pages(row)) == 5
    assert table.reserve_ahead([row], [14], hold=6)
    table.truncate(row, 5, room=4)  # the hold wins: tokens 0 .. 10
    assert len(table.row_pages(row)) == 6
    table.release_row(row)
    assert table.num_free_slots == table.capacity_slots
