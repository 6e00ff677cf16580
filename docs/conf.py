"""Sphinx configuration: the API reference, generated from the docstrings by autodoc.

Build with warnings as errors::

    pip install ".[docs]"
    sphinx-build -W -b html docs build/docs

The guides are the Markdown pages beside this file; Sphinx reads only the ``.rst`` pages,
which link to them.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

import totalreduce  # noqa: E402

project = "totalreduce"
author = "the totalreduce authors"
copyright = "the totalreduce authors; Apache-2.0"
version = release = totalreduce.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.viewcode"]
source_suffix = {".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path: list[str] = []

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
# totalreduce.torch needs torch, which is optional: without it its page documents the
# names from a stand-in module, so the reference builds the same.
try:
    import torch  # noqa: F401
except ImportError:
    autodoc_mock_imports = ["torch"]
