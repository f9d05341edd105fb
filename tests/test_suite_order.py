"""The order make test hands the tests out in (tests/conftest.py): the alone tests head the
first worker's share, the quiet ones the second's, and nothing is lost or run twice."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from .conftest import pytest_collection_modifyitems


class Item:
    def __init__(self, name: str, *marks: str) -> None:
        self.nodeid, self.marks = name, set(marks)

    def get_closest_marker(self, name: str):
        return name if name in self.marks else None

    def __repr__(self) -> str:
        return self.nodeid


def _items() -> list[Item]:
    items = [Item(f"t{i}") for i in range(10)]
    items[3].marks.add("quiet")
    items[7].marks.add("alone")
    items[8].marks.add("quiet")
    return items


@pytest.mark.parametrize("workers", [2, 3])
def test_alone_tests_head_the_first_share_and_quiet_ones_the_second(workers):
    items = _items()
    before = list(items)
    pytest_collection_modifyitems(SimpleNamespace(workerinput={"workercount": workers}), items)
    assert sorted(items, key=before.index) == before, "each test once"
    assert items[0].nodeid == "t7"
    second = len(items) // workers  # where xdist's work stealing starts the second share
    assert [i.nodeid for i in items[second : second + 2]] == ["t3", "t8"]
    rest = [i.nodeid for i in items if not i.marks]
    assert rest == [f"t{i}" for i in (0, 1, 2, 4, 5, 6, 9)], "the rest in file order"


def test_outside_xdist_the_order_is_the_files():
    items = _items()
    before = list(items)
    pytest_collection_modifyitems(SimpleNamespace(), items)
    assert items == before


def test_a_test_marked_both_alone_and_quiet_is_refused():
    items = _items()
    items[3].marks.add("alone")
    with pytest.raises(pytest.UsageError, match="t3 is marked both alone and quiet"):
        pytest_collection_modifyitems(SimpleNamespace(), items)
