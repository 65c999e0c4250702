"""The S3 backend's page-by-page listings (`s3list.pages`), over a fake tier that answers scripted pages: the
markers each request carries, and where a listing ends (ftsup/store/DESIGN.md, "Durable tier")."""

from __future__ import annotations

from typing import Any

from ftsup.store import durable
from ftsup.store.durable import s3list


class _Pages:
    """A tier whose `call` answers the pages given, in order (the last again once they run out)."""

    def __init__(self, *answers: dict[str, Any]) -> None:
        self.answers = list(answers)
        self.asked: list[dict[str, Any]] = []

    def call(self, what: str, key: str, fn: Any, **kwargs: Any) -> dict[str, Any]:
        self.asked.append(kwargs)
        return self.answers[min(len(self.asked), len(self.answers)) - 1]


def _listed(tier: _Pages, follow: Any, first: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return list(s3list.pages(tier, "list", "k", None, follow, first, Prefix="p"))  # type: ignore[arg-type]


def test_each_page_asks_with_the_markers_the_page_before_gave() -> None:
    tier = _Pages(
        {"IsTruncated": True, "NextContinuationToken": "t1"},
        {"IsTruncated": True, "NextContinuationToken": "t2"},
        {"IsTruncated": False},
    )
    assert len(_listed(tier, s3list._by_token)) == 3
    assert tier.asked == [
        {"Prefix": "p"},
        {"Prefix": "p", "ContinuationToken": "t1"},
        {"Prefix": "p", "ContinuationToken": "t2"},
    ]


def test_a_store_that_repeats_its_markers_ends_the_listing() -> None:
    tier = _Pages({"IsTruncated": True, "NextKeyMarker": "a", "NextUploadIdMarker": "1"})
    assert len(_listed(tier, s3list._by_upload)) == 2  # the second page repeats the first's markers
    assert tier.asked[1] == {"Prefix": "p", "KeyMarker": "a", "UploadIdMarker": "1"}


def test_a_store_that_says_there_is_more_for_ever_is_read_at_most_max_pages() -> None:
    tier = _Pages(*({"IsTruncated": True, "NextContinuationToken": f"t{i}"} for i in range(s3list.MAX_PAGES + 5)))
    assert len(_listed(tier, s3list._by_token)) == s3list.MAX_PAGES


def test_parts_are_listed_from_marker_0_and_only_forward() -> None:
    from ftsup.store.durable import s3

    tier = _Pages({"IsTruncated": True, "NextPartNumberMarker": 7}, {"IsTruncated": True, "NextPartNumberMarker": 3})
    assert len(_listed(tier, s3._by_part, {"PartNumberMarker": 0})) == 2  # 3 after 7 goes back: the end
    assert [a["PartNumberMarker"] for a in tier.asked] == [0, 7]
    past = _Pages({"IsTruncated": True, "NextPartNumberMarker": durable.MAX_PARTS})
    assert len(_listed(past, s3._by_part, {"PartNumberMarker": 0})) == 1
