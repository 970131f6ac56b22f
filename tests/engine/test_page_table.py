"""PageTable's room for work queued ahead of the scheduler: a held reservation survives the row's next truncate (the
commit right after the queuing) and no later one; releasing the row frees it."""

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
