"""Fails the build when a public name of optax_accum has no API entry.

Like optax's ``coverage_check`` builder, but run on every build (html,
doctest) once all pages are read. The public names are taken at build time,
never from a list kept here:

* every name in ``optax_accum.__all__``;
* every name in the ``__all__`` of each public submodule: the package's
  modules whose names do not start with an underscore. Found with ``pkgutil``,
  so a new module is checked as soon as it exists.

A name counts as documented when an autodoc entry (``autofunction``,
``autoclass``, ``autodata``, ...) exists for it under the module that exports
it, or, for a function or class, for the same object under another public
path (``optax_accum.offload.host_state`` is the object documented as
``optax_accum.host_state``). An entry for a ``optax_accum`` name that is
in no ``__all__`` (a removed or deprecated name) fails the build too, so the
reference never documents what the package no longer exports.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from sphinx.application import Sphinx
from sphinx.util import logging

logger = logging.getLogger(__name__)

PACKAGE = "optax_accum"


def public_modules() -> list[str]:
  """The package and its public submodules, imported."""
  package = importlib.import_module(PACKAGE)
  names = [PACKAGE]
  for info in pkgutil.iter_modules(package.__path__):
    if info.name.startswith("_"):
      continue
    names.append(f"{PACKAGE}.{info.name}")
  return names


def public_names() -> dict[str, Any]:
  """``{"module.name": object}`` for every name in a public ``__all__``."""
  out: dict[str, Any] = {}
  for modname in public_modules():
    module = importlib.import_module(modname)
    for name in getattr(module, "__all__", ()):
      out[f"{modname}.{name}"] = getattr(module, name)
  return out


def _resolve(fullname: str) -> Any:
  """The object a documented dotted name refers to, or None."""
  parts = fullname.split(".")
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except ImportError:
      continue
    try:
      for attr in parts[i:]:
        obj = getattr(obj, attr)
    except AttributeError:
      return None
    return obj
  return None


def _is_identifiable(obj: Any) -> bool:
  """Functions and classes are matched by identity; constants by name only."""
  return callable(obj) or isinstance(obj, type)


def check(app: Sphinx, env: Any) -> None:
  objects = env.get_domain("py").objects  # fullname -> (docname, node_id, objtype, aliased)
  documented = {
      name for name, entry in objects.items()
      if name.startswith(PACKAGE + ".") and entry.objtype != "module" and not entry.aliased
  }
  public = public_names()
  documented_ids = {id(obj) for obj in map(_resolve, documented) if _is_identifiable(obj)}

  missing = [
      name for name, obj in sorted(public.items())
      if name not in documented and not (_is_identifiable(obj) and id(obj) in documented_ids)
  ]
  # Top-level entries only (methods and attributes belong to their class).
  public_ids = {id(obj) for obj in public.values() if _is_identifiable(obj)}
  stale = []
  for name in sorted(documented):
    if objects[name].objtype in ("method", "attribute", "property", "classmethod",
                                 "staticmethod"):
      continue
    if name in public:
      continue
    obj = _resolve(name)
    if obj is not None and _is_identifiable(obj) and id(obj) in public_ids:
      continue
    stale.append(f"{name} ({objects[name].docname})")

  for name in missing:
    logger.warning(
        "coverage_check: public name %s has no API entry: add it to a page in docs/api/",
        name, type="coverage_check", subtype="missing")
  for name in stale:
    logger.warning(
        "coverage_check: %s is documented but in no public __all__ (removed or"
        " deprecated): drop its entry", name, type="coverage_check", subtype="stale")
  if not missing and not stale:
    logger.info("coverage_check: all %d public names of %s have an API entry",
                len(public), PACKAGE)


def setup(app: Sphinx) -> dict[str, Any]:
  app.connect("env-check-consistency", check)
  return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
