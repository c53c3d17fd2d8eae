"""Fails the build on a Python code block that does not run.

Every Python block on a page must be a ``sphinx.ext.doctest`` block
(```` ```{testcode} ````, ```` ```{doctest} ````, ```` ```{testsetup} ````,
```` ```{testoutput} ````), which ``sphinx-build -b doctest`` executes, one
namespace per page, top to bottom. A plain ```` ```python ```` fence or a
``code-block`` would be shown and never run, so it is an error here. Blocks
in another language are fine (```` ```bash ````, ```` ```text ````), and a
block in a page under ``docs/`` must name its language. A
``literalinclude`` of Python is allowed only for the files named in
``executed_code_includes`` (files the doctest run executes itself).

No code runs that a reader does not see: ``doctest_global_setup`` must be
empty, and a ```` ```{testsetup} ````, ```` ```{testcleanup} ```` or a block
with ``:hide:`` fails the build. So each page runs, top to bottom, on what it
shows: copied into a fresh interpreter, its code runs too.

Every code block of a page fits the page: a line wider than
``executed_code_max_width`` characters (88: what the theme shows at 1280 px
without a scroll bar) fails the build.

Docstrings pulled in by autodoc are not checked here: their examples are
doctests that the test suite runs (``pytest --doctest-modules``).
"""

from __future__ import annotations

import os
from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util import logging

logger = logging.getLogger(__name__)

PYTHON = frozenset({"python", "py", "python3", "py3", "pycon", "ipython", "ipython3"})


def _check(app: Sphinx, doctree: nodes.document) -> None:
  srcdir = os.path.abspath(app.srcdir)
  allowed = {os.path.abspath(os.path.join(srcdir, p)) for p in app.config.executed_code_includes}
  for node in doctree.findall(nodes.comment):
    if node.get("testnodetype"):  # a doctest block that runs but is not shown
      logger.warning(
          "executed_code: a hidden %s block; show the setup on the page (a reader who copies"
          " the page's code needs it)", node["testnodetype"], location=node,
          type="executed_code", subtype="hidden")
  for node in doctree.findall(nodes.literal_block):
    source = node.source or doctree.get("source") or ""
    if ":docstring of " in source:  # autodoc: the test suite runs these
      continue
    _check_width(node, app.config.executed_code_max_width)
    if node.get("testnodetype"):  # a sphinx.ext.doctest block: it runs
      continue
    language = (node.get("language") or "").lower()
    included = node.get("source")  # set by literalinclude
    if included and os.path.abspath(included) in allowed:
      continue
    in_docs = os.path.abspath(source).startswith(srcdir + os.sep)
    if language in PYTHON or (included and included.endswith(".py")):
      logger.warning(
          "executed_code: a Python block that never runs; write it as ```{testcode}"
          " (or {doctest})", location=node, type="executed_code", subtype="python")
    elif in_docs and language in ("", "default", "none") and not included:
      logger.warning(
          "executed_code: a code block without a language; name it (```bash, ```text)"
          " or make it a {testcode}", location=node, type="executed_code",
          subtype="language")


def _check_width(node: nodes.literal_block, width: int) -> None:
  for i, line in enumerate(node.astext().splitlines(), 1):
    if len(line) > width:
      logger.warning(
          "executed_code: line %d of a code block is %d characters wide, over %d; wrap it",
          i, len(line), width, location=node, type="executed_code", subtype="width")


def _no_global_setup(app: Sphinx, config: Any) -> None:
  for name in ("doctest_global_setup", "doctest_global_cleanup"):
    if (getattr(config, name, "") or "").strip():
      logger.warning(
          "executed_code: %s is set; every page must define what its code uses (show the"
          " setup on the page)", name, type="executed_code", subtype="global_setup")


def setup(app: Sphinx) -> dict[str, Any]:
  app.add_config_value("executed_code_includes", [], "env")
  app.add_config_value("executed_code_max_width", 88, "env")
  app.connect("config-inited", _no_global_setup, priority=900)
  app.connect("doctree-read", _check)
  return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
