"""MkDocs hooks (mkdocs.yml ``hooks:``): the README is the site's home page.

The README links the guides as ``docs/<page>.md`` and the guides link README
sections as ``../README.md#<section>``, which is right on a forge and wrong in
the site, where the guides sit at the root next to the home page.  Both are
rewritten here, so ``mkdocs build --strict`` checks every such link.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

README_LINK = "](../README.md"


def on_files(files: Files, config: Any) -> Files:
    readme = Path(config.config_file_path).parent / "README.md"
    text = readme.read_text(encoding="utf-8").replace("](docs/", "](")
    files.append(File.generated(config, "index.md", content=text))
    return files


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    return markdown.replace(README_LINK, "](index.md")
