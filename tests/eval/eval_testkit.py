"""Constants and helpers shared by the eval tests (imported as `eval_testkit`; tests/eval is on the path)."""

import html.parser

TINY_LABELS = "0,1,2,3"
FAST = dict(steps=4, guidance=1.0, repeats=1, warmup=0)  # 4 transformer calls per generation, no CFG


class HtmlChecker(html.parser.HTMLParser):
    """Parses a report: tag nesting errors, <img> sources, table rows, links to anything but data: URLs."""

    VOID = {"meta", "img", "br", "hr", "link", "input"}

    def __init__(self):
        super().__init__()
        self.stack, self.images, self.rows, self.errors, self.links = [], [], 0, [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs.get("src", ""))
        if tag == "tr":
            self.rows += 1
        for key in ("src", "href"):
            if key in attrs and not attrs[key].startswith("data:"):
                self.links.append(attrs[key])
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"unexpected </{tag}> with open {self.stack[-3:]}")
        else:
            self.stack.pop()
