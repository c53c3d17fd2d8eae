"""Sphinx configuration for the optax_accum docs.

The layout follows optax's docs: myst pages, sphinx-book-theme, an API
reference from the docstrings (autodoc + autosummary + napoleon) and a
coverage check that fails the build when a public name has no entry
(``_ext/coverage_check.py``). Every Python code block on a page is a
``sphinx.ext.doctest`` block, run by ``sphinx-build -b doctest``, and
``_ext/executed_code.py`` fails the build on any that is not, and on any
hidden setup: each page defines what its code uses, so that a reader can copy
it into a fresh interpreter. ``_ext/api_links.py`` keeps the API pages in
public names and links types into JAX's, optax's and Flax's docs. See
``development/index.md`` for the commands.
"""

import os
import sys

# Before anything imports jax: the CPU backend with 8 host devices, so the
# multi-device examples run the real thing on any machine (as tests/conftest.py).
# OPTAX_ACCUM_DOCS_DEVICES=1 builds on the platform's one device (.ci/run runs the
# pages that say they run on any number of devices that way too).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ.get("OPTAX_ACCUM_DOCS_DEVICES") != "1":
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "_ext"))
sys.path.insert(0, os.path.dirname(HERE))

import optax_accum  # noqa: E402

project = "optax_accum"
author = "The optax_accum authors"
copyright = "2026, the optax_accum authors"
release = optax_accum.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "sphinx.ext.mathjax",
    # MathJax 3 from the docs extra, copied into _static: the pages' math renders
    # offline (sphinx.ext.mathjax alone loads it from a CDN).
    "sphinx-mathjax-offline",
    "sphinx.ext.viewcode",
    "coverage_check",
    "executed_code",
    "api_links",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md", "**/.ipynb_checkpoints"]
templates_path = []

# -- myst ---------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist", "dollarmath"]
myst_heading_anchors = 3

# -- autodoc / napoleon --------------------------------------------------------
autosummary_generate = False  # the API pages are written by hand, as in optax
autodoc_default_options = {"member-order": "bysource"}
autodoc_typehints = "signature"
# Annotations by the names a user writes (the modules use
# `from __future__ import annotations`, so these are the source's strings),
# not by where the classes happen to live (jaxlib._jax.Array, optax._src...).
autodoc_type_aliases = {
    name: name for name in (
        "jax.Array",
        "optax.GradientTransformation",
        "optax.GradientTransformationExtraArgs",
        "optax.MultiStepsState",
        "optax.OptState",
        "optax.Params",
        "optax.Schedule",
        "optax.Updates",
    )
}
autodoc_type_aliases["ShouldSkipUpdateFunction"] = "optax.ShouldSkipUpdateFunction"
autodoc_member_order = "bysource"
add_module_names = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_attr_annotations = True

# -- doctest: every Python block on a page runs --------------------------------
# Each page is one namespace (the default group), run top to bottom in a fresh
# interpreter state, with no global or hidden setup: a page that continues the
# toy problem of "Getting started" shows its setup itself (executed_code.py
# fails the build on doctest_global_setup and on {testsetup} blocks).
# Docstring examples (reST doctest blocks pulled in by autodoc) already run in
# the test suite (pytest --doctest-modules); here only the pages' blocks run.
doctest_test_doctest_blocks = ""
executed_code_includes = []  # no literalinclude of Python: a page shows the code it runs

# -- html ----------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = f"optax_accum {release}"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": True,
    "use_download_button": False,
    "use_fullscreen_button": False,
    "navigation_with_keys": False,
    # One search box (the sidebar's): the pydata theme this version of
    # sphinx-book-theme runs on would add a second one in a top bar.
    "navbar_persistent": [],
}
html_show_sourcelink = False
pygments_style = "default"
