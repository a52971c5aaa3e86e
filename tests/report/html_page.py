"""An HTML page parsed with the standard library, for the report tests: every element with its attributes, its
ancestors and the text inside it."""

from __future__ import annotations

from dataclasses import dataclass, field
from html.parser import HTMLParser


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    ancestors: tuple[Element, ...]
    text: list[str] = field(default_factory=list)

    @property
    def classes(self) -> set[str]:
        return set((self.attrs.get("class") or "").split())

    def inside(self, tag: str, cls: str | None = None) -> bool:
        return any(a.tag == tag and (cls is None or cls in a.classes) for a in self.ancestors)

    @property
    def content(self) -> str:
        return "".join(self.text).strip()


class Page(HTMLParser):
    """Every element of the page with its attributes, its ancestors and the text inside it."""

    VOID = {"meta", "br", "img", "input", "link", "hr", "source", "wbr"}

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.elements: list[Element] = []
        self._open: list[Element] = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        element = Element(tag, {k: v or "" for k, v in attrs}, tuple(self._open))
        self.elements.append(element)
        if tag not in self.VOID:
            self._open.append(element)

    def handle_startendtag(self, tag, attrs):
        self.elements.append(Element(tag, {k: v or "" for k, v in attrs}, tuple(self._open)))

    def handle_endtag(self, tag):
        for index in range(len(self._open) - 1, -1, -1):
            if self._open[index].tag == tag:
                del self._open[index:]
                return

    def handle_data(self, data):
        for element in self._open:
            element.text.append(data)

    def find(self, tag: str, cls: str | None = None) -> list[Element]:
        return [e for e in self.elements if e.tag == tag and (cls is None or cls in e.classes)]

    def rows(self, table_class: str) -> list[Element]:
        return [e for e in self.find("tr") if e.inside("table", table_class) and e.inside("tbody")]
