"""Readable API pages: public names in signatures, links to the docs they name.

The build has no network, so intersphinx cannot fetch JAX's, optax's or
Flax's inventories. This extension does, offline, what a reader of the API
pages needs from it:

* **Signatures in public names.** ``jax.Array`` is a ``jaxlib._jax.Array``
  and ``optax.GradientTransformation`` an ``optax._src.base`` class; a
  signature shows the name a user writes (``autodoc_type_aliases`` in
  ``conf.py`` does most of it; this catches what it cannot see, such as
  annotations inherited from another package). A default whose ``repr`` is
  not Python (``<no optimizer>``, ``<class 'jax.numpy.float32'>``) is
  rewritten, so the signature parses and its types link.
* **Links into other projects' docs.** A reference to a name of ``jax``,
  ``optax``, ``flax`` or the standard library that no page of ours documents
  resolves to that project's page for it (``missing-reference``).
* **Links to our own names under another public path.**
  ``optax_accum.offload.host_state`` is documented as ``optax_accum.host_state``;
  a reference to either reaches the entry.
* **A check.** After an html build, an API page that still contains a private
  path (``jaxlib._jax``, ``optax._src``) is a warning, so ``-W`` fails.
"""

from __future__ import annotations

import os
import re
from typing import Any

from coverage_check import _resolve  # the one resolver of a documented dotted name
from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.nodes import make_refnode

logger = logging.getLogger(__name__)

JAX = "https://docs.jax.dev/en/latest/"
OPTAX = "https://optax.readthedocs.io/en/latest/"
FLAX = "https://flax.readthedocs.io/en/latest/"
PYTHON = "https://docs.python.org/3/library/"

# Internal paths -> the public name a user writes.
_REWRITES = (
    (re.compile(r"~?(?:jax\.)?jaxlib\.(?:\w+\.)*?_\w+\.(\w+)"), r"jax.\1"),
    (re.compile(r"~?optax\.(?:[a-z]\w*\.)*_\w+(?:\.\w+)*?\.([A-Za-z]\w*)\b"), r"optax.\1"),
    (re.compile(r"<class '([\w.]+)'>"), r"\1"),
    (re.compile(r"TypeAliasForwardRef\('([^']*)'\)"), r"\1"),  # inside generics
    (re.compile(r"(?<![\w.])ShouldSkipUpdateFunction\b"), "optax.ShouldSkipUpdateFunction"),
    # accumulate's `k`: an int or a schedule of the optimizer step (a private alias).
    (re.compile(r"\bKSchedule\b"), "Callable[[jax.Array], Any]"),
    # accumulate's `optimizer` default means "none given": the deprecated
    # chain form; the signature shows the argument as required.
    (re.compile(r" = <no optimizer>"), ""),
)

_OPTAX_PAGES = {
    "api/transformations.html": (
        "GradientTransformation", "GradientTransformationExtraArgs", "OptState", "Params",
        "Updates", "TransformInitFn", "TransformUpdateFn", "apply_every", "clip",
        "clip_by_global_norm", "scale", "scale_by_adam", "scale_by_schedule", "trace",
        "ema", "identity", "set_to_zero", "zero_nans", "add_decayed_weights", "masked",
        "EmptyState", "ScaleByAdamState"),
    "api/optimizer_wrappers.html": (
        "MultiSteps", "MultiStepsState", "ShouldSkipUpdateFunction", "skip_large_updates",
        "skip_not_finite", "apply_if_finite", "lookahead", "maybe_update", "flatten"),
    "api/optimizers.html": (
        "adam", "adamw", "sgd", "lion", "adafactor", "lamb", "lars", "rmsprop", "adagrad",
        "adabelief", "nadam", "nadamw", "radam", "sm3", "yogi", "novograd", "fromage",
        "noisy_sgd", "muon", "adamax", "adamaxw", "amsgrad", "adan", "adadelta", "polyak_sgd",
        "sign_sgd", "optimistic_gradient_descent", "lbfgs", "rprop"),
    "api/combining_optimizers.html": ("chain", "multi_transform", "named_chain", "partition"),
    "api/apply_updates.html": ("apply_updates", "incremental_update", "periodic_update"),
}
_OPTAX_ANCHORED = {name: page for page, names in _OPTAX_PAGES.items() for name in names}

_FLAX = {
    "flax.nnx.Optimizer": "api_reference/flax.nnx/training/optimizer.html"
                          "#flax.nnx.optimizer.Optimizer",
    "flax.nnx.optimizer.Optimizer": "api_reference/flax.nnx/training/optimizer.html"
                                    "#flax.nnx.optimizer.Optimizer",
    "flax.training.train_state.TrainState": "api_reference/flax.training.html"
                                            "#flax.training.train_state.TrainState",
}

_PY_BUILTINS = {
    "int": "functions.html#int", "float": "functions.html#float", "bool": "functions.html#bool",
    "complex": "functions.html#complex", "str": "stdtypes.html#str",
    "tuple": "stdtypes.html#tuple", "list": "stdtypes.html#list", "dict": "stdtypes.html#dict",
    "None": "constants.html#None",
}


def public_name(text: str) -> str:
  """``text`` with internal module paths replaced by public names."""
  for pattern, repl in _REWRITES:
    text = pattern.sub(repl, text)
  return text


def external_url(target: str) -> str | None:
  """The documentation page of a name of jax, optax, flax or Python, or None."""
  target = target.lstrip("~")
  if target.startswith("jax."):
    if target.startswith(("jax.sharding.", "jax.typing.")):
      module = target.rsplit(".", 1)[0]
      return f"{JAX}{module}.html#{target}"
    return f"{JAX}_autosummary/{target}.html"
  if target.startswith("optax."):
    name = target.split(".", 1)[1]
    if name in _OPTAX_ANCHORED:
      return f"{OPTAX}{_OPTAX_ANCHORED[name]}#optax.{name}"
    if name.startswith("microbatching"):
      return f"{OPTAX}api/microbatching.html"
    if name.startswith("schedules.") or name.endswith("_schedule") or name == "Schedule":
      return f"{OPTAX}api/optimizer_schedules.html"
    if name.startswith("contrib."):
      return f"{OPTAX}api/contrib.html#{target}"
    if name.startswith("tree."):
      return f"{OPTAX}api/tree_utilities.html#{target}"
    return f"{OPTAX}search.html?q={target}"
  if target.startswith("flax."):
    return FLAX + _FLAX[target] if target in _FLAX else f"{FLAX}search.html?q={target}"
  if target in _PY_BUILTINS:
    return PYTHON + _PY_BUILTINS[target]
  for module in ("typing", "collections.abc", "functools", "dataclasses"):
    if target.startswith(module + ".") and target.count(".") == module.count(".") + 1:
      return f"{PYTHON}{module}.html#{target}"
  return None


def _documented_by_identity(env: Any) -> dict[int, str]:
  """``{id(object): documented name}`` for functions and classes of ours."""
  objects = env.get_domain("py").objects
  cache = getattr(env, "_api_links_ids", None)
  if cache is not None and cache[0] == len(objects):
    return cache[1]
  ids: dict[int, str] = {}
  for name, entry in objects.items():
    if not name.startswith("optax_accum.") or entry.objtype == "module" or entry.aliased:
      continue
    obj = _resolve(name)
    if obj is not None and (callable(obj) or isinstance(obj, type)):
      ids.setdefault(id(obj), name)
  env._api_links_ids = (len(objects), ids)
  return ids


def missing_reference(app: Sphinx, env: Any, node: Any, contnode: nodes.Node) -> Any:
  if node.get("refdomain") != "py":
    return None
  target = node.get("reftarget", "")
  module = node.get("py:module") or ""
  # One of ours, documented under another public path.
  candidates = [target, f"{module}.{target}" if module else "", f"optax_accum.{target}"]
  ids = _documented_by_identity(env)
  for candidate in filter(None, candidates):
    if not candidate.startswith("optax_accum."):
      continue
    obj = _resolve(candidate)
    if obj is None or id(obj) not in ids:
      continue
    name = ids[id(obj)]
    entry = env.get_domain("py").objects[name]
    return make_refnode(app.builder, node["refdoc"], entry.docname, entry.node_id, contnode,
                        name)
  # Another project's name.
  url = external_url(public_name(target))
  if url is None:
    return None
  ref = nodes.reference("", "", internal=False, refuri=url, reftitle=public_name(target))
  ref.append(contnode)
  return ref


def process_signature(app: Sphinx, what: str, name: str, obj: Any, options: Any,
                      signature: str | None, return_annotation: str | None) -> Any:
  if signature is None and return_annotation is None:
    return None
  fix = lambda s: public_name(s) if s else s
  return fix(signature), fix(return_annotation)


def public_names_in_doctree(app: Sphinx, doctree: nodes.document) -> None:
  """The same rewrite on what autodoc wrote outside signatures (attribute types)."""
  from sphinx import addnodes

  for desc in doctree.findall(addnodes.desc):
    for xref in desc.findall(addnodes.pending_xref):
      if "reftarget" in xref:
        xref["reftarget"] = public_name(xref["reftarget"])
    for text in list(desc.findall(nodes.Text)):
      new = public_name(text.astext())
      if new != text.astext():
        text.parent.replace(text, nodes.Text(new))


def check_api_pages(app: Sphinx, exception: Exception | None) -> None:
  if exception is not None or app.builder.format != "html":
    return
  api_dir = os.path.join(app.outdir, "api")
  if not os.path.isdir(api_dir):
    return
  for filename in sorted(os.listdir(api_dir)):
    if not filename.endswith(".html"):
      continue
    with open(os.path.join(api_dir, filename), encoding="utf-8") as f:
      text = f.read()
    for private in ("jaxlib._jax", "optax._src"):
      count = text.count(private)
      if count:
        logger.warning("api_links: api/%s shows the private path %s %d times; add the public"
                       " name to autodoc_type_aliases or _REWRITES", filename, private, count,
                       type="api_links", subtype="private_path")


def setup(app: Sphinx) -> dict[str, Any]:
  app.connect("missing-reference", missing_reference)
  app.connect("autodoc-process-signature", process_signature)
  app.connect("doctree-read", public_names_in_doctree)
  app.connect("build-finished", check_api_pages)
  return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
