"""Sphinx configuration: the API reference, built from the package's docstrings.

make docs      # sphinx-build -W: a warning fails the build
"""

project = "large-model-support"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
autodoc_typehints = "description"
autodoc_member_order = "bysource"
default_role = "py:obj"  # `lms.LMS` in a docstring links where it can, and is code where not
napoleon_google_docstring = True
napoleon_numpy_docstring = False
exclude_patterns = ["_build"]
html_theme = "alabaster"
